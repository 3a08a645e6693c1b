"""A Python-execution tool: code runs in a child process with a wall-time limit and a memory limit.

    env.register_tool(run_python)                                  # default limits
    env.register_tool(make_run_python(timeout_s=2, memory_mb=256))  # custom ones

The child is a fresh `python -I` (isolated mode: no user site, no environment variables read, the script's
directory not on the path) in an empty temporary working directory, in its own session so that a timeout kills
every process it started. Limits set with `resource.setrlimit` in the child: address space (`memory_mb`), CPU
seconds (the wall-time limit, rounded up), written file size, no core dumps. This contains runaway code from the
policy; it is not a security sandbox against hostile code (the child can still read files and use the network),
so run untrusted workloads inside a container or VM as well.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 512
DEFAULT_MAX_OUTPUT_CHARS = 4000
_MAX_FILE_BYTES = 16 << 20


def _limit_child(memory_mb: int, cpu_s: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _cut(text: str, limit: int, dropped: int = 0) -> str:
    if len(text) <= limit and not dropped:
        return text
    return text[:limit] + f"\n[... {len(text) - min(limit, len(text)) + dropped} more characters cut]"


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, int]:
    """The first `cap` bytes of a stream, read to its end, and how many bytes were dropped."""
    kept = bytearray()
    dropped = 0
    while chunk := await stream.read(1 << 16):
        room = max(0, cap - len(kept))
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    return bytes(kept), dropped


async def _exited_within(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether the process exits within `timeout_s`. Polls `returncode`: `proc.wait()` would also wait for
    processes the code started that still hold its output pipes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.001
    while proc.returncode is None:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.02)
    return True


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # already gone
        pass


async def execute_python(
    code: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """Run `code` in a limited child process; its stdout/stderr, or which limit it hit, as text.

    The text is stdout; then 'stderr:' and the error output if there is any; then 'exit code N' if it failed.
    A run past `timeout_s` is killed and reported as 'error: wall-time limit of T s exceeded'; running out of
    memory (a MemoryError, or the kernel refusing memory) is reported as 'error: memory limit of M MB exceeded'.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be > 0, got {timeout_s} and {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="marin_rl_py_") as workdir:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            script,
            cwd=workdir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limit_child(memory_mb, max(1, math.ceil(timeout_s))),
        )
        cap = 4 * max_output_chars + 1024  # bytes kept per stream; the rest is read and dropped
        readers = [asyncio.create_task(_read_capped(s, cap)) for s in (proc.stdout, proc.stderr)]
        try:
            timed_out = not await _exited_within(proc, timeout_s)
        finally:
            _kill_group(proc)  # on a timeout, and processes the code left running in its session
            await proc.wait()
        (out, out_dropped), (err, err_dropped) = await asyncio.gather(*readers)
    if timed_out:
        return f"error: wall-time limit of {timeout_s:g} s exceeded"
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    rc = proc.returncode
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return f"error: memory limit of {memory_mb} MB exceeded ({tail})"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"error: CPU-time limit of {math.ceil(timeout_s)} s exceeded"
    parts = [stdout] if stdout else []
    if stderr:
        parts.append(f"stderr:\n{stderr}")
    if rc != 0:
        parts.append(f"exit code {rc}")
    text = "\n".join(p.rstrip("\n") for p in parts) if parts else "(no output)"
    return _cut(text, max_output_chars, out_dropped + err_dropped)


def make_run_python(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Callable[[str], Awaitable[str]]:
    """A `run_python(code)` tool with these limits, ready for `ToolEnvironment.register_tool`."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_chars <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_chars must be > 0")

    async def run_python(code: str) -> str:
        """Run a Python program and return what it prints (stdout, then stderr).

        Args:
            code: The complete Python source to run; use print() to show results.
        """
        return await execute_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)

    return run_python


run_python = make_run_python()
"""`run_python(code)` with the default limits (10 s wall time, 512 MB of memory, 4000 output characters)."""
