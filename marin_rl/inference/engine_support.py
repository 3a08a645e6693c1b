"""Which embedded engine decodes which model: each engine's check on a built model, and the same check on an
architecture alone (shapes only, nothing allocated), so that a run is refused before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the check builds models, so it imports JAX when it runs, not when this module is imported
    from levanter.models.lm_model import LmConfig, LmHeadModel


def check_paged_supported(model: LmHeadModel) -> None:
    """Raise ValueError unless Levanter's paged engine can decode `model`: its model class must keep a paged KV
    cache (`initial_cache`; in this Levanter line Llama and Qwen3, not Qwen2, Mistral, OLMo, Gemma or the MoE
    families)."""
    if not hasattr(model, "initial_cache"):
        raise ValueError(
            f"the paged engine decodes models with a paged KV cache (Llama, Qwen3), not {type(model).__name__}; use "
            "inference.levanter.engine: dense (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) or inference.backend: "
            "vllm"
        )


def engine_refusal(architecture: LmConfig, engine: str) -> str | None:
    """Why the embedded `engine` ('dense' or 'paged') cannot decode models of `architecture` (one line), or None.
    The model is built abstractly (`equinox.filter_eval_shape`: shapes only), so this costs well under a second."""
    import equinox as eqx
    import haliax as hax
    import jax

    from marin_rl.inference.dense_engine import check_supported

    check = check_supported if engine == "dense" else check_paged_supported

    def build_and_check() -> None:
        check(architecture.build(hax.Axis("vocab", 128), key=jax.random.PRNGKey(0)))

    try:
        eqx.filter_eval_shape(build_and_check)
    except ValueError as e:
        return str(e)
    return None
