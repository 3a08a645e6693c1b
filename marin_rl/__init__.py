"""marin_rl: RL post-training for language models on Levanter.

Importing the package checks that the Levanter it will use is one line, not two: the older `levanter`/`haliax`
distributions and the maintained `marin-levanter`/`marin-haliax` ones install the same import packages, and pip
installs one over the other without removing anything, leaving a mix that fails deep inside Levanter. A process
started with `MARIN_RL_CPU_AFFINITY` (a role's `placement.*.cpu_affinity`) pins itself to those cores here, before
JAX sizes its thread pools. Modules Levanter imports eagerly but marin_rl rarely uses (wandb, datasets) are
deferred to their first use (`marin_rl.deferred_imports`): about a CPU-second less in every process that imports it.
"""

import importlib.metadata as _metadata


def _installed(distribution: str) -> bool:
    try:
        _metadata.distribution(distribution)
        return True
    except _metadata.PackageNotFoundError:
        return False


def check_one_levanter_line() -> None:
    """Raise ImportError, naming the fix, when an old-line and a maintained-line distribution share an import name."""
    mixed = [name for name in ("levanter", "haliax") if _installed(name) and _installed(f"marin-{name}")]
    if mixed:
        both = ", ".join(f"{name} and marin-{name}" for name in mixed)
        raise ImportError(
            f"{both} are both installed and share one import package, so its modules are a mix of two versions. "
            "Run ./install.sh from the marin_rl checkout (it removes the old line and reinstalls the maintained "
            "one), or: pip uninstall -y levanter haliax marin-levanter marin-haliax && pip install -e ."
        )


check_one_levanter_line()


def _defer_unused_imports() -> None:
    from marin_rl.deferred_imports import defer_unused_imports

    defer_unused_imports()


_defer_unused_imports()


def _pin_to_configured_cores() -> None:
    from marin_rl.placement import apply_cpu_affinity

    apply_cpu_affinity()


_pin_to_configured_cores()
