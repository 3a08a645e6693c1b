"""The Ray driver: starts every component from one config, runs the asynchronous loop, and shuts it all down.

Loop (one driver thread, everything else in actors):
  env actors generate groups → replay buffers (validate, advantages, staleness) → batcher (token budget, packing)
  → learner step (new version) → weights published to the servers every `broadcast.sync_every` steps.
Staleness is bounded AReaL-style: with version v served and b batches formed, a new group starts only while the
rollouts in flight or buffered fill at most (v + η + 1 − b) batches; `replay.max_age` drops whatever still gets
too old.

Problem order: the driver owns a `ProblemIterator` per environment and hands problem indices to the env actors.
Checkpoints (`checkpoint.*`): after a learner step, every `checkpoint.every` steps and when the run ends or is
interrupted, the driver writes its state (replay buffers, batcher, problem iterators, counters) and the learner
writes its arrays, the completion marker last (`marin_rl.learner.checkpoint`). Rerunning the same command resumes
from the latest complete checkpoint: the learner is restored, the servers get its weights before any generation,
problems whose groups were in flight are handed out again first, the warm start is not rerun and metrics.jsonl is
appended to. `orchestrator.deterministic` makes the loop a deterministic function of the config (see its docstring),
so a resumed run ends exactly where an uninterrupted one does.
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
from marin_rl.envs.iteration import ProblemIterator, ProblemTicket, stream_id
from marin_rl.learner.checkpoint import (
    RUN_STATE_FILE,
    begin_checkpoint,
    checkpoint_step,
    latest_checkpoint,
    prune_checkpoints,
    read_json,
    write_json,
)
from marin_rl.orchestrator.actors import EnvActor, InferenceServerActor, LearnerActor, configure_logging
from marin_rl.orchestrator.report import plot_rewards, write_summary
from marin_rl.orchestrator.tracking import console_line, make_tracker
from marin_rl.replay.batcher import Batcher
from marin_rl.replay.buffer import ReplayBuffer
from marin_rl.tokenizer import load_tokenizer

logger = logging.getLogger("marin_rl")


class _EnvPool:
    """The env actors of one environment, their in-flight groups, the problem order and the staleness gate's
    bookkeeping."""

    def __init__(self, config: RunConfig, index: int, servers: list[str], budget_share: float):
        self.config = config
        self.index = index
        self.env = config.envs[index]
        self.servers = servers
        self.deterministic = config.orchestrator.deterministic
        self.actors = [self._spawn(r) for r in range(self.env.replicas)]
        num_problems = ray.get(self.actors[0].num_problems.remote())
        self.iterator = ProblemIterator(num_problems, config.orchestrator.seed, stream_id(self.env.name))
        # ref -> (replica, ticket, actor), in hand-out order
        self.inflight: dict[ray.ObjectRef, tuple[int, ProblemTicket, Any]] = {}
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
        """Refine the rollouts-per-batch estimate from a batch."""
        if self.consumed_per_batch is None:
            self.consumed_per_batch = float(rollouts_used)
        else:
            self.consumed_per_batch = 0.8 * self.consumed_per_batch + 0.2 * rollouts_used

    def observe(self, group: dict) -> None:
        """Refine the mean rollout length from a group."""
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
        The decision depends only on this state, so calling it again without a change starts nothing.
        """
        started = 0
        capacity = (served_version + max_staleness + 1 - batches_formed) * self.rollouts_per_batch()
        g = self.env.group_size
        for replica, actor in enumerate(self.actors):
            while sum(1 for r, _, _ in self.inflight.values() if r == replica) < self.env.concurrency:
                outstanding = len(self.inflight) * g + buffered
                if outstanding + g > capacity and not (starved and not self.inflight):
                    return started
                ticket = self.iterator.next()
                seed = self.iterator.sample_seed(ticket) if self.deterministic else None
                self.inflight[actor.run_group.remote(ticket.index, seed)] = (replica, ticket, actor)
                started += 1
        return started

    def wait_refs(self) -> list[ray.ObjectRef]:
        """What the driver waits on: every in-flight group, or (deterministic) only the oldest one."""
        if self.deterministic:
            return [next(iter(self.inflight))] if self.inflight else []
        return list(self.inflight)

    def collect(self) -> list[tuple[ProblemTicket, dict]]:
        """Finished groups with their tickets. Deterministic: at most one, the oldest handed out, once it is done.

        A group whose actor died is not returned: its ticket is requeued (handed out again first) and the actor
        restarted.
        """
        if not self.inflight:
            return []
        refs = self.wait_refs()
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in refs if self.deterministic else done:
            if ref not in done:
                break
            replica, ticket, actor = self.inflight.pop(ref)
            try:
                group = ray.get(ref)
            except RayActorError:
                self.iterator.requeue(ticket)
                if self.actors[replica] is actor:
                    self.restart(replica)
                continue
            out.append((ticket, group))
        return out

    def restart(self, replica: int) -> None:
        """Replace a dead env actor."""
        logger.error("env actor %s/%d died; restarting it", self.env.name, replica)
        self.restarts += 1
        self.actors[replica] = self._spawn(replica)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state: the problem order (in-flight problems become redo), estimators and counters."""
        return {
            "iterator": self.iterator.state_dict(),
            "mean_rollout_tokens": self.mean_rollout_tokens,
            "consumed_per_batch": self.consumed_per_batch,
            "restarts": self.restarts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (before anything is launched)."""
        self.iterator.load_state_dict(state["iterator"])
        self.mean_rollout_tokens = float(state["mean_rollout_tokens"])
        c = state["consumed_per_batch"]
        self.consumed_per_batch = None if c is None else float(c)
        self.restarts = int(state["restarts"])


class StopRequest:
    """A request to stop at the next safe point (after the learner step in progress, with a checkpoint).

    `run` installs it as the SIGINT and SIGTERM handler: while the loop is running (`armed`), the first signal asks
    for a clean stop; a second one, or one before the loop runs, raises KeyboardInterrupt at once.
    """

    def __init__(self):
        self.requested = False
        self.armed = False

    def install(self) -> dict:
        """Handle SIGINT and SIGTERM (from the main thread only; elsewhere a no-op); returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def uninstall(self, previous: dict) -> None:
        """Put back the handlers `install` replaced."""
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)

    def __call__(self, signum, frame):
        if self.armed and not self.requested:
            self.requested = True
            logger.warning(
                "signal %d: stopping after the current learner step and saving a checkpoint (again to abort)", signum
            )
            return
        raise KeyboardInterrupt(f"signal {signum}")


class Orchestrator:
    """Owns the actors of one run."""

    def __init__(self, config: RunConfig, stop: StopRequest | None = None):
        config.validate()
        self.config = config
        self.output_dir = config.output_dir
        self.env_names = [e.name for e in config.envs]
        self.stop = stop or StopRequest()
        self._started_ray = False
        self.learner = None
        self.servers: list = []
        self.pools: dict[str, _EnvPool] = {}
        # Run progress (saved in checkpoints).
        self.step = 0
        self.total_gen_tokens = 0
        self.total_trained_tokens = 0
        self.eval_start: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.warm: dict[str, Any] = {}
        self.last_saved_step: int | None = None
        self.broadcast_transport: str | None = None  # what weights travel through ('auto' decides at the first)

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
        server_class, startup_timeout = InferenceServerActor, cfg.inference.startup_timeout_s
        if cfg.inference.backend == "vllm":
            from marin_rl.inference.vllm_server import VllmServerActor

            server_class = VllmServerActor
            startup_timeout = max(startup_timeout, cfg.inference.vllm.startup_timeout_s)
        self.servers = [
            server_class.options(max_concurrency=4).remote(cfg, f"server-{i}") for i in range(cfg.inference.num_servers)
        ]
        addresses = ray.get([s.get_address.remote() for s in self.servers], timeout=startup_timeout)
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
        if self.learner is not None:
            try:
                ray.get(self.learner.close.remote(), timeout=10)  # frees the broadcast's shared memory
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
        update = ray.get(self.learner.publish.remote())  # a handle: the arrays travel through the transport
        if update.transport != self.broadcast_transport:
            logger.info("weights travel through broadcast transport %r (%.1f MB per version)",
                        update.transport, update.num_bytes / 1e6)  # fmt: skip
            self.broadcast_transport = update.transport
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

    # ---- checkpoints --------------------------------------------------------------------------------
    def _find_resume(self) -> str | None:
        """The checkpoint to resume from (None: start fresh); refuses to mix runs when resuming is off."""
        ckpt = self.config.checkpoint
        latest = latest_checkpoint(self.config.checkpoint_dir)
        if latest is not None and not ckpt.resume:
            raise ValueError(
                f"checkpoint.resume is false but {self.config.checkpoint_dir} already holds checkpoints (latest: "
                f"{latest}); set checkpoint.resume: true to continue that run, or choose another output_dir or "
                "checkpoint.path"
            )
        return latest

    def _run_state(self) -> dict[str, Any]:
        return {
            "format": 1,
            "step": self.step,
            "warm_start": self.warm,
            "eval_start": self.eval_start,
            "last_eval": self.last_eval,
            "generated_tokens": self.total_gen_tokens,
            "trained_tokens": self.total_trained_tokens,
            "pools": {n: p.state_dict() for n, p in self.pools.items()},
            "buffers": {n: b.state_dict() for n, b in self.buffers.items()},
            "batcher": self.batcher.state_dict(),
        }

    def save_checkpoint(self) -> float:
        """Checkpoint the run at the current step (no learner step may be in flight); returns seconds taken.

        The driver's state is written first, then the learner's arrays, whose completion marker comes last; then
        incomplete leftovers and checkpoints beyond `checkpoint.keep` are deleted.
        """
        start = time.time()
        root = self.config.checkpoint_dir
        path = begin_checkpoint(root, self.step)
        write_json(path, RUN_STATE_FILE, self._run_state())
        ray.get(self.learner.save_checkpoint.remote(path, self.step))
        prune_checkpoints(root, self.config.checkpoint.keep)
        self.last_saved_step = self.step
        seconds = time.time() - start
        logger.info("checkpoint: saved step %d to %s in %.1fs", self.step, path, seconds)
        return seconds

    def _restore(self, path: str) -> None:
        """Load the learner, buffers, batcher, problem order and counters from the complete checkpoint at `path`."""
        state = read_json(path, RUN_STATE_FILE)
        step = int(state["step"])
        if step != checkpoint_step(path):
            raise ValueError(f"checkpoint {path}: run state is at step {step}, its marker at {checkpoint_step(path)}")
        if set(state["pools"]) != set(self.pools):
            raise ValueError(f"checkpoint {path} has envs {sorted(state['pools'])}, the config {sorted(self.pools)}")
        version = ray.get(self.learner.load_checkpoint.remote(path))
        if version != step:
            raise ValueError(f"checkpoint {path}: the learner is at version {version}, the run at step {step}")
        for n, pool in self.pools.items():
            pool.load_state_dict(state["pools"][n])
            self.buffers[n].load_state_dict(state["buffers"][n])
        self.batcher.load_state_dict(state["batcher"])
        self.step = self.last_saved_step = step
        self.warm = state["warm_start"]
        self.eval_start = state["eval_start"]
        self.last_eval = state["last_eval"]
        self.total_gen_tokens = int(state["generated_tokens"])
        self.total_trained_tokens = int(state["trained_tokens"])

    def run(self) -> dict[str, Any]:
        """Start everything, train (resuming from the latest checkpoint when there is one), and shut down."""
        cfg = self.config
        start_time = time.time()
        resume_path = self._find_resume()
        self._start_ray()
        # After ray.init: Ray's driver installs its own SIGTERM handler (which aborts); ours must replace it.
        previous = self.stop.install()
        tracker = None
        try:
            self._start_components()
            if resume_path is not None:
                self._restore(resume_path)
                logger.info("resumed from step %d at %s", self.step, resume_path)
            run_name = cfg.tracking.run_name or os.path.basename(os.path.normpath(self.output_dir))
            tracker, jsonl = make_tracker(
                self.output_dir,
                cfg.tracking.wandb_mode,
                cfg.tracking.wandb_project,
                run_name,
                resume_step=self.step if resume_path is not None else None,
                resume_path=resume_path,
            )
            tracker.log_hyperparameters(asdict(cfg))
            if resume_path is None:
                warm = self._warm_start()
                self.warm = {"final_loss": warm["losses"][-1] if warm.get("losses") else None}
                bmetrics = self._broadcast()
                self.eval_start = self.last_eval = self._evaluate()
                logger.info("eval at start: %s", _fmt(self.eval_start))
                tracker.log({**self.eval_start, **bmetrics, "learner/version": 0}, step=0)
            else:
                self._broadcast()  # the restored weights reach every server before any new generation
            self.stop.armed = True
            summary = self._loop(tracker)
            self.stop.armed = False
            if self.stop.requested:
                raise KeyboardInterrupt("stopped on request after a checkpoint")
            summary.update(
                {
                    "warm_start_steps": cfg.learner.warm_start.steps,
                    "warm_start_final_loss": self.warm.get("final_loss"),
                    "wall_time_s": time.time() - start_time,
                    "output_dir": self.output_dir,
                    "resumed_from": resume_path,
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
            self.stop.armed = False
            if tracker is not None:
                tracker.finish()
            self.shutdown()
            self.stop.uninstall(previous)

    def _complete_step(self, learner_ref, tracker, pending_metrics: dict[str, float], window: dict[str, float]) -> None:
        """Book a finished learner step: broadcast, evaluate, export, checkpoint, log."""
        cfg = self.config
        ocfg = cfg.orchestrator
        metrics = ray.get(learner_ref)
        self.step += 1
        step = self.step
        metrics["learner/version"] = step
        if step % cfg.broadcast.sync_every == 0 or step == ocfg.num_steps:
            metrics.update(self._broadcast())
            self.served_version = step
        if step % ocfg.eval_every == 0 or step == ocfg.num_steps:
            self.last_eval = self._evaluate()
            metrics.update(self.last_eval)
        every = cfg.model.export_every
        if (every > 0 and step % every == 0) or step == ocfg.num_steps:
            exported = os.path.join(self.output_dir, "hf", f"step-{step}")
            ray.get(self.learner.export_hf.remote(exported))
            logger.info("exported the policy as a Hugging Face checkpoint to %s", exported)
        now = time.time()
        metrics["throughput/generated_tokens_per_s"] = window["gen_tokens"] / max(now - window["since"], 1e-9)
        metrics["time/elapsed_s"] = now
        window["gen_tokens"] = 0
        window["since"] = now
        # `replays/...` metrics are published by the batcher with each batch (in `pending_metrics`).
        metrics.update(pending_metrics)
        self.total_trained_tokens += int(metrics.get("batches/trained_tokens", 0))
        ck = cfg.checkpoint
        periodic = ck.every > 0 and step % ck.every == 0
        final = ck.save_on_exit and (step == ocfg.num_steps or self.stop.requested)
        if periodic or final:
            metrics["checkpoint/seconds"] = self.save_checkpoint()
        tracker.log(metrics, step=step)
        if step % cfg.tracking.console_every == 0 or step == ocfg.num_steps:
            logger.info(console_line(step, metrics, self.env_names))

    def _loop(self, tracker) -> dict[str, Any]:
        """The driver loop, from `self.step` to `orchestrator.num_steps` (or a stop request).

        One iteration: book a finished learner step (it may checkpoint), form a batch if the learner is idle,
        start groups the staleness gate allows, wait briefly, collect finished groups. A checkpoint is taken in
        the first part, so a resumed run, which starts at the second, continues the same sequence of decisions.
        """
        cfg = self.config
        ocfg = cfg.orchestrator
        det = ocfg.deterministic
        self.served_version = self.step  # the servers have the learner's weights (published before the loop)
        learner_ref = None
        waiting_since = time.time()
        window = {"gen_tokens": 0, "since": time.time()}
        pending_metrics: dict[str, float] = {}
        while True:
            # 1. a finished learner step
            if learner_ref is not None and ray.wait([learner_ref], timeout=0)[0]:
                self._complete_step(learner_ref, tracker, pending_metrics, window)
                learner_ref = None
            if self.step >= ocfg.num_steps or (self.stop.requested and learner_ref is None):
                break
            # 2. a new batch while the learner is idle (deterministic: only once every group has arrived)
            if learner_ref is None and not self.stop.requested:
                if det and any(p.inflight for p in self.pools.values()):
                    made = None
                else:
                    made = self.batcher.try_make_batch(self.step)
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
            # 3. start groups
            batches_formed = self.step + (learner_ref is not None)
            if not self.stop.requested:
                for name, pool in self.pools.items():
                    pool.launch(
                        self.served_version,
                        batches_formed,
                        len(self.buffers[name]),
                        ocfg.max_staleness,
                        starved=name in self.batcher.waiting_for,
                    )
            # 4. wait for something to finish
            refs = [r for p in self.pools.values() for r in p.wait_refs()]
            if learner_ref is not None:
                refs.append(learner_ref)
            if refs:
                ray.wait(refs, num_returns=1, timeout=0.05)
            # 5. collect finished groups into the buffers
            for name, pool in self.pools.items():
                for ticket, group in pool.collect():
                    pool.observe(group)
                    n_gen = sum(
                        len(t["token_ids"]) for r in group["rollouts"] for t in r["turns"] if t["logprobs"] is not None
                    )
                    window["gen_tokens"] += n_gen
                    self.total_gen_tokens += n_gen
                    buffer = self.buffers[name]
                    before = buffer.rejected["future_version"]
                    buffer.add(group, max_version=self.step)
                    if buffer.rejected["future_version"] > before:
                        pool.iterator.requeue(ticket)  # sampled by weights this learner never had: sample again
                    else:
                        pool.iterator.done(ticket)

        if self.stop.requested and cfg.checkpoint.save_on_exit and self.last_saved_step != self.step:
            self.save_checkpoint()
        summary = {
            "steps": self.step,
            "eval_reward_start": self.eval_start["eval/mean_reward"],
            "eval_reward_end": self.last_eval["eval/mean_reward"],
            "generated_tokens": self.total_gen_tokens,
            "trained_tokens": self.total_trained_tokens,
            "env_restarts": sum(p.restarts for p in self.pools.values()),
            "broadcast_transport": self.broadcast_transport,
            "final_checkpoint": os.path.join(self.output_dir, "hf", f"step-{self.step}"),
        }
        for n in self.env_names:
            summary[f"eval_reward_start/{n}"] = self.eval_start[f"eval/{n}/reward"]
            summary[f"eval_reward_end/{n}"] = self.last_eval[f"eval/{n}/reward"]
            summary[f"eval_greedy_reward_start/{n}"] = self.eval_start[f"eval/{n}/greedy_reward"]
            summary[f"eval_greedy_reward_end/{n}"] = self.last_eval[f"eval/{n}/greedy_reward"]
        return summary


def _fmt(m: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in m.items() if isinstance(v, float))


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end; returns the summary (also written to `output_dir/summary.json`).

    Resumes from the latest complete checkpoint under `config.checkpoint_dir` when there is one (and
    `checkpoint.resume`). From the main thread, SIGINT and SIGTERM stop the run cleanly: the learner step in
    progress finishes, a checkpoint is saved, every actor is stopped, and KeyboardInterrupt is raised.
    """
    configure_logging()
    return Orchestrator(config).run()
