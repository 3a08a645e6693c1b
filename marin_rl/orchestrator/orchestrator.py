"""The Ray driver: starts every component from one config, runs the asynchronous loop, and shuts it all down.

Loop (one driver thread, everything else in actors):
  env actors generate groups → replay buffers (validate, advantages, staleness) → batcher (token budget, packing)
  → learner step (new version) → weights published to the servers every `broadcast.sync_every` steps.
Staleness is bounded AReaL-style: with version v served and b batches formed, a new group starts only while the
rollouts in flight or buffered fill at most (v + η + 1 − b) batches; `replay.max_age` drops whatever still gets
too old.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from marin_rl.config import RunConfig
from marin_rl.orchestrator.actors import EnvActor, InferenceServerActor, LearnerActor, configure_logging
from marin_rl.orchestrator.report import plot_rewards, write_summary
from marin_rl.orchestrator.tracking import console_line, make_tracker
from marin_rl.replay.batcher import Batcher
from marin_rl.replay.buffer import ReplayBuffer
from marin_rl.tokenizer import load_tokenizer

logger = logging.getLogger("marin_rl")


class _EnvPool:
    """The env actors of one environment, their in-flight groups and the staleness gate's bookkeeping."""

    def __init__(self, config: RunConfig, index: int, servers: list[str], budget_share: float):
        self.config = config
        self.index = index
        self.env = config.envs[index]
        self.servers = servers
        self.actors = [self._spawn(r) for r in range(self.env.replicas)]
        self.inflight: dict[ray.ObjectRef, int] = {}  # ref -> replica
        self.budget_share = budget_share  # tokens per batch
        self.mean_rollout_tokens = float(self.env.sampling.max_tokens + 16)  # refined from data
        self.consumed_per_batch: float | None = None
        self.restarts = 0

    def _spawn(self, replica: int):
        return EnvActor.options(name=None, max_concurrency=max(4, self.env.concurrency * 2)).remote(
            self.config, self.index, replica, self.servers
        )

    def rollouts_per_batch(self) -> float:
        """Rollouts a batch takes from this env: measured once batches exist, else estimated from lengths."""
        if self.consumed_per_batch is not None:
            return max(1.0, self.consumed_per_batch)
        return max(1.0, self.budget_share / self.mean_rollout_tokens)

    def observe_batch(self, rollouts_used: int) -> None:
        if self.consumed_per_batch is None:
            self.consumed_per_batch = float(rollouts_used)
        else:
            self.consumed_per_batch = 0.8 * self.consumed_per_batch + 0.2 * rollouts_used

    def observe(self, group: dict) -> None:
        sizes = [sum(len(t["token_ids"]) for t in r["turns"]) for r in group["rollouts"]]
        if sizes:
            self.mean_rollout_tokens = 0.9 * self.mean_rollout_tokens + 0.1 * float(np.mean(sizes))

    def launch(self, served_version: int, batches_formed: int, buffered: int, max_staleness: int, starved: bool) -> int:
        """Start groups while the staleness gate allows; returns how many were started.

        AReaL's bound, stated on outstanding data: with version v served and b batches formed so far, the rollouts
        in flight or waiting in the buffer may fill at most (v + η + 1 − b) batches, so a rollout is trained at
        most η versions after the one that sampled it (when batches consume data in order). η = 0 is synchronous:
        nothing new starts while a batch is training on weights the servers do not have yet. Rollouts dropped on
        the way (stale, rejected) free their room. `starved` (the batcher waits for this env and nothing is in
        flight) lets one group start regardless, so a misestimated batch size cannot stall the run.
        """
        started = 0
        capacity = (served_version + max_staleness + 1 - batches_formed) * self.rollouts_per_batch()
        g = self.env.group_size
        for replica, actor in enumerate(self.actors):
            while sum(1 for r in self.inflight.values() if r == replica) < self.env.concurrency:
                outstanding = len(self.inflight) * g + buffered
                if outstanding + g > capacity and not (starved and not self.inflight):
                    return started
                self.inflight[actor.run_group.remote()] = replica
                started += 1
        return started

    def restart(self, replica: int) -> None:
        logger.error("env actor %s/%d died; restarting it", self.env.name, replica)
        self.restarts += 1
        self.actors[replica] = self._spawn(replica)


class Orchestrator:
    """Owns the actors of one run."""

    def __init__(self, config: RunConfig):
        config.validate()
        self.config = config
        self.output_dir = config.output_dir
        self.env_names = [e.name for e in config.envs]
        self._started_ray = False
        self.learner = None
        self.servers: list = []
        self.pools: dict[str, _EnvPool] = {}

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _start_ray(self) -> None:
        cfg = self.config.orchestrator
        if ray.is_initialized():
            return
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        else:
            ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
        self._started_ray = True

    def _start_components(self) -> None:
        cfg = self.config
        tokenizer = load_tokenizer(cfg.tokenizer)
        self.vocab_size = len(tokenizer)
        t = time.time()
        self.learner = LearnerActor.remote(cfg, self.vocab_size)
        self.servers = [
            InferenceServerActor.options(max_concurrency=4).remote(cfg, f"server-{i}")
            for i in range(cfg.inference.num_servers)
        ]
        addresses = ray.get([s.get_address.remote() for s in self.servers], timeout=cfg.inference.startup_timeout_s)
        logger.info("inference servers up at %s (%.1fs)", addresses, time.time() - t)
        budget = cfg.batcher.num_rows * cfg.batcher.max_seq_len
        fractions = cfg.env_fractions()
        self.pools = {e.name: _EnvPool(cfg, i, addresses, fractions[e.name] * budget) for i, e in enumerate(cfg.envs)}
        self.buffers = {
            n: ReplayBuffer(n, cfg.replay, self.vocab_size, rollout_dir=os.path.join(self.output_dir, "rollouts", n))
            for n in self.env_names
        }
        self.batcher = Batcher(cfg.batcher, self.buffers, fractions)
        logger.info("policy: %s parameters", f"{ray.get(self.learner.num_params.remote()):,}")

    def shutdown(self) -> None:
        """Stop servers and kill every actor; shut Ray down if this run started it."""
        for s in self.servers:
            try:
                ray.get(s.stop.remote(), timeout=10)
            except Exception:
                pass
        actors = [*self.servers, *([self.learner] if self.learner else [])]
        for pool in self.pools.values():
            actors.extend(pool.actors)
        for a in actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()

    # ---- steps --------------------------------------------------------------------------------------
    def _broadcast(self) -> dict[str, float]:
        t = time.time()
        update = self.learner.publish.remote()
        results = ray.get([s.apply_update.remote(update) for s in self.servers])
        return {
            "broadcast/seconds": time.time() - t,
            "broadcast/apply_s": max(r["apply_s"] for r in results),
            "broadcast/bytes": results[0]["bytes"],
        }

    def _evaluate(self) -> dict[str, float]:
        t = time.time()
        refs = [pool.actors[0].evaluate.remote() for pool in self.pools.values()]
        out: dict[str, float] = {}
        for r in ray.get(refs):
            out.update(r)
        out["eval/mean_reward"] = float(np.mean([out[f"eval/{n}/reward"] for n in self.env_names]))
        out["eval/seconds"] = time.time() - t
        return out

    def _warm_start(self) -> dict[str, Any]:
        if self.config.learner.warm_start.steps <= 0:
            return {}
        examples = []
        for pool in self.pools.values():
            examples += ray.get(pool.actors[0].warm_start_examples.remote())
        logger.info(
            "warm start: %d supervised steps on %d demonstrations", self.config.learner.warm_start.steps, len(examples)
        )
        result = ray.get(self.learner.warm_start.remote(examples))
        if result["losses"]:
            logger.info("warm start done in %.1fs, final loss %.4f", result["seconds"], result["losses"][-1])
        return result

    def run(self) -> dict[str, Any]:
        cfg = self.config
        start_time = time.time()
        self._start_ray()
        self._start_components()
        run_name = cfg.tracking.run_name or os.path.basename(os.path.normpath(self.output_dir))
        tracker, jsonl = make_tracker(self.output_dir, cfg.tracking.wandb_mode, cfg.tracking.wandb_project, run_name)
        tracker.log_hyperparameters(asdict(cfg))
        try:
            warm = self._warm_start()
            bmetrics = self._broadcast()
            eval_start = self._evaluate()
            logger.info("eval at start: %s", _fmt(eval_start))
            tracker.log({**eval_start, **bmetrics, "learner/version": 0}, step=0)
            summary = self._loop(tracker, eval_start)
            summary.update(
                {
                    "warm_start_steps": cfg.learner.warm_start.steps,
                    "warm_start_final_loss": warm["losses"][-1] if warm.get("losses") else None,
                    "wall_time_s": time.time() - start_time,
                    "output_dir": self.output_dir,
                }
            )
            tracker.log_summary(summary)
            write_summary(self.output_dir, summary)
            plot_rewards(self.output_dir, jsonl.history, self.env_names)
            logger.info(
                "done: eval reward %.3f -> %.3f (%+.3f) in %.0fs; see %s",
                summary["eval_reward_start"],
                summary["eval_reward_end"],
                summary["eval_reward_end"] - summary["eval_reward_start"],
                summary["wall_time_s"],
                self.output_dir,
            )
            return summary
        finally:
            tracker.finish()
            self.shutdown()

    def _loop(self, tracker, eval_start: dict[str, float]) -> dict[str, Any]:
        cfg = self.config
        ocfg = cfg.orchestrator
        step = 0
        served_version = 0  # the version the servers have (published before the loop starts)
        learner_ref = None
        waiting_since = time.time()
        last_log = time.time()
        gen_tokens_window = 0
        total_gen_tokens = 0
        total_trained_tokens = 0
        last_eval = eval_start
        pending_metrics: dict[str, float] = {}
        while step < ocfg.num_steps:
            batches_formed = step + (learner_ref is not None)
            for name, pool in self.pools.items():
                pool.launch(
                    served_version,
                    batches_formed,
                    len(self.buffers[name]),
                    ocfg.max_staleness,
                    starved=name in self.batcher.waiting_for,
                )
            refs = [r for p in self.pools.values() for r in p.inflight]
            if learner_ref is not None:
                refs.append(learner_ref)
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            # Collect every finished group, not just the one that ended the wait.
            for name, pool in self.pools.items():
                if not pool.inflight:
                    continue
                done, _ = ray.wait(list(pool.inflight), num_returns=len(pool.inflight), timeout=0)
                for ref in done:
                    replica = pool.inflight.pop(ref)
                    try:
                        group = ray.get(ref)
                    except RayActorError:
                        pool.restart(replica)
                        continue
                    pool.observe(group)
                    n_gen = sum(
                        len(t["token_ids"]) for r in group["rollouts"] for t in r["turns"] if t["logprobs"] is not None
                    )
                    gen_tokens_window += n_gen
                    total_gen_tokens += n_gen
                    self.buffers[name].add(group)

            if learner_ref is not None and learner_ref in ready:
                metrics = ray.get(learner_ref)
                learner_ref = None
                step += 1
                metrics["learner/version"] = step
                if step % cfg.broadcast.sync_every == 0 or step == ocfg.num_steps:
                    metrics.update(self._broadcast())
                    served_version = step
                if step % ocfg.eval_every == 0 or step == ocfg.num_steps:
                    last_eval = self._evaluate()
                    metrics.update(last_eval)
                every = cfg.model.export_every
                if (every > 0 and step % every == 0) or step == ocfg.num_steps:
                    exported = os.path.join(self.output_dir, "hf", f"step-{step}")
                    ray.get(self.learner.export_hf.remote(exported))
                    logger.info("exported the policy as a Hugging Face checkpoint to %s", exported)
                now = time.time()
                metrics["throughput/generated_tokens_per_s"] = gen_tokens_window / max(now - last_log, 1e-9)
                metrics["time/elapsed_s"] = now
                gen_tokens_window = 0
                last_log = now
                # `replays/...` metrics are published by the batcher with each batch (in `pending_metrics`).
                metrics.update(pending_metrics)
                total_trained_tokens += int(metrics.get("batches/trained_tokens", 0))
                tracker.log(metrics, step=step)
                if step % cfg.tracking.console_every == 0 or step == ocfg.num_steps:
                    logger.info(console_line(step, metrics, self.env_names))

            if learner_ref is None and step < ocfg.num_steps:
                made = self.batcher.try_make_batch(step)
                if made is not None:
                    batch, pending_metrics = made
                    for name, pool in self.pools.items():
                        pool.observe_batch(int(pending_metrics.get(f"batches/{name}/rollouts_used", 0)))
                    learner_ref = self.learner.train_step.remote(batch)
                    waiting_since = time.time()
                elif time.time() - waiting_since > ocfg.batch_timeout_s:
                    raise TimeoutError(
                        f"no batch for {ocfg.batch_timeout_s:.0f}s; waiting for tokens from "
                        + ", ".join(f"{n} ({k} tokens missing)" for n, k in self.batcher.waiting_for.items())
                    )

        summary = {
            "steps": step,
            "eval_reward_start": eval_start["eval/mean_reward"],
            "eval_reward_end": last_eval["eval/mean_reward"],
            "generated_tokens": total_gen_tokens,
            "trained_tokens": total_trained_tokens,
            "env_restarts": sum(p.restarts for p in self.pools.values()),
            "final_checkpoint": os.path.join(self.output_dir, "hf", f"step-{step}"),
        }
        for n in self.env_names:
            summary[f"eval_reward_start/{n}"] = eval_start[f"eval/{n}/reward"]
            summary[f"eval_reward_end/{n}"] = last_eval[f"eval/{n}/reward"]
            summary[f"eval_greedy_reward_start/{n}"] = eval_start[f"eval/{n}/greedy_reward"]
            summary[f"eval_greedy_reward_end/{n}"] = last_eval[f"eval/{n}/greedy_reward"]
        return summary


def _fmt(m: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in m.items() if isinstance(v, float))


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end; returns the summary (also written to `output_dir/summary.json`)."""
    configure_logging()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:  # SIGTERM unwinds like Ctrl-C, so actors and servers are always stopped
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return Orchestrator(config).run()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
