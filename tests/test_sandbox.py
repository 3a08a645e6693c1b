"""The sandbox (`marin_rl.envs.sandbox`): what runs inside works, and every escape a hostile command tries fails.

Each probe shows the escape working from the host (or the resource it aims at being real) before it fails inside,
so a probe cannot pass because it was written wrong.
"""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from marin_rl.envs import sandbox as sandbox_module
from marin_rl.envs.code_tools import execute_python, execute_shell, run_python, shell
from marin_rl.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, check_sandbox_available, use_sandbox

SECRETS = {"WANDB_API_KEY": "wandb-secret-5d1c9e", "AWS_SECRET_ACCESS_KEY": "aws-secret-77aa03"}


def run(coro):
    return asyncio.run(coro)


async def _in_sandbox(command, limits=None, **kwargs):
    async with Sandbox(limits) as sb:
        return await sb.exec(command, **kwargs)


def test_sandbox_runs_python_and_shell_and_keeps_files():
    async def go():
        async with Sandbox(SandboxLimits(timeout_s=10)) as sb:
            await sb.write_file("data.csv", "a,1\nb,2\nc,39\n")
            await sb.write_file("sub/dir/script.py", "import sys\nprint(sum(map(int, sys.argv[1:])))\n")
            awk = await sb.exec("awk -F, '{s+=$2} END {print s}' data.csv")
            py = await sb.exec(["python3", "sub/dir/script.py", "4", "5"])
            piped = await sb.exec("wc -c", stdin="hello")
            made = await sb.exec("echo made > out.txt && echo oops >&2 && exit 3")
            back = await sb.read_file("out.txt")
            where = await sb.exec("pwd; echo $HOME; id -u")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")
            return awk, py, piped, made, back, where

    awk, py, piped, made, back, where = run(go())
    assert (awk.returncode, awk.stdout, awk.stderr) == (0, b"42\n", b"")
    assert py.stdout == b"9\n"
    assert piped.stdout.strip() == b"5"
    assert (made.returncode, made.stdout, made.stderr) == (3, b"", b"oops\n")
    assert back == b"made\n"
    assert where.stdout.decode().split() == ["/workspace", "/workspace", "1000"]


def test_files_last_across_calls_but_not_across_sandboxes():
    async def go():
        async with Sandbox() as first:
            await first.exec("echo kept > note.txt")
            again = await first.exec("cat note.txt")
        async with Sandbox() as second:
            other = await second.exec("cat note.txt")
        return again, other

    again, other = run(go())
    assert again.stdout == b"kept\n"
    assert other.returncode != 0 and b"No such file" in other.stderr


def test_probe_host_files_are_invisible_and_the_system_read_only(tmp_path):
    secret = tmp_path / "host_secret.txt"
    secret.write_text("host-only")
    repo_file = Path(__file__).resolve()
    targets = [str(secret), str(repo_file), "/etc/shadow", "/root", os.path.expanduser("~"), "/work", "/home"]
    assert secret.read_text() == "host-only" and repo_file.exists() and Path("/etc/shadow").exists()
    reads = " ; ".join(f"cat {t} || ls {t}" for t in targets)
    writes = "touch /usr/x; touch /etc/x; touch /x; touch /proc/x; touch /dev/x"
    result = run(_in_sandbox(f"{reads}; {writes}"))
    out, err = result.stdout.decode(), result.stderr.decode()
    assert "host-only" not in out and "marin_rl" not in out and out == ""
    top = run(_in_sandbox("ls /")).stdout.decode().split()
    assert {"usr", "bin", "etc", "proc", "dev", "tmp", "workspace"} <= set(top)
    assert set(top) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "sbin", "tmp", "usr"} | {
        "workspace"
    }
    etc = run(_in_sandbox("ls /etc")).stdout.decode().split()
    assert "shadow" not in etc and "passwd" in etc and len(etc) < 10
    for t in targets:
        assert f"{t}: No such file or directory" in err, t
    for path in ("/usr/x", "/etc/x", "/x", "/dev/x"):
        assert f"touch: cannot touch '{path}': Read-only file system" in err, path


def test_probe_environment_secrets_are_not_passed(monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    assert all(os.environ[k] == v for k, v in SECRETS.items())
    # every process's environment the sandbox can read, its own and PID 1's (bwrap's own environment)
    result = run(_in_sandbox("env; for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done; true"))
    out = result.stdout.decode()
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in out
    for key, value in SECRETS.items():
        assert key not in out and value not in out
    # run_python too
    printed = run(execute_python("import os\nprint(sorted(os.environ))"))
    assert not any(key in printed for key in SECRETS)


def test_probe_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []

    def accept():
        server.settimeout(5)
        try:
            conn, _ = server.accept()
            accepted.append(conn.recv(64))
            conn.close()
        except OSError:
            pass

    # the listener works from the host
    with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
        c.sendall(b"from-host")
    accept()
    assert accepted == [b"from-host"]
    thread = threading.Thread(target=accept)
    thread.start()
    code = (
        "import socket\n"
        "for addr in [('127.0.0.1', PORT), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2).sendall(b'from-sandbox')\n"
        "        print('connected', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', addr, type(e).__name__)\n"
    ).replace("PORT", str(port))
    result = run(_in_sandbox(["python3", "-c", code]))
    thread.join()
    server.close()
    out = result.stdout.decode()
    assert "connected" not in out and out.count("refused") == 3, out
    assert accepted == [b"from-host"]
    links = run(_in_sandbox("cat /proc/net/dev")).stdout.decode()
    assert [line.split(":")[0].strip() for line in links.splitlines()[2:]] == ["lo"]


def test_probe_listening_on_all_interfaces_is_not_reachable_from_the_host():
    probe = socket.socket()
    probe.bind(("0.0.0.0", 0))
    port = probe.getsockname()[1]
    probe.close()
    code = (
        "import socket\n"
        "s = socket.socket(); s.bind(('0.0.0.0', PORT)); s.listen(); s.settimeout(3)\n"
        "print('listening', flush=True)\n"
        "try:\n"
        "    s.accept(); print('accepted')\n"
        "except OSError:\n"
        "    print('nobody came')\n"
    ).replace("PORT", str(port))

    async def go():
        task = asyncio.create_task(_in_sandbox(["python3", "-c", code]))
        await asyncio.sleep(1.0)
        reached = []
        for _ in range(10):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                reached.append(True)
            except OSError:
                reached.append(False)
            await asyncio.sleep(0.1)
        return await task, reached

    result, reached = run(go())
    assert result.stdout.decode().split("\n")[:2] == ["listening", "nobody came"]
    assert not any(reached)


def test_probe_fork_bomb_is_contained():
    limits = SandboxLimits(timeout_s=5, max_processes=32)
    counted = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.strerror)\n"
    )

    async def go():
        async with Sandbox(limits) as sb:
            start = time.monotonic()
            first = await sb.exec(["python3", "-c", counted])
            bomb = await sb.exec("bomb() { bomb | bomb & }; bomb", timeout_s=3)
            took = time.monotonic() - start
            after = await sb.exec("ls /proc | grep -c '^[0-9]'")
            return first, bomb, took, after

    first, bomb, took, after = run(go())
    n, reason = first.stdout.decode().split(" ", 1)
    assert 0 < int(n) < 32 and reason.strip() == "Resource temporarily unavailable"
    assert took < 20
    assert bomb.returncode is not None
    assert int(after.stdout) <= 4  # PID 1, the shell, ls, grep: the bomb is gone
    # the host can still start processes
    assert subprocess.run(["true"]).returncode == 0


def test_probe_filling_the_disk_stops_at_the_caps():
    limits = SandboxLimits(disk_mb=8, tmp_mb=4, max_file_mb=6)
    fill = (
        "for d in /workspace /tmp /dev/shm; do i=0; "
        "while dd if=/dev/zero of=$d/f$i bs=1M count=2 2>/dev/null; do i=$((i+1)); [ $i -gt 100 ] && break; done; "
        "echo $d $i; done; dd if=/dev/zero of=/workspace/big bs=1M count=100 2>&1 | head -1; du -sm /workspace /tmp"
    )

    async def go():
        async with Sandbox(limits) as sb:
            result = await sb.exec(fill)
            with pytest.raises(OSError) as err:
                await sb.write_file("more.bin", b"x" * (9 << 20))
            await sb.exec("rm -f /workspace/*")
            big = await sb.exec("dd if=/dev/zero of=one bs=1M count=7 2>/dev/null; stat -c %s one")
            return result, err.value, big

    result, err, big = run(go())
    counts = dict(line.split() for line in result.stdout.decode().splitlines() if line.startswith("/"))
    assert int(counts["/workspace"]) <= 4 and int(counts["/tmp"]) <= 2 and int(counts["/dev/shm"]) <= 2
    assert "No space left on device" in result.stdout.decode()
    assert "No space left on device" in str(err)
    # a single file past max_file_mb, with room left (8 MB): the writer is stopped (SIGXFSZ) at 6 MB
    assert big.stdout == b"6291456\n"


def test_probe_processes_do_not_outlive_the_timeout():
    marker = "31415.9"  # sleep's argument: findable in the host's process list

    def host_pids_with_marker():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd and b"sleep" in cmd:
                found.append(int(pid))
        return found

    escape = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', 'MARKER'])\n"
        "    os._exit(0)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    while True:\n"
        "        with open('/workspace/beat', 'a') as f: f.write('x')\n"
        "        time.sleep(0.05)\n"
        "time.sleep(60)\n"
    ).replace("MARKER", marker)

    async def go():
        async with Sandbox() as sb:
            start = time.monotonic()
            timed = await sb.exec(["python3", "-c", escape], timeout_s=1.5)
            took = time.monotonic() - start
            left = host_pids_with_marker()
            size = len(await sb.read_file("beat"))
            await asyncio.sleep(0.5)
            size_later = len(await sb.read_file("beat"))
            quick = await sb.exec(["python3", "-c", escape.replace("time.sleep(60)", "print('done')")])
            left_quick = host_pids_with_marker()
            return timed, took, left, size, size_later, quick, left_quick

    timed, took, left, size, size_later, quick, left_quick = run(go())
    assert timed.timed_out and timed.returncode == -9
    assert took < 10, took  # 1.5 s, plus starting Python and killing under load
    assert left == [] and left_quick == []
    assert size > 0 and size_later == size  # the heartbeat stopped with the call
    assert quick.stdout == b"done\n" and not quick.timed_out  # also when the command itself exits at once
    # the tool reports it and does not hang
    start = time.monotonic()
    text = run(execute_python(escape, timeout_s=1.0))
    assert text == "error: wall-time limit of 1 s exceeded" and time.monotonic() - start < 10
    assert host_pids_with_marker() == []


def test_probe_host_processes_are_invisible():
    me = os.getpid()
    assert Path(f"/proc/{me}/maps").read_text()
    result = run(_in_sandbox(f"cat /proc/{me}/maps; cat /proc/{os.getppid()}/maps; ls /proc | grep '^[0-9]'"))
    err = result.stderr.decode()
    assert f"/proc/{me}/maps: No such file or directory" in err
    assert sorted(map(int, result.stdout.split())) == sorted(map(int, result.stdout.split()))[:4]
    assert max(map(int, result.stdout.split())) < 10  # only the sandbox's own few PIDs


def test_probe_memory_and_cpu_limits():
    limits = SandboxLimits(memory_mb=128, cpu_s=1, timeout_s=10)
    mem = run(_in_sandbox(["python3", "-c", "x = bytearray(512 << 20)"], limits))
    cpu = run(_in_sandbox(["python3", "-c", "while True: pass"], limits))
    assert mem.returncode == 1 and b"MemoryError" in mem.stderr
    assert not cpu.timed_out and cpu.returncode in (-9, -24)  # SIGKILL or SIGXCPU at 1 CPU second


def test_sandbox_dies_with_its_host_process(tmp_path):
    marker = "27182.8"
    script = (
        "import asyncio\n"
        "from marin_rl.envs.sandbox import Sandbox\n"
        "async def main():\n"
        "    sb = await Sandbox.create()\n"
        "    print('up', flush=True)\n"
        "    await sb.exec('sleep MARKER', timeout_s=60)\n"
        "asyncio.run(main())\n"
    ).replace("MARKER", marker)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.stdout.readline() == b"up\n"
    time.sleep(0.5)

    def running():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
        return found

    assert running(), "the sandboxed sleep is visible from the host while it runs"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == []


def test_destroy_ends_the_sandbox():
    async def go():
        sb = await Sandbox.create()
        await sb.destroy()
        await sb.destroy()  # idempotent
        with pytest.raises(sandbox_module.SandboxError, match="sandbox ended: destroyed"):
            await sb.exec("true")
        return sb

    assert not run(go()).alive


def test_tools_share_the_episode_sandbox():
    async def go():
        async with Sandbox() as sb:
            with use_sandbox(sb):
                made = await shell("printf '3\\n4\\n' > n.txt && echo ok")
                summed = await run_python("print(sum(int(x) for x in open('n.txt')))")
            alone = await execute_shell("cat n.txt")  # a fresh sandbox of its own
        return made, summed, alone

    made, summed, alone = run(go())
    assert (made, summed) == ("ok", "7")
    assert "No such file or directory" in alone and alone.endswith("exit code 1")


def test_missing_bwrap_is_named_with_how_to_install(monkeypatch):
    sandbox_module._bwrap_path.cache_clear()
    sandbox_module._check_cached.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        with pytest.raises(SandboxUnavailable) as err:
            check_sandbox_available()
        message = str(err.value)
        assert "bubblewrap (`bwrap`)" in message and "apt-get install -y bubblewrap" in message
        assert "\n" not in message
        with pytest.raises(SandboxUnavailable):
            run(Sandbox.create())
    finally:
        sandbox_module._bwrap_path.cache_clear()
        sandbox_module._check_cached.cache_clear()
    monkeypatch.undo()
    check_sandbox_available()


def test_probe_the_sandbox_agent_cannot_be_killed_or_read():
    """PID 1 of the sandbox runs the commands: what runs inside can neither kill it nor read its memory, files or
    control pipes."""

    async def go():
        async with Sandbox() as sb:
            tried = await sb.exec("kill -9 1; kill -INT 1; kill -TERM 1; ls /proc/1/fd; cat /proc/1/maps; echo tried")
            after = await sb.exec("echo still here")
            return tried, after

    tried, after = run(go())
    err = tried.stderr.decode()
    assert tried.stdout == b"tried\n"
    assert "/proc/1/fd': Permission denied" in err and "/proc/1/maps: Permission denied" in err
    assert after.stdout == b"still here\n"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("timeout_s", 0, "sandbox.timeout_s: must be > 0, got 0"),
        ("memory_mb", 1, "sandbox.memory_mb: must be >= 16, got 1"),
        ("max_processes", 2, "sandbox.max_processes: must be >= 4, got 2"),
        ("disk_mb", 0, "sandbox.disk_mb: must be >= 1, got 0"),
    ],
)
def test_limits_out_of_range_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SandboxLimits(**{field: value})
