"""Finding a test's processes by a mark in their environment: every process a run starts on this machine inherits
it, whatever session or parent it ends up with, so the mark counts what a killed run left independently of how
marin_rl itself tracks its processes."""

import os
import threading
import time
import uuid


def new_mark() -> tuple[str, str]:
    """(variable, value) of a fresh mark to put in a started process's environment."""
    return "MARIN_RL_TEST_MARK", uuid.uuid4().hex


def _running(pid: str) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def marked_processes(variable: str, value: str) -> list[int]:
    """Live processes (zombies excluded) whose environment has `variable=value`."""
    entry = f"{variable}={value}".encode()
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if entry in env and _running(name):
            pids.append(int(name))
    return pids


def describe(pids: list[int]) -> list[str]:
    """'pid: command line' of each process (for a failure message: what was left)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid}: {cmd[:200]}")
    return out


def dead_weight_slot_dirs(root: str, prefix: str) -> list[str]:
    """Weight slot directories under `root` whose owning process (the pid after `prefix`) is gone or a zombie."""
    dead = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not name.startswith(prefix):
            continue
        if not _running(name[len(prefix) :].split("-", 1)[0]):
            dead.append(os.path.join(root, name))
    return dead


def wait_until(condition, timeout: float, poll_s: float = 0.1) -> float:
    """Seconds until `condition()` held (polled), or `timeout` when it never did."""
    t = time.time()
    while not condition() and time.time() - t < timeout:
        time.sleep(poll_s)
    return time.time() - t


def slot_owner(path: str, prefix: str) -> int | None:
    """The pid in a weight slot directory's name (`<prefix><pid>-<id>`), None when it is not such a directory."""
    name = os.path.basename(path)
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


class MarkedRun:
    """Marks every process started from this one while inside (the mark is in this process's environment, so a local
    Ray cluster's processes and everything they start inherit it), and remembers each marked process seen (polled
    every `poll_s`), so a test can check what *its* run left while other tests run beside it: `left()` lists the
    live ones, `seen` every pid that ever carried the mark (a weight slot named after one of them is this run's)."""

    def __init__(self, poll_s: float = 0.2):
        self.variable, self.value = new_mark()
        self.poll_s = poll_s
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.seen.update(self.left())

    def left(self) -> list[int]:
        """Live marked processes other than this one."""
        return [p for p in marked_processes(self.variable, self.value) if p != os.getpid()]

    def assert_all_exited(self, timeout_s: float = 30) -> None:
        """Wait up to `timeout_s` for every marked process to exit; fail naming those still running, or when none
        was ever seen (the check would then have seen nothing of the run)."""
        wait_until(lambda: not self.left(), timeout_s, poll_s=0.5)
        assert self.left() == [], f"processes of the run still running: {describe(self.left())}"
        assert len(self.seen) >= 3, "the run's processes (Ray's, the actors) were seen and are gone"

    def __enter__(self) -> "MarkedRun":
        os.environ[self.variable] = self.value
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.seen.update(self.left())
        self._stop.set()
        self._thread.join()
        os.environ.pop(self.variable, None)
