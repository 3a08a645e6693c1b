import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _run_from_repo_root():
    """Tests refer to experiments/ by relative path, as a user would from the repository root."""
    previous = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(previous)
