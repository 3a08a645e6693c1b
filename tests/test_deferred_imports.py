"""Deferred imports (`marin_rl.deferred_imports`): a process importing marin_rl does not pay for wandb, datasets or
IPython until it uses them, and using them through a placeholder bound earlier behaves as the real module."""

import subprocess
import sys
import textwrap
from pathlib import Path

from subprocess_env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env) -> str:
    """Run `code` in a fresh interpreter (stdout a pipe, as in a Ray actor or a subprocess); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_run_program_imports_without_wandb_datasets_or_ipython_and_they_work_on_first_use():
    out = _python(
        """
        import sys
        import marin_rl.run
        import levanter.tracker.wandb as lt
        from marin_rl.deferred_imports import is_deferred

        print("deferred", is_deferred("wandb"), is_deferred("datasets"), "IPython" in sys.modules)
        # Levanter's module bound the placeholder; using it imports the real module, which takes its place
        assert type(lt.wandb).__name__ == "DeferredModule"
        settings = lt.wandb.Settings(save_code=False)
        import wandb
        print("wandb real", not is_deferred("wandb"), type(settings).__module__.startswith("wandb"))
        # a submodule import through the (now forwarding) placeholder, and an attribute write forwarded to the module
        import wandb.sdk.lib.disabled
        lt.wandb.marin_rl_probe = 7
        print("forwarded", wandb.marin_rl_probe == 7, lt.wandb.__version__ == wandb.__version__)
        import datasets
        ds = datasets.Dataset.from_dict({"a": [1, 2, 3]})
        print("datasets", not is_deferred("datasets"), ds.num_rows)
        """
    )
    assert "deferred True True False" in out, out
    assert "wandb real True True" in out, out
    assert "forwarded True True" in out, out
    assert "datasets True 3" in out, out


def test_eager_imports_turn_the_deferral_off():
    out = _python(
        """
        import sys
        import marin_rl.run
        from marin_rl.deferred_imports import is_deferred

        print("deferred", is_deferred("wandb"), is_deferred("datasets"), "wandb" in sys.modules)
        """,
        MARIN_RL_EAGER_IMPORTS="1",
    )
    assert "deferred False False True" in out, out


def test_a_module_imported_before_marin_rl_is_left_as_it_is():
    out = _python(
        """
        import wandb
        import marin_rl
        from marin_rl.deferred_imports import defer, is_deferred

        print("kept", not is_deferred("wandb"), defer("wandb"), defer("no_such_module_anywhere"))
        """
    )
    assert "kept True False False" in out, out
