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
