"""LoRA adapters on the policy (Hu et al. 2021), built on Levanter's tree surgery (`levanter.adaptor.lora`).

With `learner.lora.rank > 0` the learner wraps the policy's linear layers in `LoraLinear`s after its warm start (the
warm start, like `model.init_from_hf`, makes the *base*), and from then on trains only the adapters:

* `split` / `join` separate the trainable part of a model (the adapters, or the whole model without LoRA) from the
  frozen part (the base), so gradients, optimizer state and their updates cover the adapters alone;
* `without_adapters` is the base model itself (the KL reference with adapters off: no second copy of the weights);
* a published version carries the adapters only (`publish_leaves`); a server holds the base and serves the merged
  weights `W + (α/r)·B·A` (`AdapterMerger`): merging once per version keeps every decode step as cheap as the base
  model's, where computing with the adapters would add two small matmuls per linear layer to every token.

The base reaches a server in a *full* publish (base leaves, then adapter leaves): the learner's first publish, and
the first after a server was replaced.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import equinox as eqx
import fsspec
import jax
import numpy as np
import safetensors.numpy
from haliax.state_dict import from_torch_compatible_state_dict, to_torch_compatible_state_dict
from jax.sharding import NamedSharding, PartitionSpec

from marin_rl.model.config import LoraConfig


def _levanter_lora():
    """`levanter.adaptor.lora`, imported on first use: it pulls in Levanter's DPO and data-store modules (~0.5 s per
    process), which a run without adapters never needs."""
    import levanter.adaptor.lora as lora

    return lora


def _is_lora_linear(x) -> bool:
    lora = sys.modules.get("levanter.adaptor.lora")  # nothing is a LoraLinear before that module is imported
    return lora is not None and isinstance(x, lora.LoraLinear)


def has_adapters(model: Any) -> bool:
    """Whether `model` has LoRA adapters."""
    return any(_is_lora_linear(x) for x in jax.tree_util.tree_leaves(model, is_leaf=_is_lora_linear))


def add_adapters(model: Any, config: LoraConfig) -> Any:
    """`model` with adapters on its target linear layers (B·A = 0: the same function as `model`). Raises ValueError
    when no layer matches `target_modules`."""
    adapted = _levanter_lora().loraize(model, config.levanter(), jax.random.PRNGKey(config.seed))
    if not has_adapters(adapted):
        raise ValueError(
            f"learner.lora.target_modules={config.target_modules!r} matches none of the policy's linear layers"
        )
    return adapted


def split(model: Any) -> tuple[Any, Any]:
    """(trainable, frozen): the adapters and the base of a model with adapters; (model, None) without."""
    if not has_adapters(model):
        return model, None
    base, adapters = _levanter_lora().partition_lora_params(model)
    return adapters, base


def join(trainable: Any, frozen: Any) -> Any:
    """The model `split` took apart."""
    return trainable if frozen is None else _levanter_lora().combine_lora_params(frozen, trainable)


def without_adapters(model: Any) -> Any:
    """The base model: every adapted layer's wrapped linear layer (the same arrays, nothing copied)."""
    return _levanter_lora().unwrap_lora_modules(model) if has_adapters(model) else model


def merged(model: Any) -> Any:
    """The adapted model as a plain one, each adapted weight W + (α/r)·B·A (computed on the devices)."""
    return _levanter_lora().merge_lora_modules(model) if has_adapters(model) else model


def array_leaves(tree: Any) -> list:
    """The arrays of `tree` in `eqx.filter(tree, eqx.is_array)` order."""
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def publish_leaves(model: Any, full: bool) -> list:
    """What a version carries for an adapted `model`: its adapters' arrays, preceded by the base's when `full`."""
    adapters, _ = split(model)
    leaves = array_leaves(adapters)
    return [*array_leaves(without_adapters(model)), *leaves] if full else leaves


def _placed_like(x, reference: jax.Array, sharding=None) -> jax.Array:
    """A copy of `x` on `reference`'s devices (with `sharding`, or replicated over its mesh), in its dtype.

    Always a copy: a transport's buffers are reused for later versions (shared-memory slots), and on a CPU device
    `device_put` may take a host buffer without copying it, while the base must outlive the publish it came in."""
    if sharding is None:
        sharding = reference.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.device_put(np.array(x, dtype=reference.dtype, copy=True), sharding)


class MissingBaseError(ValueError):
    """Adapters reached a server that has no base yet (it started after the last full publish)."""


class AdapterMerger:
    """Server side of adapter-only versions: holds the base and merges each version's adapters into it.

    `apply(template, leaves)` takes the arrays a publish carried: the plain model's (a full model without LoRA),
    base then adapters (a full publish), or adapters alone (which need a base from an earlier full publish). Returns
    the plain model to serve (the template's structure), or None when `leaves` are a plain model's (the caller
    serves them as usual)."""

    def __init__(self, config: LoraConfig):
        self.config = config
        self.base: Any = None
        """The base with empty adapter slots (`split`'s frozen part), from the last full publish."""
        self._adapters_template: Any = None

    def adapter_shapes(self, template: Any) -> list[tuple[int, ...]]:
        """Shapes of a version's adapter arrays for a plain model shaped like `template`."""
        self._ensure_template(template)
        return [tuple(x.shape) for x in array_leaves(self._adapters_template)]

    def _ensure_template(self, template: Any) -> None:
        if self._adapters_template is None:
            adapters, _ = split(add_adapters(template, self.config))
            self._adapters_template = adapters

    def apply(self, template: Any, leaves: list) -> Any:
        self._ensure_template(template)
        n_base = len(array_leaves(template))
        n_adapters = len(array_leaves(self._adapters_template))
        if len(leaves) == n_base:
            self.base = None  # a plain full model: no adapters from here on until the next full publish
            return None
        if len(leaves) == n_base + n_adapters:
            base_params, static = eqx.partition(template, eqx.is_array)
            treedef = jax.tree_util.tree_structure(base_params)
            base_leaves = [
                _placed_like(x, old, old.sharding)
                for x, old in zip(leaves[:n_base], array_leaves(template), strict=True)
            ]
            base_model = eqx.combine(jax.tree_util.tree_unflatten(treedef, base_leaves), static)
            _, self.base = split(add_adapters(base_model, self.config))
            leaves = leaves[n_base:]
        elif len(leaves) != n_adapters:
            raise ValueError(
                f"a weight update of {len(leaves)} arrays fits neither the policy ({n_base}) nor its LoRA adapters "
                f"({n_adapters}, learner.lora.rank={self.config.rank}): do the learner and the servers share one "
                "learner.lora?"
            )
        if self.base is None:
            raise MissingBaseError(
                "LoRA adapters arrived before any base weights: a server learns the base from a full publish (the "
                "learner's first, and the first after the server started)"
            )
        params, static = eqx.partition(self._adapters_template, eqx.is_array)
        old = jax.tree_util.tree_leaves(params)
        for i, (x, o) in enumerate(zip(leaves, old, strict=True)):
            if tuple(x.shape) != tuple(o.shape):
                raise ValueError(f"LoRA adapter array {i} has shape {tuple(x.shape)}, expected {tuple(o.shape)}")
        reference = array_leaves(self.base)[0]
        placed = [_placed_like(x, reference) for x in leaves]
        adapters = eqx.combine(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), placed), static)
        return merged(join(adapters, self.base))


def lora_bytes(model: Any) -> dict[str, int]:
    """Bytes of an adapted model's parameters: `base` (the wrapped layers and everything else) and `adapters`."""
    adapters, _ = split(model)
    return {
        "base": int(sum(x.nbytes for x in array_leaves(without_adapters(model)))),
        "adapters": int(sum(x.nbytes for x in array_leaves(adapters))) if has_adapters(model) else 0,
    }


PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def save_peft(model: Any, config: LoraConfig, path: str, base_path: str | None, tokenizer=None) -> str:
    """Write an adapted `model`'s adapters at local directory `path` in PEFT's format (`adapter_config.json`,
    `adapter_model.safetensors`), naming `base_path` as the base model; `peft.PeftModel.from_pretrained` loads them
    onto the base. Returns `path`."""
    _levanter_lora().save_peft_pretrained(model, config.levanter(), base_path, path, tokenizer)
    return path


def load_peft(model: Any, config: LoraConfig, path: str) -> Any:
    """`model` (adapted with `config`) with its adapters read from the PEFT directory `path` (local or fsspec URL).

    Raises ValueError naming the setting when the directory's rank or α differ from `config`'s, or when its arrays
    do not fit the model's adapters (another model, other target modules)."""
    fs, root = fsspec.core.url_to_fs(path)
    try:
        with fs.open(f"{root}/{PEFT_CONFIG}") as f:
            saved = json.load(f)
        with fs.open(f"{root}/{PEFT_WEIGHTS}", "rb") as f:
            tensors = safetensors.numpy.load(f.read())
    except FileNotFoundError as e:
        raise ValueError(f"learner.lora.init_from_peft: {path} is not a PEFT adapter directory ({e})") from None
    for key, ours in (("r", config.rank), ("lora_alpha", float(config.alpha))):
        if key in saved and float(saved[key]) != float(ours):
            raise ValueError(
                f"learner.lora.init_from_peft: {path} has {key}={saved[key]}, but learner.lora sets {ours} "
                f"(set learner.lora.{'rank' if key == 'r' else 'alpha'} to match)"
            )
    # The whole model's state dict (PEFT's key layout), its adapter entries replaced by the file's, read back.
    base_prefix = _levanter_lora().PEFT_BASE_MODEL_PREFIX
    prefix = base_prefix if all(k.startswith(base_prefix + ".") for k in tensors) else None
    state = {k: np.asarray(v) for k, v in to_torch_compatible_state_dict(model, prefix=prefix).items()}
    ours = {k for k in state if ".lora_A." in k or ".lora_B." in k}
    if ours != set(tensors):
        missing, extra = sorted(ours - set(tensors))[:3], sorted(set(tensors) - ours)[:3]
        raise ValueError(
            f"learner.lora.init_from_peft: {path} does not fit this policy's adapters (missing {missing}, "
            f"unexpected {extra}; check learner.lora.target_modules and the model)"
        )
    for k, v in tensors.items():
        if v.shape != state[k].shape:
            raise ValueError(f"learner.lora.init_from_peft: {path}: {k} has shape {v.shape}, expected {state[k].shape}")
        state[k] = v.astype(state[k].dtype)
    loaded = from_torch_compatible_state_dict(model, state, prefix=prefix)
    adapters, base = split(model)
    loaded_adapters, _ = split(loaded)
    params, static = eqx.partition(loaded_adapters, eqx.is_array)
    placed = jax.tree_util.tree_map(
        lambda x, o: jax.device_put(np.asarray(x, o.dtype), o.sharding), params, eqx.filter(adapters, eqx.is_array)
    )
    return join(eqx.combine(placed, static), base)
