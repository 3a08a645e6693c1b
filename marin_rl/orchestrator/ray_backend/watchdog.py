"""The driver's watchdog: when the driver dies without shutting down (SIGKILL, the OOM killer), the processes its run
started on this machine die within seconds, and the next run removes whatever a crash still left.

Marking: before it starts a local Ray, the driver puts `RUN_TOKEN_VARIABLE=<driver pid>:<driver start time>` into
its environment. Every process the run starts here inherits it: Ray's GCS, raylet, monitor and workers, the actors,
and what the actors start (vLLM servers in their own sessions, sandboxes). Process groups and sessions would miss
those that start sessions of their own, and a dead driver's children are reparented, so the environment is the one
mark that survives.

Watching: `Watchdog.start()` launches this module as a small separate process (its own session, so a Ctrl-C or a
kill of the driver's group does not take it along). It polls the driver, and at each poll remembers the run's
processes (those carrying the token, and every descendant of the driver): a process that renames itself may
overwrite its environment block (Ray's agents do, through setproctitle), and once its parent dies it is findable only
by that memory. Once the driver is gone it sends SIGTERM, then SIGKILL after a grace period, to every process
carrying the token or remembered (pid and start time, so a reused pid is never hit), and then removes the
shared-memory weight slots whose learner died. A driver that shuts down normally stops its watchdog (`Watchdog.stop()`).

Sweeping: `sweep_orphans()` (run by every driver before it starts Ray) does the same for any token whose driver is
gone, for the case where the watchdog was killed together with its driver.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from marin_rl.processes import process_token, remove_directories_of_dead_processes, stat_fields

logger = logging.getLogger(__name__)

RUN_TOKEN_VARIABLE = "MARIN_RL_RUN"
"""Environment variable whose value, '<driver pid>:<driver start time>', marks every process of one run."""

GRACE_S = 3.0
"""How long processes get after SIGTERM before SIGKILL."""

SETTLE_S = 1.5
"""How long no process of a dead run must be seen before the watchdog stops looking for late ones."""


def driver_alive(token: str) -> bool:
    """Whether the driver that a run token names still runs."""
    pid = token.split(":", 1)[0]
    return pid.isdigit() and process_token(int(pid)) == token


def _run_tokens() -> dict[int, str]:
    """pid -> run token of every readable process that carries one."""
    found = {}
    prefix = f"{RUN_TOKEN_VARIABLE}=".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        for entry in entries:
            if entry.startswith(prefix):
                found[int(name)] = entry[len(prefix) :].decode(errors="replace")
                break
    return found


def _children() -> dict[int, list[int]]:
    """Parent pid -> pids of its children, for every readable process."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def processes_of(token: str, known: set[str] = frozenset()) -> list[int]:
    """The live processes (zombies excluded) that carry `token`, or whose process token ('<pid>:<start time>') is in
    `known`, and their descendants (a process may not show the run token in /proc/<pid>/environ, e.g. one that
    rewrote its environment block; it is still the child of one that does), this process excluded."""
    found = [pid for pid, t in _run_tokens().items() if t == token]
    found += live_pids(known)
    children, seen = _children(), set(found)
    while found:
        for child in children.get(found.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(child)
    return sorted(pid for pid in seen if pid != os.getpid() and process_token(pid))


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def live_tokens(known: set[str]) -> set[str]:
    """Those process tokens ('<pid>:<start time>') in `known` whose process still runs (a reused pid has another start
    time). Each process is looked up once, so a process that exits meanwhile is either in the answer or not, never
    half (reading its token again after the check gave None, which crashed the watcher on its next poll)."""
    return {k for k in known if driver_alive(k)}  # the same check as the driver's: its token names a live process


def live_pids(known: set[str]) -> list[int]:
    """The pids of `live_tokens(known)`."""
    return sorted(int(k.split(":", 1)[0]) for k in live_tokens(known))


def still_known(known: set[str], driver: str) -> set[str]:
    """One poll of the watcher: the remembered process tokens that still run, and those of the driver `driver`'s run
    now."""
    return live_tokens(known) | run_process_tokens(driver)


def run_process_tokens(token: str) -> set[str]:
    """Process tokens of the run `token`'s live processes: those `processes_of` finds, and the descendants of its
    driver while the driver lives."""
    return {t for pid in processes_of(token, {token}) if (t := process_token(pid))} - {token}


def end_run_processes(
    token: str, grace_s: float = GRACE_S, settle_s: float = SETTLE_S, known: set[str] = frozenset()
) -> int:
    """SIGTERM every process of the run `token` (and those in `known`, process tokens remembered while the driver
    lived), SIGKILL those left after `grace_s`; returns how many there were.
    Keeps watching until none has been seen for `settle_s` (at most `grace_s` + 10 s in all), as dying parents may
    still start children (Ray's raylet restarts its dashboard and runtime-env agents while it shuts down, seen up to a
    second or more after it was signalled): those later processes get SIGKILL at once, without another grace period."""
    ended: set[int] = set()
    give_up = time.time() + grace_s + 10.0
    quiet_since: float | None = None
    while time.time() < give_up:
        pids = processes_of(token, known)
        if not pids:
            if not ended:
                break  # the run had no process left at all
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since >= settle_s:
                break
            time.sleep(0.1)
            continue
        quiet_since = None
        if not ended:
            _signal_all(pids, signal.SIGTERM)
            deadline = time.time() + grace_s
            while time.time() < deadline and processes_of(token, known):
                time.sleep(0.1)
        ended.update(pids)
        _signal_all(processes_of(token, known), signal.SIGKILL)
        time.sleep(0.1)
    return len(ended)


def weight_slot_location() -> tuple[str, str]:
    """(root, name prefix) of the shared-memory weight slot directories (`marin_rl.broadcast.shared_memory`)."""
    from marin_rl.broadcast.shared_memory import DEFAULT_ROOT, PRIVATE_PREFIX  # numpy/jax: loaded only when needed

    return DEFAULT_ROOT, PRIVATE_PREFIX


def remove_dead_weight_slots(location: tuple[str, str] | None = None) -> list[str]:
    """Remove the shared-memory weight slots (at `location`, default `weight_slot_location()`) whose learner process
    is gone; returns their paths."""
    return remove_directories_of_dead_processes(*(location or weight_slot_location()))


def sweep_orphans() -> dict[str, int]:
    """End the processes of every run whose driver is gone (token -> processes ended) and remove dead learners'
    weight slots: what a crash left when its watchdog died with the driver."""
    orphaned = {t for t in _run_tokens().values() if not driver_alive(t)}
    ended = {t: end_run_processes(t) for t in sorted(orphaned)}
    for token, count in ended.items():
        if count:
            logger.warning("removed %d processes left by the run of the dead driver %s", count, token)
    if orphaned:
        remove_dead_weight_slots()
    return ended


class Watchdog:
    """Marks this driver's run and keeps a watcher process that ends the run's processes if the driver dies."""

    def __init__(self, poll_s: float = 0.5):
        self.poll_s = poll_s
        self.token = process_token(os.getpid())
        self.process: subprocess.Popen | None = None
        self._previous: str | None = None

    def start(self) -> None:
        """Mark the environment (before Ray starts) and launch the watcher."""
        self._previous = os.environ.get(RUN_TOKEN_VARIABLE)
        os.environ[RUN_TOKEN_VARIABLE] = self.token
        env = {k: v for k, v in os.environ.items() if k != RUN_TOKEN_VARIABLE}  # the watcher must not end itself
        root, prefix = weight_slot_location()  # passed on, so the watcher imports nothing heavy when it must act
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                __name__,
                "--driver",
                self.token,
                "--poll-s",
                str(self.poll_s),
                "--slot-root",
                root,
                "--slot-prefix",
                prefix,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        """After a normal shutdown: end the watcher and unmark the environment."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._previous is None:
            os.environ.pop(RUN_TOKEN_VARIABLE, None)
        else:
            os.environ[RUN_TOKEN_VARIABLE] = self._previous


def main(argv: list[str] | None = None) -> None:
    """The watcher process: wait for the driver to die, then end its run's processes and free their slots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", required=True, help="the driver's run token, '<pid>:<start time>'")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between checks of the driver")
    parser.add_argument("--slot-root", required=True, help="where the weight slot directories are")
    parser.add_argument("--slot-prefix", required=True, help="the name prefix of a weight slot directory")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the driver stopping us after a normal shutdown
    known: set[str] = set()
    while driver_alive(args.driver):
        known = still_known(known, args.driver)
        time.sleep(args.poll_s)
    t = time.time()
    count = end_run_processes(args.driver, known=known)
    removed = remove_dead_weight_slots((args.slot_root, args.slot_prefix))
    print(
        f"marin_rl watchdog: driver {args.driver.split(':')[0]} died; ended {count} processes of its run and "
        f"removed {len(removed)} weight slot directories in {time.time() - t:.1f}s",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
