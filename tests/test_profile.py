"""The loop profile accounts the driver's time exactly once, and the servers' busy counters count what they say."""

from __future__ import annotations

import time

import pytest

from marin_rl.inference.openai_api import FrontEndCounters
from marin_rl.orchestrator.profile import LoopProfile, format_profile


def test_sections_nest_and_split_the_driver_time_exactly():
    profile = LoopProfile()
    with profile.section("book"):
        time.sleep(0.02)
        with profile.section("eval"):
            time.sleep(0.05)
    with profile.section("wait"):
        time.sleep(0.03)
    step = profile.end_step(learner_step_s=0.04)
    assert step["profile/driver/eval_s"] == pytest.approx(0.05, abs=0.015)
    assert step["profile/driver/book_s"] == pytest.approx(0.02, abs=0.015)  # without the nested evaluation
    assert step["profile/driver/wait_s"] == pytest.approx(0.03, abs=0.015)
    covered = sum(v for k, v in step.items() if k.startswith("profile/driver/"))
    assert covered == pytest.approx(step["profile/step_s"], abs=0.005)  # nothing counted twice, little missed
    assert step["profile/learner_busy"] == pytest.approx(0.04 / step["profile/step_s"])
    with profile.section("wait"):
        time.sleep(0.01)
    second = profile.end_step(learner_step_s=0.0)
    assert set(second) == {"profile/driver/wait_s", "profile/step_s", "profile/learner_busy"}  # per step, reset
    summary = profile.summary()
    assert summary["steps"] == 2
    assert summary["driver_s"]["wait"] == pytest.approx(step["profile/driver/wait_s"] + second["profile/driver/wait_s"])
    assert list(summary["driver_s"]) == ["wait", "book", "eval"]  # report order
    assert summary["learner_busy"] == pytest.approx(0.04 / summary["wall_s"])


def test_summary_derives_overheads_from_the_counters():
    profile = LoopProfile()
    profile.observe_servers({"servers/0/busy_s": 10.0, "servers/0/engine_s": 7.0, "servers/1/busy_s": 0.0})
    profile.count(groups=4, group_s=2.0, turnaround_s=3.0, requests=40, request_s=1.2, backend_s=0.6, queue_s=0.2)
    time.sleep(0.05)
    profile.observe_servers(
        {
            "servers/0/busy_s": 10.04,  # counters count from the server's start: only the increase is the run's
            "servers/0/engine_s": 7.01,
            "servers/1/busy_s": 0.02,
            "servers/0/version": 3.0,  # not a time counter
        }
    )
    s = profile.summary()
    assert s["server_busy"] == pytest.approx(0.06 / (2 * s["wall_s"]))
    assert s["server_engine_busy"] == pytest.approx(0.01 / (2 * s["wall_s"]))
    assert s["requests"] == 40
    assert s["server_request_s"] == pytest.approx(0.6 / 40)
    assert s["request_latency_s"] == pytest.approx(1.2 / 40)
    assert s["request_overhead_s"] == pytest.approx(0.6 / 40)
    assert s["request_queue_s"] == pytest.approx(0.2 / 40)
    assert s["group_in_actor_s"] == 0.5 and s["group_turnaround_s"] == 0.75
    assert s["group_outside_actor_s"] == pytest.approx(0.25)
    text = format_profile(s)
    assert "15.0 ms HTTP/client overhead" in text and "250 ms in Ray" in text
    foreign = LoopProfile()  # servers that do not report their time: no overhead is made up
    foreign.count(requests=5, request_s=1.0, backend_s=0.0)
    assert "request_overhead_s" not in foreign.summary() and "server_busy" not in foreign.summary()


def test_front_end_busy_time_counts_overlapping_requests_once():
    counters = FrontEndCounters()
    counters.request_started()
    time.sleep(0.03)
    counters.request_started()  # overlaps the first
    time.sleep(0.03)
    counters.request_ended()
    counters.request_ended()
    time.sleep(0.05)  # idle: not busy
    assert counters.busy_s == pytest.approx(0.06, abs=0.015)
    assert counters.requests == 2 and counters.outstanding == 0
    counters.request_started()
    time.sleep(0.02)
    assert counters.busy_s == pytest.approx(0.08, abs=0.02)  # a request in progress counts as it goes
