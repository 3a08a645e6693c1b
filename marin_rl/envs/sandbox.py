"""A per-episode sandbox for tools: commands and files isolated from the host, built on bubblewrap (`bwrap`).

    async with Sandbox() as sb:                          # or: sb = await Sandbox.create(); ...; await sb.destroy()
        await sb.write_file("data.csv", "a,1\\nb,2\\n")
        result = await sb.exec("awk -F, '{s+=$2} END {print s}' data.csv", timeout_s=5)
        result.stdout                                    # b'3\\n'
        await sb.read_file("data.csv")

A sandbox is one `bwrap` process, started by `create` and ended by `destroy`, with new user, PID, network, IPC,
UTS and cgroup namespaces. What it sees:

* `/workspace` (the working directory, also `$HOME`) and `/tmp`: its own tmpfs mounts, capped at `disk_mb` and
  `tmp_mb`, the only writable places; they last as long as the sandbox, across `exec` calls;
* read-only: `/usr` (with `/bin`, `/lib`, `/lib64`, `/sbin` as links into it), the loader cache and
  `/etc/alternatives`, and synthetic `/etc/passwd`, `/etc/group`, `/etc/hostname`; nothing else of the host (no
  home directories, no `/work`, no `/etc/shadow`, no host `/proc` or `/sys`);
* a fresh `/proc` of its own PID namespace and a minimal `/dev` (null, zero, random, tty, a capped `/dev/shm`);
* no network but its own loopback; an unprivileged user (uid 1000, no capabilities, no further user namespaces);
* a fixed environment (`PATH`, `HOME`, `LANG`, `TMPDIR`): bwrap itself starts from that environment, so no secret
  of the host process is visible even in `/proc/1/environ`.

Inside, `marin_rl.envs.sandbox_agent` runs as PID 1 and runs each command in its own session with rlimits
(`memory_mb` of address space, `cpu_s` CPU seconds, `max_processes` processes of the sandbox user, files up to
`max_file_mb`) and a wall-time limit; when the command ends or its time is up, every other process in the sandbox
is killed (`kill(-1)` from PID 1), so a forked, `setsid()`-ed or double-forked child never outlives the call. PID 1
itself cannot be killed or inspected from inside. The sandbox dies with its host process (`--die-with-parent`).
Started by root, bwrap runs as `nobody`: root is exempt from the process limit in every user namespace.

Not included: a seccomp filter (the kernel's whole system-call surface is reachable) and cgroup memory accounting
(memory is limited per process, so at most `max_processes` x `memory_mb` together, plus the tmpfs caps).

Requires `bwrap` (Debian/Ubuntu package `bubblewrap`; `install.sh` installs it when it runs as root with apt-get)
and a kernel that lets this user create user namespaces. `check_sandbox_available()` says why not, in one line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from marin_rl.bounds import bounded, check_fields

WORKSPACE = "/workspace"
"""The sandbox's working directory (and `$HOME`), where relative paths of `write_file` / `read_file` point."""
SANDBOX_UID = 1000
_NOBODY = 65534
_AGENT = Path(__file__).with_name("sandbox_agent.py")
_AGENT_IN_SANDBOX = "/opt/marin_rl/sandbox_agent.py"
_BWRAP_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_MAX_STDIN_BYTES = 1 << 16
_REPLY_GRACE_S = 10.0
INSTALL_HINT = "install it with `apt-get install -y bubblewrap` (./install.sh does so when run as root)"


class SandboxUnavailable(RuntimeError):
    """Sandboxes cannot be created on this machine; the message names the missing piece and how to get it."""


class SandboxError(RuntimeError):
    """The sandbox failed or ended (its process died, or an agent reply was malformed or late)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of a sandbox and of each command it runs (the defaults of `exec`)."""

    timeout_s: float = bounded(10.0, gt=0)
    """Wall-time limit of one command, in seconds; past it the command and all it started are killed."""
    memory_mb: int = bounded(512, ge=16)
    """Address-space limit of each process, in MB."""
    cpu_s: int | None = bounded(None, ge=1)
    """CPU-time limit of each process, in seconds (None: the wall-time limit rounded up)."""
    max_processes: int = bounded(64, ge=4)
    """Processes the sandbox user may have at once (counting the sandbox's own two)."""
    max_file_mb: int = bounded(16, ge=1)
    """Largest file a command may write, in MB."""
    disk_mb: int = bounded(64, ge=1)
    """Size of the /workspace tmpfs, in MB."""
    tmp_mb: int = bounded(16, ge=1)
    """Size of the /tmp and /dev/shm tmpfs mounts, in MB each."""
    max_output_bytes: int = bounded(1 << 16, ge=1)
    """Bytes of stdout and of stderr kept per command; the rest is read and counted as dropped."""

    def __post_init__(self):
        check_fields(self, "sandbox")


@dataclass
class ExecResult:
    """What a command run in a sandbox did."""

    returncode: int
    """Exit status; negative for a signal (-9: killed, e.g. at the wall-time or CPU-time limit)."""
    stdout: bytes
    """Its standard output (the first `max_output_bytes`)."""
    stderr: bytes
    """Its standard error (the first `max_output_bytes`)."""
    timed_out: bool = False
    """Whether it was killed at the wall-time limit."""
    stdout_dropped: int = 0
    """Bytes of stdout beyond `max_output_bytes`, read and dropped."""
    stderr_dropped: int = 0
    """Bytes of stderr beyond `max_output_bytes`, read and dropped."""
    stats: dict = field(default_factory=dict)
    """Limits the command ran under."""


def _python_in_sandbox() -> tuple[str, str | None]:
    """The interpreter sandboxes run (the agent, `run_python`), and a host directory to bind read-only for it
    (None when it lives under /usr, which every sandbox sees)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate, None
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


@functools.cache
def _bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs bubblewrap (`bwrap`), which is not on PATH; {INSTALL_HINT}")
    return path


def _bwrap_args(
    limits: SandboxLimits, python_prefix: str | None, ro_binds: Sequence[str], data_args: Sequence[str]
) -> list[str]:
    args = [
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup namespaces
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--disable-userns",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--clearenv",
    ]
    for key, value in {**_BWRAP_ENV, "HOME": WORKSPACE, "TMPDIR": "/tmp"}.items():
        args += ["--setenv", key, value]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        if os.path.islink(f"/{name}"):
            args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            args += ["--ro-bind", f"/{name}", f"/{name}"]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in [*([python_prefix] if python_prefix else []), *ro_binds]:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(limits.tmp_mb << 20), "--tmpfs", "/dev/shm"]
    args += ["--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    args += ["--size", str(limits.disk_mb << 20), "--perms", "0755", "--tmpfs", WORKSPACE]
    args += [*data_args, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKSPACE]
    return args


_ETC_FILES = {
    "/etc/passwd": f"root:x:0:0::/:/usr/sbin/nologin\nuser:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKSPACE}:/bin/sh\n"
    "nobody:x:65534:65534::/:/usr/sbin/nologin\n",
    "/etc/group": f"root:x:0:\nuser:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    "/etc/hostname": "sandbox\n",
}


def _data_fds() -> tuple[list[str], list[int]]:
    """`--ro-bind-data` arguments for the synthetic /etc files and the agent's source (copies: bwrap may run as a
    user that cannot read this package), and the read ends of their pipes."""
    args, fds = [], []
    for path, text in {**_ETC_FILES, _AGENT_IN_SANDBOX: _AGENT.read_text()}.items():
        data = text.encode()
        assert len(data) < 1 << 15, path  # it must fit the pipe's buffer before bwrap reads it
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        args += ["--ro-bind-data", str(r), path]
        fds.append(r)
    return args, fds


def _host_user() -> dict:
    """Who bwrap runs as on the host: this user, or `nobody` (65534) when this is root. Root's processes are exempt
    from the process limit whatever user namespace they are in (the sandbox user maps to the user that started
    bwrap), so a sandbox started by root runs as an unprivileged user instead."""
    if os.geteuid() != 0:
        return {}
    return {"user": _NOBODY, "group": _NOBODY, "extra_groups": []}


@functools.cache
def _check_cached() -> str:
    bwrap = _bwrap_path()
    python, prefix = _python_in_sandbox()
    data_args, fds = _data_fds()
    command = [bwrap, *_bwrap_args(SandboxLimits(), prefix, (), data_args), python, "-I", "-S", "-c", "print(1)"]
    try:
        done = subprocess.run(
            command, env=_BWRAP_ENV, capture_output=True, timeout=60, pass_fds=fds, cwd="/", **_host_user()
        )
    finally:
        for fd in fds:
            os.close(fd)
    if done.returncode != 0 or done.stdout.strip() != b"1":
        why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SandboxUnavailable(
            f"bubblewrap (`{bwrap}`) cannot create a sandbox here ({why}); it needs user namespaces "
            "(sysctl user.max_user_namespaces > 0, and kernel.unprivileged_userns_clone=1 where that exists, or a "
            "container that allows them)"
        )
    return bwrap


def check_sandbox_available() -> None:
    """Raise `SandboxUnavailable` (one line naming what is missing and how to install it) unless a sandbox can be
    created here: `bwrap` on PATH and able to start one with a Python in it. Runs a trial sandbox once per
    process; a success is remembered."""
    _check_cached()


class Sandbox:
    """An isolated place to run commands and keep files, alive from `create` (or entering `async with`) to
    `destroy`. One request runs at a time; `exec`, `write_file` and `read_file` may be awaited from any task of the
    event loop that created it. See the module docstring for what is isolated and limited."""

    def __init__(self, limits: SandboxLimits | None = None, *, ro_binds: Sequence[str] = ()):
        self.limits = limits or SandboxLimits()
        """Default limits of `exec`, and the sizes of the sandbox's tmpfs mounts."""
        self.ro_binds = tuple(os.path.realpath(p) for p in ro_binds)
        """Extra host paths shown read-only at the same place (e.g. a virtual environment's packages)."""
        self.python, self._python_prefix = _python_in_sandbox()
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._dead: str | None = None

    @classmethod
    async def create(cls, limits: SandboxLimits | None = None, *, ro_binds: Sequence[str] = ()) -> Sandbox:
        """A started sandbox (raises `SandboxUnavailable` if this machine cannot make one)."""
        sandbox = cls(limits, ro_binds=ro_binds)
        await sandbox.start()
        return sandbox

    @property
    def alive(self) -> bool:
        """Whether the sandbox is started and has not ended."""
        return self._proc is not None and self._dead is None

    async def start(self) -> None:
        """Start the sandbox's process and wait until it is ready."""
        if self._proc is not None:
            raise SandboxError("sandbox already started")
        await asyncio.to_thread(check_sandbox_available)
        for path in self.ro_binds:
            if not os.path.exists(path):
                raise ValueError(f"sandbox ro_binds: {path} does not exist")
        data_args, fds = _data_fds()
        argv = [
            _bwrap_path(),
            *_bwrap_args(self.limits, self._python_prefix, self.ro_binds, data_args),
            self.python,
            "-I",
            "-S",
            _AGENT_IN_SANDBOX,
        ]
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                env=_BWRAP_ENV,
                cwd="/",
                **_host_user(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=fds,
                limit=1 << 26,  # a reply line holds a whole file or command output, base64
            )
        finally:
            for fd in fds:
                os.close(fd)
        reply = await self._reply(30.0)
        if not reply.get("ready"):
            await self.destroy()
            raise SandboxError(f"sandbox did not start: {reply}")

    async def _reply(self, timeout_s: float) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            await self._kill(f"no reply within {timeout_s:g} s")
            raise SandboxError(f"sandbox ended: no reply within {timeout_s:g} s") from None
        if not line:
            err = b""
            if self._proc.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    err = await asyncio.wait_for(self._proc.stderr.read(4096), 1.0)
            why = err.decode(errors="replace").strip() or "its process exited"
            await self._kill(why)
            raise SandboxError(f"sandbox ended: {why}")
        return json.loads(line)

    async def _request(self, request: dict, timeout_s: float) -> dict:
        async with self._lock:
            if self._proc is None:
                raise SandboxError("sandbox not started (use `await Sandbox.create()` or `async with Sandbox()`)")
            if self._dead is not None:
                raise SandboxError(f"sandbox ended: {self._dead}")
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                await self._proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                await self._kill("its process exited")
                raise SandboxError("sandbox ended: its process exited") from None
            try:
                reply = await self._reply(timeout_s)
            except asyncio.CancelledError:  # the reply would be left in the pipe for the next request
                self._dead = "a request was cancelled while it ran"
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                raise
        if "error" in reply:
            raise OSError(reply.get("errno") or 0, reply["error"])
        return reply

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        cpu_s: int | None = None,
        stdin: bytes | str = b"",
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `command` (a string runs with `/bin/sh -c`; a sequence is an argv) in the sandbox, in `cwd` (default
        /workspace), with the sandbox's limits unless overridden here. Never raises for what the command does
        (a non-zero exit, a signal, the time limit: see `ExecResult`); raises `SandboxError` if the sandbox died."""
        limits = replace(
            self.limits,
            timeout_s=self.limits.timeout_s if timeout_s is None else timeout_s,
            memory_mb=self.limits.memory_mb if memory_mb is None else memory_mb,
            cpu_s=self.limits.cpu_s if cpu_s is None else cpu_s,
        )
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("exec: empty command")
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        if len(data) > _MAX_STDIN_BYTES:
            raise ValueError(f"exec: stdin of {len(data)} bytes is over {_MAX_STDIN_BYTES}; write a file instead")
        cpu = limits.cpu_s if limits.cpu_s is not None else max(1, int(-(-limits.timeout_s // 1)))
        request = {
            "op": "exec",
            "argv": argv,
            "cwd": cwd,
            "timeout_s": limits.timeout_s,
            "memory_mb": limits.memory_mb,
            "cpu_s": cpu,
            "max_processes": limits.max_processes,
            "max_file_mb": limits.max_file_mb,
            "max_output_bytes": limits.max_output_bytes,
            "stdin": base64.b64encode(data).decode(),
        }
        reply = await self._request(request, limits.timeout_s + _REPLY_GRACE_S)
        return ExecResult(
            returncode=int(reply["returncode"]),
            stdout=base64.b64decode(reply["stdout"]),
            stderr=base64.b64decode(reply["stderr"]),
            timed_out=bool(reply["timed_out"]),
            stdout_dropped=int(reply["stdout_dropped"]),
            stderr_dropped=int(reply["stderr_dropped"]),
            stats={"timeout_s": limits.timeout_s, "memory_mb": limits.memory_mb, "cpu_s": cpu},
        )

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write `data` to `path` (relative to /workspace, or absolute inside the sandbox), making its directories;
        raises OSError as writing inside the sandbox would (e.g. no space left past `disk_mb`)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        request = {"op": "write", "path": path, "data": base64.b64encode(raw).decode(), "mode": mode}
        await self._request(request, 30.0)

    async def read_file(self, path: str, *, max_bytes: int = 1 << 24) -> bytes:
        """The first `max_bytes` of file `path` inside the sandbox (relative to /workspace); raises OSError (e.g.
        FileNotFoundError) as reading it inside the sandbox would."""
        reply = await self._request({"op": "read", "path": path, "max_bytes": max_bytes}, 30.0)
        return base64.b64decode(reply["data"])

    async def _kill(self, why: str) -> None:
        self._dead = self._dead or why
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # bwrap's child, the sandbox's PID 1, gets SIGKILL with it (--die-with-parent)
        await proc.wait()

    async def destroy(self) -> None:
        """End the sandbox: every process in it is killed and its files are gone. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # an episode's coroutine closed after its event loop ended (a run stopping mid-episode)
            self._dead = self._dead or "destroyed"
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            return
        if proc.returncode is None and proc.stdin is not None:
            proc.stdin.close()  # the agent kills what is left and exits at end of input
            try:
                await asyncio.wait_for(proc.wait(), 2.0)
            except TimeoutError:
                pass
        await self._kill("destroyed")
        self._dead = self._dead or "destroyed"

    async def __aenter__(self) -> Sandbox:
        if self._proc is None:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.destroy()


_current: contextvars.ContextVar[Sandbox | None] = contextvars.ContextVar("marin_rl_sandbox", default=None)


def current_sandbox() -> Sandbox | None:
    """The sandbox of the episode running in this task (`use_sandbox`), or None."""
    return _current.get()


@contextlib.contextmanager
def use_sandbox(sandbox: Sandbox) -> Iterator[Sandbox]:
    """Make `sandbox` the `current_sandbox()` of this task (and the tasks it starts) inside the block, so that
    sandboxed tools (`marin_rl.envs.code_tools`) of an episode run in the episode's own sandbox."""
    token = _current.set(sandbox)
    try:
        yield sandbox
    finally:
        # ValueError: an unfinished episode's coroutine closed outside its task (a run stopped mid-episode)
        with contextlib.suppress(ValueError):
            _current.reset(token)
