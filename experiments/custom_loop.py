"""A complete GRPO loop on the addition task, written with marin_rl's Python API (`marin_rl.api`).

    python experiments/custom_loop.py [STEPS] [LOSS]      # default 200 grpo_clip; prints held-out reward before/after

The model, tokenizer, environment, replay rules and batch shape come from experiments/quickstart.yaml (learning rate
1e-3). One embedded inference server and the learner share this process; `prepare_batch` runs the rollout pipeline
a config-driven run uses: groups are generated in the background under the staleness bound while the learner
trains, scored by GRPO's estimator, groups whose rewards are all equal are dropped (`drop_zero_variance_groups`),
and the replay buffer's rollouts are packed into the run's rows. The loss is the token-level clipped objective
below, registered from this file.
`experiments/custom_loss.py` runs the same loop with a sequence-level objective.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax.numpy as jnp

from marin_rl.api import EngineConfig, InferenceEngine, TrainEngine, register_loss
from marin_rl.config import make_environment, parse_config


@register_loss("grpo_clip")
def grpo_clip(logprobs, entropy, batch, eps_low=0.2, eps_high=0.28):
    """Token-level clipped surrogate against the sampler's logprobs, averaged over all sampled tokens."""
    mask = batch.loss_mask.array
    log_ratio = jnp.where(mask, logprobs.array - batch.sampler_logprobs.array, 0.0)
    ratio, adv = jnp.exp(log_ratio), batch.advantages.array
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    loss = -jnp.sum(jnp.where(mask, objective, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    return loss, {"ratio/mean": jnp.sum(jnp.where(mask, ratio, 0.0)) / jnp.maximum(jnp.sum(mask), 1)}


def main(steps: int = 200, loss_fn: str = "grpo_clip", overrides: list[str] = (), log=print) -> dict:
    """Warm-start, then `steps` GRPO steps; returns held-out reward before and after, and the wall time."""
    start = time.time()
    args = ["--broadcast.transport", "in_process", "--learner.optimizer.learning_rate", "1e-3", *overrides]
    cfg = parse_config(["--config", "experiments/quickstart.yaml", *args])
    trainer = TrainEngine(cfg)
    env = make_environment(cfg.envs[0], trainer.tokenizer, seed=0)
    trainer.warm_start(env)
    replay = dataclasses.replace(cfg.replay, advantage_estimator="grpo", drop_zero_variance_groups=True)
    engine = EngineConfig(
        group_size=8, sampling=cfg.envs[0].sampling, max_staleness=1, replay=replay, batcher=cfg.batcher
    )
    with InferenceEngine.local(cfg, engine, tokenizer=trainer.tokenizer) as inference:
        trainer.update_weights(inference)  # the servers serve the warm-started policy as version 0

        def evaluate() -> float:  # mean reward of 4 samples per held-out problem
            return inference.evaluate(env, samples_per_problem=4)["reward"]

        reward_start = evaluate()
        log(f"held-out reward after the warm start: {reward_start:.3f}")
        for step in range(1, steps + 1):
            formed = inference.prepare_batch(env)  # the training problems in a run's seeded order
            metrics = trainer.train_batch(formed, loss_fn=loss_fn)
            trainer.update_weights(inference)
            if step % 10 == 0:
                reward = sum(item.rollout.reward for item, _ in formed.placed) / formed.num_rollouts
                log(f"step {step}: batch reward {reward:.3f}, loss {metrics['learner/loss']:+.4f}")
        reward_end = evaluate()
        stats = inference.stats()
    trainer.close()
    log(f"held-out reward {reward_start:.3f} -> {reward_end:.3f} ({reward_end - reward_start:+.3f})")
    return {"reward_start": reward_start, "reward_end": reward_end, "wall_time_s": time.time() - start, **stats}


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, sys.argv[2] if len(sys.argv) > 2 else "grpo_clip")
