"""An optimizer state (any pytree of arrays) moved to host memory between steps and back with its shardings."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def has_pinned_host(sharding) -> bool:
    """Whether `sharding`'s devices have pinned host memory (accelerators; a CPU device has only its own)."""
    try:
        return all(
            any(m.kind == "pinned_host" for m in d.addressable_memories()) and d.platform != "cpu"
            for d in sharding.device_set
        )
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


Placement = tuple[Any, list]
"""What `restore` needs to put an offloaded tree back: (treedef, each leaf's sharding or None)."""


def offload(tree: Any) -> tuple[Any, Placement]:
    """`tree` in host memory (pinned host memory where the devices have it, else NumPy arrays), and its placement
    for `restore`. Waits until the copies are done."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shardings = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
    host = []
    for x, sharding in zip(leaves, shardings, strict=True):
        if sharding is None:
            host.append(x)
        elif has_pinned_host(sharding):
            host.append(jax.device_put(x, sharding.with_memory_kind("pinned_host")))
        else:
            host.append(np.asarray(x))
    jax.block_until_ready([h for h in host if isinstance(h, jax.Array)])
    return jax.tree_util.tree_unflatten(treedef, host), (treedef, shardings)


def restore(tree: Any, placement: Placement) -> Any:
    """An offloaded `tree` back on the devices, each array with the sharding it had (`placement` from `offload`)."""
    treedef, shardings = placement
    leaves = jax.tree_util.tree_leaves(tree)
    back = [x if s is None else jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, back)
