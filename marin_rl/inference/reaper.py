"""A process group that dies with the process that started it.

A server subprocess (vLLM and its engine workers) runs in its own session so that it can be stopped as a group. A
SIGKILLed parent (its Ray actor killed, the actor's worker OOM-killed) runs no cleanup, and on a cluster node no
driver-side watchdog is there to end the group. `reap_with_parent` starts a small watcher (this module, run as a
program), in a session of its own, that ends the group (SIGTERM, then SIGKILL) as soon as the parent is gone, and
exits by itself when the group ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from marin_rl.processes import process_token


def reap_with_parent(group: int, parent: int | None = None, grace_s: float = 5.0) -> subprocess.Popen:
    """Watch process group `group` (a subprocess started with `start_new_session=True`: its pid): once `parent`
    (default: this process) is gone, SIGTERM the group, and SIGKILL it after `grace_s`. Returns the watcher, which
    exits by itself when the group ends; Linux only (it reads /proc)."""
    token = process_token(os.getpid() if parent is None else parent) or ""
    return subprocess.Popen(
        [sys.executable, "-m", "marin_rl.inference.reaper", token, str(group), str(grace_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the group it watches, nor killed with the parent's group
        close_fds=True,
    )


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def watch(parent_token: str, group: int, grace_s: float) -> None:
    """The watcher: wait while the parent (named by its `process_token`, so a reused pid does not count) and the
    group both live; then end the group if it is still there."""
    parent = int(parent_token.split(":", 1)[0]) if parent_token else -1
    while parent_token and process_token(parent) == parent_token and _group_alive(group):
        time.sleep(0.5)
    if not _group_alive(group):
        return
    os.killpg(group, signal.SIGTERM)
    deadline = time.time() + grace_s
    while _group_alive(group) and time.time() < deadline:
        time.sleep(0.2)
    if _group_alive(group):
        os.killpg(group, signal.SIGKILL)


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
