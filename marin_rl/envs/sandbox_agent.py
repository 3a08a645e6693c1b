"""The process inside a sandbox that runs its commands (`marin_rl.envs.sandbox`); standard library only.

It runs as PID 1 of the sandbox's PID namespace (`bwrap --as-pid-1`), so nothing inside can kill it, and reads one
JSON request a line on stdin, answering each with one JSON line on stdout:

    {"op": "exec", "argv": [...], "timeout_s": T, "memory_mb": M, "cpu_s": C, "max_processes": P,
     "max_file_mb": F, "max_output_bytes": N, "stdin": b64}  -> {"returncode", "stdout", "stderr" (b64),
                                                                  "stdout_dropped", "stderr_dropped", "timed_out"}
    {"op": "write", "path": p, "data": b64, "mode": m}      -> {}
    {"op": "read", "path": p, "max_bytes": n}                -> {"data": b64, "size": total bytes}

A failure answers {"error": text, "errno": n}. A command runs in its own session with the limits as rlimits
(address space, CPU seconds, processes, file size, no core dumps) and a fixed environment; when it exits or its
wall time is up, every other process of the sandbox is killed (`kill(-1, SIGKILL)` from PID 1 reaches all of them,
whatever sessions or parents they have), so nothing a command starts outlives it. Stdin is closed at end of input
and the sandbox ends with this process.
"""

import base64
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time

WORKSPACE = "/workspace"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}


def _no_dumps():
    """Forbid other processes of the sandbox (same user) from reading this one's memory and file descriptors."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass


def _limits(req):
    def apply():
        mem = int(req["memory_mb"]) << 20
        cpu = int(req["cpu_s"])
        fsize = int(req["max_file_mb"]) << 20
        nproc = int(req["max_processes"])
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return apply


def _signal_all():
    """SIGKILL every process of the sandbox but this one (PID 1)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # nobody left to signal
        pass


def _kill_others():
    """SIGKILL every process of the sandbox but this one, until none is left, reaping them all."""
    for _ in range(1000):
        _signal_all()
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        time.sleep(0.001)


def _exec(req):
    proc = subprocess.Popen(
        req["argv"],
        cwd=req.get("cwd") or WORKSPACE,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_limits(req),
    )
    data = base64.b64decode(req.get("stdin") or "")
    cap = int(req["max_output_bytes"])
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    dropped = dict.fromkeys(kept, 0)
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    try:  # small inputs fit the pipe; a command that does not read them gets a broken pipe, not a hang
        os.set_blocking(proc.stdin.fileno(), False)
        os.write(proc.stdin.fileno(), data[: 1 << 16])
    except OSError:
        pass
    proc.stdin.close()
    deadline = time.monotonic() + float(req["timeout_s"])
    timed_out = False

    def drain(wait):
        for key, _ in sel.select(wait):
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            room = max(0, cap - len(kept[fd]))
            kept[fd] += chunk[:room]
            dropped[fd] += max(0, len(chunk) - room)

    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        if sel.get_map():
            drain(min(left, 0.02))
        else:
            time.sleep(min(left, 0.005))
    if proc.returncode is None:  # timed out: kill it first, and reap it for its status
        _signal_all()
        proc.wait()
    _kill_others()  # whatever it left running
    while sel.get_map():  # every writer is gone: read what is left up to end of file
        drain(0.1)
    out, err = kept[proc.stdout.fileno()], kept[proc.stderr.fileno()]
    out_dropped, err_dropped = dropped[proc.stdout.fileno()], dropped[proc.stderr.fileno()]
    proc.stdout.close()
    proc.stderr.close()
    return {
        "returncode": proc.returncode,
        "stdout": base64.b64encode(bytes(out)).decode(),
        "stderr": base64.b64encode(bytes(err)).decode(),
        "stdout_dropped": out_dropped,
        "stderr_dropped": err_dropped,
        "timed_out": timed_out,
    }


def _path(p):
    return os.path.normpath(os.path.join(WORKSPACE, p))


def _write(req):
    path = _path(req["path"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(req.get("mode", 0o644)))
    try:
        view = memoryview(base64.b64decode(req["data"]))
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.chmod(path, int(req.get("mode", 0o644)))
    return {}


def _read(req):
    path = _path(req["path"])
    with open(path, "rb") as f:
        data = f.read(int(req["max_bytes"]))
        size = os.fstat(f.fileno()).st_size
    return {"data": base64.b64encode(data).decode(), "size": size}


def main():
    _no_dumps()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # PID 1 ignores the signals it does not handle; so should this
    ops = {"exec": _exec, "write": _write, "read": _read}
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = ops[req["op"]](req)
        except OSError as e:
            reply = {"error": f"{type(e).__name__}: {e.strerror or e}", "errno": e.errno or 0}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "errno": 0}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    _kill_others()


if __name__ == "__main__":
    main()
