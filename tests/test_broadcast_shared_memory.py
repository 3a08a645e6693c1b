"""Shared-memory broadcast: slots are never rewritten while a server serves from them (also across processes, also
when a server dies), superseded updates are refused, the embedded server serves straight from the slot, and 'auto'
picks shared memory on one machine and the object store otherwise."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl.broadcast import BroadcastConfig, WeightSubscriber, make_transport
from marin_rl.broadcast.auto import AutoTransport
from marin_rl.broadcast.shared_memory import (
    PRIVATE_PREFIX,
    SharedMemoryTransport,
    SupersededUpdate,
    remove_stale_directories,
)
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.tokenizer import build_char_tokenizer


def _leaves(fill: float):
    return [np.full((300, 1000), fill, np.float32), np.full((7,), fill, np.float32), np.arange(4, dtype=np.int32)]


@pytest.fixture
def shm_dir():
    path = f"/dev/shm/marin_rl-test-{os.getpid()}-{time.time_ns()}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_publish_waits_for_the_slot_a_server_serves_from(shm_dir):
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir, keep=2))
    server = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    try:
        served = server.fetch(learner.publish(1, _leaves(1.0)))  # server serves version 1 from its slot
        server.applied(server.latest())
        learner.publish(2, _leaves(2.0))  # into the other slot
        third: list = []
        writer = threading.Thread(target=lambda: third.append(learner.publish(3, _leaves(3.0))))
        writer.start()
        time.sleep(0.5)
        # Both slots are taken (version 1 is served, version 2 is the latest): the publish waits, version 1 intact.
        assert not third and writer.is_alive()
        assert all((a == 1.0).all() for a in served[:2])
        new = server.fetch(server.latest())
        assert all((a == 2.0).all() for a in new[:2])
        server.applied(server.latest())  # version 2 is served now: version 1's slot is free
        writer.join(10)
        assert third and third[0].version == 3
        assert all((a == 2.0).all() for a in new[:2]), "the slot being served was not touched"
        assert all((a == 3.0).all() for a in server.fetch(server.latest())[:2])
    finally:
        server.close()
        learner.close()
    assert not os.path.exists(os.path.join(shm_dir, "slot-0")), "close removes the slots"


def test_an_update_overwritten_since_is_refused_not_served(shm_dir):
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    server = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    try:
        old = learner.publish(1, _leaves(1.0))
        learner.publish(2, _leaves(2.0))
        learner.publish(3, _leaves(3.0))  # no server held version 1's slot: it now holds version 3
        with pytest.raises(SupersededUpdate, match="overwritten"):
            server.fetch(old)
        assert all((a == 3.0).all() for a in server.fetch(server.latest())[:2])
    finally:
        server.close()
        learner.close()


def test_bfloat16_cast_happens_in_the_copy(shm_dir):
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir, dtype="bfloat16"))
    try:
        leaves = [np.random.default_rng(0).normal(size=(64, 33)).astype(np.float32), np.arange(3, dtype=np.int32)]
        update = learner.publish(1, [jax.numpy.asarray(x) for x in leaves])
        assert update.num_bytes == 64 * 33 * 2 + 3 * 4
        got = learner.fetch(update)
        np.testing.assert_array_equal(got[0], leaves[0].astype(jax.numpy.bfloat16))
        np.testing.assert_array_equal(got[1], leaves[1])
    finally:
        learner.close()


READER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from marin_rl.broadcast import BroadcastConfig, make_transport

    server = make_transport(BroadcastConfig(transport="shared_memory", path=sys.argv[1]))
    while server.latest() is None:
        time.sleep(0.01)
    arrays = server.fetch(server.latest())
    print("serving", server.latest().version, float(arrays[0][0, 0]), flush=True)
    time.sleep(600)  # holds the slot until killed
    """
)


def test_a_server_in_another_process_holds_its_slot_until_it_dies(shm_dir):
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    proc = subprocess.Popen([sys.executable, "-c", READER, shm_dir], stdout=subprocess.PIPE, text=True)
    try:
        learner.publish(1, _leaves(1.0))
        assert proc.stdout.readline().split() == ["serving", "1", "1.0"]
        learner.publish(2, _leaves(2.0))
        third: list = []
        writer = threading.Thread(target=lambda: third.append(learner.publish(3, _leaves(3.0))))
        writer.start()
        time.sleep(0.5)
        assert not third, "the other process still serves version 1 from its slot"
        proc.send_signal(signal.SIGKILL)  # its lock dies with it
        writer.join(10)
        assert third and third[0].version == 3
    finally:
        proc.kill()
        proc.wait()
        learner.close()


def test_servers_on_another_machine_get_a_clear_error(shm_dir):
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    try:
        update = learner.publish(1, _leaves(1.0))
        update.payload = {**update.payload, "host": "elsewhere/0"}
        with pytest.raises(RuntimeError, match="'ray' or 'arrow_flight'"):
            make_transport("shared_memory").fetch(update)
    finally:
        learner.close()


def test_slots_of_a_killed_learner_are_removed_by_the_next_one():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/{PRIVATE_PREFIX}{dead.pid}-deadbeef"
    os.makedirs(stale)
    with open(os.path.join(stale, "slot-0"), "wb") as f:
        f.write(b"x" * 4096)
    assert stale in remove_stale_directories()
    assert not os.path.exists(stale)
    learner = SharedMemoryTransport()  # a private directory, removed by close
    learner.publish(1, _leaves(1.0))
    private = learner.directory
    assert os.path.basename(private).startswith(f"{PRIVATE_PREFIX}{os.getpid()}-")
    learner.close()
    assert not os.path.exists(private)


def test_embedded_server_serves_straight_from_the_slot(shm_dir):
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(), len(tok))
    srv = LevanterInferenceServer(
        model, tok, InferenceConfig(max_seqs=2, max_seq_len=32, levanter=LevanterServerConfig(page_size=16)), name="s"
    )
    learner = make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir))
    subscriber = WeightSubscriber(
        make_transport(BroadcastConfig(transport="shared_memory", path=shm_dir)), srv.apply_weights
    )
    try:
        leaves = [np.asarray(x) + 1 for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
        learner.publish(4, leaves)
        assert subscriber.poll()["version"] == 4 and srv.version == 4
        served = jax.tree_util.tree_leaves(eqx.filter(srv.context.model, eqx.is_array))
        mapping = next(iter(subscriber.transport._readers.values())).mm
        base = np.frombuffer(mapping, np.uint8).ctypes.data
        for got, want in zip(served, leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
            # zero-copy: the device array's buffer lies inside the slot's mapping
            assert base <= got.unsafe_buffer_pointer() < base + len(mapping)
    finally:
        subscriber.transport.close()
        learner.close()
        srv.stop()


def test_auto_picks_shared_memory_on_one_machine_and_ray_when_it_cannot(monkeypatch, shm_dir):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        def serve(update):  # a server process: the 'auto' transport follows the update's transport
            transport = make_transport(BroadcastConfig())
            arrays = transport.fetch(update)
            transport.applied(update)
            return [a.tobytes() for a in arrays]

        learner = AutoTransport(BroadcastConfig(transport="auto", path=shm_dir))
        update = learner.publish(1, _leaves(1.0))
        assert learner.chosen == "shared_memory" and update.transport == "shared_memory"
        assert ray.get(serve.remote(update)) == [x.tobytes() for x in _leaves(1.0)]
        learner.close()

        # Too little room in the memory filesystem for two slots: the object store.
        total = sum(x.nbytes for x in _leaves(1.0))
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, total))
        learner = AutoTransport(BroadcastConfig(transport="auto", path=shm_dir))
        update = learner.publish(1, _leaves(2.0))
        assert learner.chosen == "ray" and update.transport == "ray"
        assert ray.get(serve.remote(update)) == [x.tobytes() for x in _leaves(2.0)]
        learner.close()
    finally:
        ray.shutdown()
