"""Parameter arrays as the transports move them: the leaves of a model in the order servers expect, host (NumPy)
copies cast to `broadcast.dtype` (on the learner's device first when the arrays live on an accelerator), aligned
buffers and byte views, and dtypes by name."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def flatten_params(params: Any) -> list:
    """Leaves of `params` in the order servers expect: that of `eqx.filter(model, eqx.is_array)`.

    A list or tuple of arrays is taken as already flattened.
    """
    if isinstance(params, (list, tuple)) and all(eqx.is_array(x) for x in params):
        return list(params)
    return jax.tree_util.tree_leaves(eqx.filter(params, eqx.is_array))


_cast_on_device = jax.jit(lambda leaves, dtype: [x.astype(leaf_dtype(x, dtype)) for x in leaves], static_argnums=1)


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.sharding.device_set)


def cast_on_host(x: np.ndarray, dtype) -> np.ndarray:
    """`x` cast to `dtype` into a 64-byte-aligned buffer (so a CPU device can take it without a copy)."""
    out = aligned_empty(x.shape, dtype)
    np.copyto(out, x, casting="unsafe")
    return out


def host_leaves(params: Any, dtype: str | None, cast_host_arrays: bool = True) -> list[np.ndarray]:
    """Host (NumPy) copies of the leaves of `params`, floating ones cast to `dtype` when given.

    Accelerator arrays are cast on their device before the transfer, so only the cast bytes cross to the host.
    Arrays on a CPU device are read in place (no copy: JAX arrays are immutable) and cast with NumPy, several
    times faster there than XLA's CPU convert; `cast_host_arrays=False` leaves those uncast, for a caller that
    casts while copying them anyway (see `leaf_dtype`).
    """
    leaves = flatten_params(params)
    target = None if dtype is None else jnp.dtype(dtype)

    def needs_cast(x) -> bool:
        return leaf_dtype(x, dtype) != x.dtype

    out: list[np.ndarray] = [None] * len(leaves)  # type: ignore[list-item]
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not _on_cpu(x)]
    if on_device:
        dev = [leaves[i] for i in on_device]
        if any(needs_cast(x) for x in dev):
            dev = _cast_on_device(dev, target)
        for i, x in zip(on_device, jax.device_get(dev), strict=True):
            out[i] = np.asarray(x)
    for i, x in enumerate(leaves):
        if out[i] is None:
            x = np.asarray(x)
            out[i] = cast_on_host(x, target) if cast_host_arrays and needs_cast(x) else x
    return out


def leaf_dtype(x, dtype: str | None) -> np.dtype:
    """The dtype `x` travels in when `broadcast.dtype` is `dtype`: floating arrays cast, others as they are."""
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
        return np.dtype(jnp.dtype(dtype))
    return np.dtype(x.dtype)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary.

    JAX places 64-byte-aligned host arrays on a CPU device without copying them (unaligned ones are copied, at a
    fraction of memcpy speed), and aligned buffers are what DMA engines prefer on accelerators.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def byte_view(x: np.ndarray) -> np.ndarray:
    """The bytes of `x` as a flat uint8 array (a view when `x` is contiguous)."""
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def dtype_name(dtype) -> str:
    """Portable name of a NumPy dtype ('float32', 'bfloat16', ...)."""
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    """The NumPy dtype named `name` (bfloat16 included, through JAX's ml_dtypes)."""
    return np.dtype(jnp.dtype(name))
