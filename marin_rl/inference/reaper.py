"""A process group that dies with the process that started it.

A server subprocess (vLLM and its engine workers) runs in its own session so that it can be stopped as a group. A
SIGKILLed parent (its Ray actor killed, the actor's worker OOM-killed) runs no cleanup, and on a cluster node no
driver-side watchdog is there to end the group. `reap_with_parent` starts a small watcher, in a session of its own,
that ends the group (SIGTERM, then SIGKILL) as soon as the parent is gone, and exits by itself when the group ends.
"""

from __future__ import annotations

import os
import subprocess
import sys

WATCHER = r"""
import os, signal, sys, time

parent, group, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False

def group_alive():
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

while alive(parent) and group_alive():
    time.sleep(0.5)
if group_alive():
    os.killpg(group, signal.SIGTERM)
    deadline = time.time() + grace
    while group_alive() and time.time() < deadline:
        time.sleep(0.2)
    if group_alive():
        os.killpg(group, signal.SIGKILL)
"""


def reap_with_parent(group: int, parent: int | None = None, grace_s: float = 5.0) -> subprocess.Popen:
    """Watch process group `group` (a subprocess started with `start_new_session=True`: its pid): once `parent`
    (default: this process) is gone, SIGTERM the group, and SIGKILL it after `grace_s`. Returns the watcher, which
    exits by itself when the group ends; Linux only (it reads /proc)."""
    parent = os.getpid() if parent is None else parent
    return subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(parent), str(group), str(grace_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the group it watches, nor killed with the parent's group
        close_fds=True,
    )
