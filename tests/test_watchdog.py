"""The driver's watchdog: a SIGKILLed driver's processes (its own children, those in sessions of their own, their
children) and its dead learner's weight slots are gone within seconds; the next run sweeps what a dead watchdog
left."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from marked_processes import dead_weight_slot_dirs, describe, marked_processes, new_mark, wait_until

from marin_rl.broadcast.shared_memory import DEFAULT_ROOT, PRIVATE_PREFIX
from marin_rl.orchestrator.ray_backend import watchdog
from marin_rl.orchestrator.ray_backend.watchdog import (
    RUN_TOKEN_VARIABLE,
    driver_alive,
    live_pids,
    live_tokens,
    still_known,
    sweep_orphans,
)
from marin_rl.processes import process_token

# A driver as the orchestrator is one: it starts the watchdog, then processes that inherit its environment: a child,
# a child in a session of its own with a grandchild (as vLLM servers and Ray's processes are), a grandchild without
# the run's mark in its environment block whose parent exits a second later (as Ray's agents are: setproctitle
# overwrites their environment block, and the raylet dies before them), and a weight slot directory owned by the
# child (as the learner's is).
DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from marin_rl.orchestrator.ray_backend.watchdog import RUN_TOKEN_VARIABLE, Watchdog
    Watchdog(poll_s=0.2).start()
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    child = subprocess.Popen(sleep)
    subprocess.Popen(["bash", "-c", " ".join(sleep[:2]) + ' "import time; time.sleep(600)" & wait'],
                     start_new_session=True)
    subprocess.Popen(["bash", "-c", f"env -u {RUN_TOKEN_VARIABLE} " + " ".join(sleep[:2]) +
                      ' "import time; time.sleep(600)" & sleep 1'])
    os.makedirs(os.path.join(sys.argv[1], f"{sys.argv[2]}{child.pid}-test"))
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _orphans(pids: list[int]) -> list[int]:
    """Those of `pids` whose parent is init (or the machine's subreaper), that is, not one of `pids`."""
    parents = {p: int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in pids}
    return [p for p, parent in parents.items() if parent not in parents and parent != os.getpid()]


def _carries_token(pid: int) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return any(e.startswith(f"{RUN_TOKEN_VARIABLE}=".encode()) for e in f.read().split(b"\0"))


def test_process_token_names_one_live_process_and_never_a_dead_or_zombie_one():
    token = process_token(os.getpid())
    assert token.startswith(f"{os.getpid()}:") and driver_alive(token)
    assert not driver_alive(f"{os.getpid()}:1")  # the same pid, another start time: a reused pid
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert process_token(proc.pid) is None, "an unreaped zombie is dead"
    proc.wait()
    assert process_token(proc.pid) is None


def test_the_watchers_known_processes_keep_only_live_ones_even_when_one_exits_while_they_are_read(monkeypatch):
    """The watcher remembers its run's processes by token each poll. A process that exited is dropped, a reused pid
    (same pid, another start time) too; and one that exits between being checked and being read must not leave None
    among them (it did: the watcher crashed on its next poll, once, between a teacher recipe's run and the
    student's)."""
    me = process_token(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = process_token(proc.pid) or f"{proc.pid}:1"
    proc.wait()
    reused = f"{os.getpid()}:1"
    assert live_tokens({me, gone, reused}) == {me} and live_pids({me, gone, reused}) == [os.getpid()]

    calls: dict[int, int] = {}

    def exits_after_first_look(pid: int):  # a process that dies right after the watcher first looks at it
        calls[pid] = calls.get(pid, 0) + 1
        return me if calls[pid] == 1 else None

    monkeypatch.setattr(watchdog, "process_token", exits_after_first_look)
    known = still_known({me}, driver=me)
    assert None not in known and known <= {me}, known


@pytest.mark.skipif(not os.path.isdir(DEFAULT_ROOT), reason="needs /dev/shm")
@pytest.mark.exclusive  # the clean-up's wall-clock bound
def test_a_sigkilled_driver_leaves_no_process_and_no_weight_slot(tmp_path):
    mark = new_mark()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, DEFAULT_ROOT, PRIVATE_PREFIX],
        env=dict(os.environ, **dict([mark])),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = int(driver.stdout.readline())
    slot_dir = os.path.join(DEFAULT_ROOT, f"{PRIVATE_PREFIX}{child}-test")
    try:
        # driver, watcher, child, bash, its sleeper, the orphan (its parent gone)
        wait_until(lambda: len(marked_processes(*mark)) == 6 and len(_orphans(marked_processes(*mark))) == 1, 30)
        assert len(marked_processes(*mark)) == 6, describe(marked_processes(*mark))
        assert [p for p in _orphans(marked_processes(*mark)) if not _carries_token(p)], "no unmarked orphan"
        assert os.path.isdir(slot_dir)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        seconds = wait_until(lambda: not marked_processes(*mark) and not os.path.isdir(slot_dir), 10)
        left = describe(marked_processes(*mark))
        assert left == [], f"processes left 10 s after the driver died (the watcher's exit included): {left}"
        assert slot_dir not in dead_weight_slot_dirs(DEFAULT_ROOT, PRIVATE_PREFIX), "the dead child's slots are left"
        print(f"all gone {seconds:.1f}s after the driver's SIGKILL")
        _, report = driver.communicate(timeout=30)  # the watcher reports on the driver's stderr, which it inherits
        assert f"driver {driver.pid} died; ended 4 processes of its run" in report, report
    finally:
        for pid in marked_processes(*mark):
            os.kill(pid, signal.SIGKILL)
        if os.path.isdir(slot_dir):
            os.rmdir(slot_dir)


@pytest.mark.exclusive  # any run starting meanwhile sweeps the dead driver's process first
def test_the_next_run_sweeps_the_processes_of_a_dead_driver_whose_watchdog_died_too():
    gone = subprocess.Popen(["sleep", "60"])
    dead_driver = process_token(gone.pid)  # a driver that has died since
    gone.kill()
    gone.wait()
    assert not driver_alive(dead_driver)
    left = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env=dict(os.environ, **{RUN_TOKEN_VARIABLE: dead_driver}),
        start_new_session=True,
    )
    ours = subprocess.Popen(  # a live driver's process is never touched
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env=dict(os.environ, **{RUN_TOKEN_VARIABLE: process_token(os.getpid())}),
    )
    try:
        time.sleep(0.5)
        ended = sweep_orphans()
        assert ended.get(dead_driver) == 1
        assert left.wait(timeout=10) == -signal.SIGTERM
        assert ours.poll() is None
    finally:
        for p in (left, ours):
            if p.poll() is None:
                p.kill()
                p.wait()
