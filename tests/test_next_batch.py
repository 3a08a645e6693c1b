"""`next_batch`: how the Levanter server and the reward server group queued requests into batches."""

from __future__ import annotations

import queue
import threading
import time

from marin_rl.inference.http_server import BATCH_WINDOW_CAP, next_batch


def _queue(*items) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for item in items:
        q.put(item)
    return q


def test_a_batch_takes_what_is_queued_up_to_its_capacity():
    q = _queue(1, 2, 3, 4, 5)
    assert next_batch(q, threading.Event(), timeout=0.05, capacity=3) == [1, 2, 3]
    assert next_batch(q, threading.Event(), timeout=0.05, capacity=3) == [4, 5]


def test_capacity_counts_each_request_by_its_size():
    q = _queue([1, 1], [2, 2, 2], [3])
    assert next_batch(q, threading.Event(), timeout=0.05, capacity=4, size=len) == [[1, 1], [2, 2, 2]]
    assert next_batch(q, threading.Event(), timeout=0.05, capacity=4, size=len) == [[3]]


def test_a_batch_keeps_growing_while_requests_arrive_less_than_the_timeout_apart_but_no_longer_than_the_cap():
    q: queue.Queue = queue.Queue()
    timeout = 0.2

    def trickle():  # 1,000 requests 5 ms apart: longer than BATCH_WINDOW_CAP timeouts
        for i in range(1000):
            q.put(i)
            time.sleep(0.005)

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    batch = next_batch(q, threading.Event(), timeout=timeout, capacity=1000)
    took = time.monotonic() - start
    assert 1 < len(batch) < 1000 and batch == list(range(len(batch)))
    assert took < BATCH_WINDOW_CAP * timeout + 1.0


def test_none_once_stopped():
    stop = threading.Event()
    stop.set()
    assert next_batch(_queue(1), stop, timeout=0.05, capacity=2) is None
