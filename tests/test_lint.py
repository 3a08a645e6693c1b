"""The code base stays ruff-clean (lint and format)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_and_format():
    for args in (["check", "."], ["format", "--check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout}{out.stderr}"


def test_no_formatter_opt_outs():
    """The formatter's output is the layout: no line opts out of it (a `fmt` or `yapf` pragma comment)."""
    marks = ("# fmt: " + "skip", "# fmt: " + "off", "# yapf: " + "disable")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(ROOT.glob("**/*.py"))
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(mark in line for mark in marks)
    ]
    assert not found, f"formatter opt-outs: {found}"
