"""LoRA on the learner: adding the adapters, what a version publishes to the servers, the model servers run, and
the KL reference that the adapters' base provides (`marin_rl.model.lora` does the tree surgery)."""

from __future__ import annotations

import logging
from typing import Any

from marin_rl.learner.sharding import Sharding
from marin_rl.model import lora
from marin_rl.model.config import LoraConfig

logger = logging.getLogger(__name__)


def add_adapters(model: Any, config: LoraConfig, sharding: Sharding) -> Any:
    """`model` with its linear layers wrapped in LoRA adapters (the model as it is becomes the frozen base), loaded
    from `config.init_from_peft` when set, laid out by `sharding`'s parameter mapping."""
    with sharding.context():
        adapted = lora.add_adapters(model, config)
        if config.init_from_peft:
            adapted = lora.load_peft(adapted, config, config.init_from_peft)
            logger.info("learner: LoRA adapters from %s", config.init_from_peft)
        adapted = sharding.params(adapted)
    sizes = lora.lora_bytes(adapted)
    logger.info(
        "learner: LoRA rank %d adapters, %s parameters (%.2f%% of the base's %s)",
        config.rank,
        f"{sizes['adapters'] // 4:,}",
        100 * sizes["adapters"] / max(sizes["base"], 1),
        f"{sizes['base'] // 4:,}",
    )
    return adapted


class Publisher:
    """What a version carries to the servers: the policy, or with LoRA the adapters' arrays, preceded by the base's
    on the first publish and after `request_full` (a server was replaced and knows no base)."""

    def __init__(self):
        self.full = True
        """Whether the next publish of an adapted policy carries its base."""

    def request_full(self) -> None:
        """The next `params` of an adapted policy carries the base as well as the adapters."""
        self.full = True

    def params(self, model: Any) -> Any:
        """The published form of `model` (`lora.publish_leaves` with LoRA, else the model itself)."""
        if not lora.has_adapters(model):
            return model
        full, self.full = self.full, False
        return lora.publish_leaves(model, full)


def served_model(model: Any, sharding: Sharding) -> Any:
    """The policy as servers run it: with LoRA, the adapters merged into the base (on the devices)."""
    with sharding.context():
        return lora.merged(model)


def kl_reference(model: Any, reference_model: Any, kl_coef: float) -> Any:
    """The KL penalty's reference: the frozen copy, or with LoRA the base itself (adapters off; no copy)."""
    if kl_coef > 0 and lora.has_adapters(model):
        return lora.without_adapters(model)
    return reference_model
