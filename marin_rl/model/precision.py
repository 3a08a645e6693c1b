"""Mixed precision: parameters and optimizer state in float32, the forward and backward passes in a compute dtype.

The learner keeps its parameters (and so its optimizer state and updates) in float32 and casts them to the compute
dtype inside each forward pass, as Levanter's trainer does with a `jmp` policy (`p=f32,c=<compute>`): matrix
products and activations run in bfloat16, gradients flow back through the cast into float32 parameters. What must
stay exact stays float32 whatever the compute dtype: the logits are cast to float32 before the softmax
(`marin_rl.model.logprobs`), and logprobs, entropies, the loss, its reductions and the optimizer all run in float32.
The engines serve the same cast weights, so sampler and learner compute in one dtype.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import jmp

from marin_rl.model.config import COMPUTE_DTYPES

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_compute_dtype(name: str, platform: str) -> str:
    """The compute dtype `name` ('auto', 'float32' or 'bfloat16') means on devices of `platform` ('cpu', 'gpu',
    'tpu', ...): 'auto' is bfloat16 on accelerators and float32 on CPUs (whose bfloat16 matrix products are not
    faster)."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"model.compute_dtype must be one of {COMPUTE_DTYPES}, got {name!r}")
    if name == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return name


def compute_dtype_here(name: str) -> str:
    """`resolve_compute_dtype` for the devices JAX uses in this process (its default backend)."""
    import jax

    return resolve_compute_dtype(name, jax.default_backend())


def precision_policy(compute_dtype: str) -> jmp.Policy:
    """The `jmp` policy of a compute dtype: parameters float32, compute `compute_dtype`, outputs float32."""
    if compute_dtype not in _DTYPES:
        raise ValueError(f"compute dtype must be 'float32' or 'bfloat16', got {compute_dtype!r}")
    return jmp.Policy(param_dtype=jnp.float32, compute_dtype=_DTYPES[compute_dtype], output_dtype=jnp.float32)


def cast_to_compute(tree: Any, compute_dtype: str | None) -> Any:
    """`tree` (a model) with its floating arrays cast to `compute_dtype` (None or 'float32': unchanged). Traceable;
    under a gradient, the cast passes gradients back to the float32 arrays."""
    if compute_dtype is None or compute_dtype == "float32":
        return tree
    return precision_policy(compute_dtype).cast_to_compute(tree)
