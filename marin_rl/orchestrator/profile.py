"""Where a run's wall time goes: the driver's loop split into what it was doing, beside how busy the learner, the
inference servers and the env actors were over the same time.

The driver is one thread, so its time splits exactly: every moment of the loop is in one section (`batch`: forming a
batch and starting the learner step; `launch`: starting groups; `wait`: blocked until a group or the learner step
finishes, i.e. idle; `collect`: fetching finished groups from Ray; `admit`: validating them into the replay buffers;
`book`: booking a finished step; the step hooks `publish`, `broadcast`, `eval`, `export`, `checkpoint`; `recover`:
replacing a dead learner). The other parts work concurrently with it and get busy fractions of the same wall time:

- learner: time inside its train steps (`learner/step_time_s`) over wall time;
- servers: time with at least one request in progress (`busy`), and, for the embedded engine, time inside engine
  calls (`engine`), each over wall time, averaged over servers;
- requests (training's; evaluation has a client of its own): mean latency seen by the env actors' clients against
  the mean time the server's backend took for the same requests (it reports it in each answer), the difference
  being HTTP, JSON, event-loop and client-queue time per request; the client-queue part (waiting for one of the
  client's connection slots per server) is counted on its own (`request_queue_s`);
- groups: mean time a group spends inside its env actor against the driver's launch-to-collect time, the difference
  being Ray scheduling, transfer and the time a finished group waits for the driver to look.

Totals over the run go into the summary (`profile`), per-step figures into the metrics (`profile/...`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

DRIVER_SECTIONS = (
    "batch",
    "launch",
    "wait",
    "collect",
    "admit",
    "book",
    "publish",
    "broadcast",
    "eval",
    "export",
    "checkpoint",
)
"""The driver's sections in report order (`recover` and any other section follow when they occurred)."""


class LoopProfile:
    """Accumulates the driver's section times and the concurrent parts' counters; reports per step and in total."""

    def __init__(self):
        self.start = time.perf_counter()
        self.sections: dict[str, float] = defaultdict(float)
        self._step_sections: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []
        self._step_start = self.start
        self.learner_s = 0.0
        self.steps = 0
        self.counters: dict[str, float] = defaultdict(float)  # cumulative: groups, requests, their seconds
        self._servers_first: dict[str, float] = {}  # server counters when first seen (they count from server start)
        self._servers_last: dict[str, float] = {}

    @contextmanager
    def section(self, name: str):
        """Time the enclosed driver work as `name`. Sections nest: an inner section's time is its own, not its
        outer section's (a step hook inside booking the step)."""
        frame = [time.perf_counter(), 0.0]  # start, time of inner sections
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[0]
            own = elapsed - frame[1]
            self.sections[name] += own
            self._step_sections[name] += own
            if self._stack:
                self._stack[-1][1] += elapsed

    def count(self, **values: float) -> None:
        """Add to the cumulative counters (groups, group seconds, client requests, request seconds, ...)."""
        for key, value in values.items():
            self.counters[key] += float(value)

    def observe_servers(self, metrics: dict[str, float]) -> None:
        """Take the servers' cumulative counters from a step's `servers/<i>/...` metrics."""
        for key, value in metrics.items():
            if key.startswith("servers/") and key.rsplit("/", 1)[-1] in ("busy_s", "engine_s"):
                self._servers_first.setdefault(key, value)
                self._servers_last[key] = value

    def end_step(self, learner_step_s: float) -> dict[str, float]:
        """Close a learner step: its `profile/...` metrics (driver sections, learner busy fraction)."""
        now = time.perf_counter()
        wall = max(now - self._step_start, 1e-9)
        self.learner_s += learner_step_s
        self.steps += 1
        out = {f"profile/driver/{k}_s": v for k, v in self._step_sections.items()}
        out["profile/step_s"] = wall
        out["profile/learner_busy"] = min(learner_step_s / wall, 1.0)
        self._step_sections = defaultdict(float)
        self._step_start = now
        return out

    def _server_totals(self) -> tuple[dict[str, float], int]:
        """Per counter name, the increase since first seen, summed over servers; and the number of servers."""
        totals: dict[str, float] = defaultdict(float)
        servers = set()
        for key, last in self._servers_last.items():
            _, index, name = key.split("/", 2)
            servers.add(index)
            totals[name] += last - self._servers_first[key]
        return totals, len(servers)

    def summary(self) -> dict[str, Any]:
        """Totals since the profile started: seconds and fractions of wall time per driver section, busy fractions,
        per-request and per-group overheads."""
        wall = max(time.perf_counter() - self.start, 1e-9)
        names = [n for n in DRIVER_SECTIONS if n in self.sections] + sorted(set(self.sections) - set(DRIVER_SECTIONS))
        out: dict[str, Any] = {"wall_s": wall, "steps": self.steps}
        out["driver_s"] = {n: self.sections[n] for n in names}
        out["driver_fraction"] = {n: self.sections[n] / wall for n in names}
        out["learner_busy"] = self.learner_s / wall
        servers, n_servers = self._server_totals()
        if "busy_s" in servers:
            out["server_busy"] = servers["busy_s"] / (wall * n_servers)
        if "engine_s" in servers:
            out["server_engine_busy"] = servers["engine_s"] / (wall * n_servers)
        c = self.counters
        if c["requests"]:
            out["requests"] = int(c["requests"])
            out["request_latency_s"] = c["request_s"] / c["requests"]
            if c["backend_s"]:  # the servers report their time in each answer
                out["server_request_s"] = c["backend_s"] / c["requests"]
                out["request_overhead_s"] = out["request_latency_s"] - out["server_request_s"]
            out["request_queue_s"] = c["queue_s"] / c["requests"]
        if c["groups"]:
            out["groups"] = int(c["groups"])
            out["group_in_actor_s"] = c["group_s"] / c["groups"]
            out["group_turnaround_s"] = c["turnaround_s"] / c["groups"]
            out["group_outside_actor_s"] = out["group_turnaround_s"] - out["group_in_actor_s"]
        return out


def format_profile(p: dict[str, Any]) -> str:
    """The summary's profile as a few readable lines."""
    wall = p["wall_s"]
    lines = [f"loop profile over {wall:.1f} s, {p['steps']} steps ({wall / max(p['steps'], 1):.3f} s per step):"]
    lines.append(
        "  driver: "
        + ", ".join(f"{n} {100 * f:.1f}%" for n, f in sorted(p["driver_fraction"].items(), key=lambda kv: -kv[1]))
    )
    busy = [f"learner {100 * p['learner_busy']:.1f}%"]
    if "server_busy" in p:
        busy.append(f"servers {100 * p['server_busy']:.1f}% (with a request in progress)")
    if "server_engine_busy" in p:
        busy.append(f"{100 * p['server_engine_busy']:.1f}% (inside engine calls)")
    lines.append("  busy: " + ", ".join(busy))
    if "request_overhead_s" in p:
        lines.append(
            f"  requests: {p['requests']}, {1000 * p['request_latency_s']:.1f} ms at the client, "
            f"{1000 * p['server_request_s']:.1f} ms "
            f"in the server's backend ({1000 * p['request_overhead_s']:.1f} ms HTTP/client overhead, of which "
            f"{1000 * p.get('request_queue_s', 0.0):.1f} ms waiting for a connection slot in the client)"
        )
    if "groups" in p:
        lines.append(
            f"  groups: {p['groups']}, {1000 * p['group_in_actor_s']:.0f} ms in the env actor, "
            f"{1000 * p['group_turnaround_s']:.0f} ms from launch to collect "
            f"({1000 * p['group_outside_actor_s']:.0f} ms in Ray and waiting for the driver)"
        )
    return "\n".join(lines)
