"""LoRA adapters set to random values, so that they change the policy (a fresh adapter's B·A is 0)."""

import equinox as eqx
import jax

from marin_rl.model import lora


def perturbed_adapters(model, scale: float = 0.05, seed: int = 1):
    """`model` (adapted) with every adapter array replaced by Gaussian noise of standard deviation `scale`."""
    adapters, base = lora.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(eqx.filter(adapters, eqx.is_array))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    _, static = eqx.partition(adapters, eqx.is_array)
    return lora.join(eqx.combine(jax.tree_util.tree_unflatten(treedef, noisy), static), base)
