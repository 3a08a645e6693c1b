"""A server's process group dies with the process that started it, even when that process is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from marked_processes import wait_until

PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from marin_rl.inference.reaper import reap_with_parent

    # a stand-in for vLLM: a group leader with a child of its own (an engine worker)
    server = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(600)']); time.sleep(600)"], start_new_session=True)
    reap_with_parent(server.pid, grace_s=1.0)
    print(server.pid, flush=True)
    time.sleep(600)
    """
)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _members(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout.split("\n")
    return [
        int(p) for p, g, st in (ln.split() for ln in out if ln.strip()) if int(g) == pgid and not st.startswith("Z")
    ]


@pytest.mark.exclusive  # the clean-up's wall-clock bound
def test_a_sigkilled_parent_takes_its_server_group_with_it():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )
    group = int(parent.stdout.readline())
    try:
        wait_until(lambda: len(_members(group)) == 2, 10)
        assert len(_members(group)) == 2, "the server and its worker run"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        seconds = wait_until(lambda: not _members(group), 10)
        assert not _members(group), f"left 10 s after the parent's SIGKILL: {_members(group)}"
        print(f"the server group was gone {seconds:.1f}s after its parent's SIGKILL")
    finally:
        if _group_alive(group):
            os.killpg(group, signal.SIGKILL)


def test_the_watcher_exits_by_itself_when_the_group_is_stopped():
    from marin_rl.inference.reaper import reap_with_parent

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    watcher = reap_with_parent(server.pid)
    os.killpg(server.pid, signal.SIGTERM)
    server.wait()
    assert watcher.wait(timeout=10) == 0
