"""Linear layers whose weight gradients need few transposed copies (`ModelConfig.layout_aware_gradients`)."""

from __future__ import annotations

import math
from functools import partial

import equinox as eqx
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax.quantization import DefaultDotGeneralOp


def _contract(a: jax.Array, b: jax.Array, pairs: list[tuple[int, int]], out: list[tuple[int, int]], precision):
    """Σ over paired dims (`pairs`: (dim of a, dim of b)) of a·b, with result axes `out` ((0 for a / 1 for b, dim)).

    XLA:CPU computes a dot as `[free, contracted] @ [contracted, free]` in row-major layout and transposes whatever
    does not fit that into a copy. Of the two operand orders this takes the one whose copies (of an operand or of
    the result) hold the fewest elements.
    """
    dtype = jnp.promote_types(a.dtype, b.dtype)
    ops = (a.astype(dtype), b.astype(dtype))
    out_size = math.prod(ops[i].shape[d] for i, d in out)
    best = None
    for first in (0, 1):
        x, y = ops[first], ops[1 - first]
        ordered = sorted((p[first], p[1 - first]) for p in pairs)
        x_c, y_c = [p[0] for p in ordered], [p[1] for p in ordered]
        produced = [(first, d) for d in range(x.ndim) if d not in x_c]
        produced += [(1 - first, d) for d in range(y.ndim) if d not in y_c]
        cost = x.size if x_c != list(range(x.ndim - len(x_c), x.ndim)) else 0
        cost += y.size if y_c != list(range(len(y_c))) else 0
        cost += out_size if produced != out else 0
        if best is None or cost < best[0]:
            best = (cost, x, y, x_c, y_c, produced)
    _, x, y, x_c, y_c, produced = best
    result = jax.lax.dot_general(x, y, ((tuple(x_c), tuple(y_c)), ((), ())), precision=precision)
    perm = tuple(produced.index(o) for o in out)
    return result if perm == tuple(range(len(perm))) else jnp.transpose(result, perm)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _layout_aware_dot(lhs, rhs, contracting, precision, preferred_element_type):
    return jax.lax.dot_general(lhs, rhs, (contracting, ((), ())), precision, preferred_element_type)


def _layout_aware_dot_fwd(lhs, rhs, contracting, precision, preferred_element_type):
    return _layout_aware_dot(lhs, rhs, contracting, precision, preferred_element_type), (lhs, rhs)


def _layout_aware_dot_bwd(contracting, precision, preferred_element_type, residuals, g):
    lhs, rhs = residuals
    lc, rc = contracting
    l_free = [d for d in range(lhs.ndim) if d not in lc]
    r_free = [d for d in range(rhs.ndim) if d not in rc]
    n = len(l_free)  # g's axes: lhs's free dims, then rhs's free dims
    # d lhs = g · rhs over rhs's free dims; d rhs = lhs · g over lhs's free dims (operands: 0 = g or lhs, 1 = the other)
    lhs_out = [(0, l_free.index(d)) if d in l_free else (1, rc[lc.index(d)]) for d in range(lhs.ndim)]
    d_lhs = _contract(g, rhs, [(n + i, d) for i, d in enumerate(r_free)], lhs_out, precision)
    rhs_out = [(1, n + r_free.index(d)) if d in r_free else (0, lc[rc.index(d)]) for d in range(rhs.ndim)]
    d_rhs = _contract(lhs, g, [(d, i) for i, d in enumerate(l_free)], rhs_out, precision)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_layout_aware_dot.defvjp(_layout_aware_dot_fwd, _layout_aware_dot_bwd)


def _constrains_nothing(sharding) -> bool:
    """Whether a dot's `out_sharding` places nothing: None, or a sharding over a mesh without axes."""
    return sharding is None or bool(getattr(getattr(sharding, "mesh", None), "empty", False))


class LayoutAwareDotGeneral(eqx.Module):
    """`jax.lax.dot_general` for `haliax.nn.Linear` whose backward pass orders each gradient contraction (see
    `_contract`) so that few elements are transposed. On XLA:CPU the default rule computes a weight gradient
    `dW[mlp, embed] = Σ_tokens dh[tokens, mlp] · x[tokens, embed]` by copying the whole `dh` (tokens × mlp) into a
    transposed layout; this one copies the smaller `x` (and the weight-sized result) instead. Contractions with
    batch dimensions, or called with extra options, use the default rule. haliax passes every dot an `out_sharding`;
    outside an explicitly sharded mesh it is a sharding over the empty mesh, which constrains nothing and is dropped
    here (a sharding over a real mesh keeps the default rule)."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        (lc, rc), (lb, rb) = dimension_numbers
        if "out_sharding" in kwargs and _constrains_nothing(kwargs["out_sharding"]):
            del kwargs["out_sharding"]
        if lb or rb or kwargs:
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        return _layout_aware_dot(lhs, rhs, (tuple(lc), tuple(rc)), precision, preferred_element_type)


def with_layout_aware_gradients(model: eqx.Module) -> eqx.Module:
    """`model` with every linear layer that uses the default `dot_general` switched to `LayoutAwareDotGeneral`
    (same parameters and forward values; see `ModelConfig.layout_aware_gradients`)."""

    def is_linear(x) -> bool:
        return isinstance(x, hnn.Linear)

    def swap(x):
        if is_linear(x) and isinstance(x.dot_general, DefaultDotGeneralOp):
            return eqx.tree_at(lambda lin: lin.dot_general, x, LayoutAwareDotGeneral())
        return x

    return jax.tree_util.tree_map(swap, model, is_leaf=is_linear)
