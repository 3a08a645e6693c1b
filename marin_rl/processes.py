"""Whether a process is alive, as the cleanup code needs it: a zombie (dead, not yet reaped by its parent) is not,
and a process is named by its pid and start time, so that a later process that reused the pid is not taken for it.
Also the removal of directories that dead processes owned. Standard library only: the driver's watchdog uses it at the
moment its driver died, when nothing heavy should stand between it and the cleanup."""

from __future__ import annotations

import os
import shutil


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, from the state on (state, ppid, ...), or None when the
    process is gone. Linux only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def process_token(pid: int) -> str | None:
    """'<pid>:<start time in clock ticks since boot>' of a live process (None when it is gone or a zombie): unlike
    the pid alone, it never names a later process that reused the pid. Linux only (it reads /proc)."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in "ZX":
        return None
    return f"{pid}:{fields[19]}"  # field 22 of stat, the 20th after the name and state


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie does not. Without /proc (not Linux), whether the pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    if not os.path.isdir("/proc"):
        return True
    return process_token(pid) is not None


def remove_directories_of_dead_processes(root: str, prefix: str) -> list[str]:
    """Delete the directories under `root` named `<prefix><pid>[-...]` whose process `pid` is gone (or a zombie);
    returns their paths. A missing `root` removes nothing."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix) :].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed
