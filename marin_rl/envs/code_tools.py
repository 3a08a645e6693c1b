"""Code tools that run inside a sandbox (`marin_rl.envs.sandbox`): `run_python(code)` and `shell(command)`.

    env.register_tool(run_python)                                  # default limits
    env.register_tool(make_run_python(timeout_s=2, memory_mb=256))  # custom ones
    env.register_tool(shell)

Inside an episode that has a sandbox (`use_sandbox`, as `marin_rl.envs.terminal` sets up), the tools run there,
so files persist between calls of the episode; elsewhere each call gets a fresh sandbox, destroyed after it. Either
way the code cannot see the host's files, environment or network, and every process it starts is killed when the
call ends. Limits per call: wall time (`timeout_s`), CPU seconds (the wall time rounded up), address space
(`memory_mb`), processes and file sizes (the sandbox's). The result is text: stdout; then 'stderr:' and the error
output if there is any; then 'exit code N' if it failed; or which limit it hit.
"""

from __future__ import annotations

import math
import signal
import uuid
from collections.abc import Awaitable, Callable

from marin_rl.envs.sandbox import ExecResult, Sandbox, SandboxLimits, current_sandbox

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 512
DEFAULT_MAX_OUTPUT_CHARS = 4000


def _cut(text: str, limit: int, dropped: int = 0) -> str:
    if len(text) <= limit and not dropped:
        return text
    return text[:limit] + f"\n[... {len(text) - min(limit, len(text)) + dropped} more characters cut]"


def format_result(result: ExecResult, *, timeout_s: float, memory_mb: int, max_output_chars: int) -> str:
    """A command's result as text for the policy: its output, or which limit it hit."""
    if result.timed_out:
        return f"error: wall-time limit of {timeout_s:g} s exceeded"
    stdout = result.stdout.decode("utf-8", "replace")
    stderr = result.stderr.decode("utf-8", "replace")
    rc = result.returncode
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
    return _cut(text, max_output_chars, result.stdout_dropped + result.stderr_dropped)


async def _run(
    command: str | list[str],
    files: dict[str, str],
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_chars: int,
) -> str:
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be > 0, got {timeout_s} and {memory_mb}")
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=4 * max_output_chars + 1024)
    sandbox = current_sandbox()
    own = sandbox is None
    if own:
        sandbox = await Sandbox.create(limits)
    try:
        for path, text in files.items():
            await sandbox.write_file(path, text)
        result = await sandbox.exec(command, timeout_s=timeout_s, memory_mb=memory_mb)
    finally:
        if own:
            await sandbox.destroy()
    return format_result(result, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)


async def execute_python(
    code: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """Run `code` with a sandbox's Python (`python3 -I`, in /workspace); its stdout/stderr, or which limit it hit.

    A run past `timeout_s` is killed and reported as 'error: wall-time limit of T s exceeded'; running out of
    memory (a MemoryError, or the kernel refusing memory) is reported as 'error: memory limit of M MB exceeded'.
    Raises `SandboxUnavailable` if no sandbox can be made here.
    """
    script = f"/tmp/run_python_{uuid.uuid4().hex[:12]}.py"
    return await _run(
        ["python3", "-I", script],
        {script: code},
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_chars=max_output_chars,
    )


async def execute_shell(
    command: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """Run `command` with `/bin/sh -c` in a sandbox's /workspace; its output as text, as `execute_python` gives."""
    return await _run(command, {}, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)


def _check(timeout_s: float, memory_mb: int, max_output_chars: int) -> None:
    if timeout_s <= 0 or memory_mb <= 0 or max_output_chars <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_chars must be > 0")


def make_run_python(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Callable[[str], Awaitable[str]]:
    """A `run_python(code)` tool with these limits, ready for `ToolEnvironment.register_tool`."""
    _check(timeout_s, memory_mb, max_output_chars)

    async def run_python(code: str) -> str:
        """Run a Python program and return what it prints (stdout, then stderr).

        Args:
            code: The complete Python source to run; use print() to show results.
        """
        return await execute_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)

    return run_python


def make_shell(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Callable[[str], Awaitable[str]]:
    """A `shell(command)` tool with these limits, ready for `ToolEnvironment.register_tool`."""
    _check(timeout_s, memory_mb, max_output_chars)

    async def shell(command: str) -> str:
        """Run a shell command in the working directory and return what it prints (stdout, then stderr).

        Args:
            command: A /bin/sh command line, for example "wc -l data.txt" or "grep -c error log.txt".
        """
        return await execute_shell(command, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)

    return shell


run_python = make_run_python()
"""`run_python(code)` with the default limits (10 s wall time, 512 MB of memory, 4000 output characters)."""

shell = make_shell()
"""`shell(command)` with the default limits (10 s wall time, 512 MB of memory, 4000 output characters)."""
