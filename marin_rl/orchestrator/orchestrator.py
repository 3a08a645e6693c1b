"""The driver: starts every component from one config, runs the asynchronous loop, and shuts it all down.

The parts are Ray actors (`orchestrator.backend: ray`, `RunComponents`) or live in this process, the embedded engine
sampling from the learner's own weights (`orchestrator.backend: local`, `marin_rl.orchestrator.local`); the loop,
checkpoints, resume, metrics and reports are the same code for both.

Loop (one driver thread, everything else in actors or worker threads), `Orchestrator._loop`:
  env actors generate groups → replay buffers admit them (validation, advantages, staleness) → the batcher forms a
  batch (token budget, packing) when the learner is idle → learner step (a new version) → step hooks: weights
  published every `broadcast.sync_every` steps, HF export, checkpoint; then the next learner step starts while the
  servers apply the weights and evaluation runs (`StepHooks.split`; on checkpoint steps, in order instead).
New groups start as the staleness gate allows (`marin_rl.api.staleness`, which states the bound).

Problem order: the driver owns a `ProblemIterator` per environment (in its `EnvPool`) and hands problem indices to
the env actors. Checkpoints (`checkpoint.*`): after a learner step, every `checkpoint.every` steps and when the run
ends or is interrupted, the driver writes its state (replay buffers, problem iterators, counters) and the learner
writes its arrays, the completion marker last (`marin_rl.learner.checkpoint`). Rerunning the same command resumes
from the latest complete checkpoint: the learner is restored, the servers get its weights before any generation,
problems whose groups were in flight are handed out again first, the warm start is not rerun and metrics.jsonl is
appended to. Each start, resume and rollback begins a run segment that the rollout files record
(`RolloutController.begin_segment`), so readers count the groups of the surviving timeline only
(`marin_rl.replay.store`). `orchestrator.deterministic` makes the loop a deterministic function of the config (see
its docstring), so a resumed run ends exactly where an uninterrupted one does.

Before anything starts (`marin_rl.orchestrator.preflight`): a resume under a config that differs from the one the
run directory remembers (`output_dir/config.yaml`) in a field that changes results is refused, and the environments
that read data load it once in the driver, so a malformed row stops the run with one line before Ray starts.

Supervision: dead env actors and servers are replaced (`EnvPool`, `ServerPool`); a dead learner process is replaced
with its peers and the run rolled back in-run to the latest checkpoint (`Orchestrator._replace_learner`); each role
at most `orchestrator.max_restarts_per_role` times. A replacement waits at most `placement.wait_timeout_s` to be
placed (after a lost node, for a node with its resources to join), then its role's start-up limit
(`marin_rl.orchestrator.restarts.start_replacement`); past that the run fails naming the resource and the lost node.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from marin_rl.api.controller import RolloutController
from marin_rl.config import RunConfig, without_secrets
from marin_rl.learner.checkpoint import (
    RUN_STATE_FILE,
    checkpoint_step,
    latest_checkpoint,
    prune_checkpoints,
    read_json,
    write_json,
)
from marin_rl.logs import configure_logging
from marin_rl.orchestrator.hooks import StepHook, StepHooks
from marin_rl.orchestrator.preflight import RunRefused, preflight
from marin_rl.orchestrator.profile import LoopProfile, format_profile
from marin_rl.orchestrator.restarts import RestartBudget
from marin_rl.orchestrator.stop import StopRequest
from marin_rl.progress import StepProgress
from marin_rl.replay.batcher import FormedBatch
from marin_rl.report import headline_line, headline_summary, plot_rewards, write_summary
from marin_rl.tracking import console_line, make_tracker

if TYPE_CHECKING:
    from marin_rl.orchestrator.components import RunComponents
    from marin_rl.orchestrator.local import LocalComponents

logger = logging.getLogger("marin_rl")

RUN_STATE_FORMAT = 2
"""Version of the driver's checkpoint state (`run_state.json`); format 1 (before the replay buffers handled
too-long rollouts and the per-token names) is still read."""


def make_components(config: RunConfig, section, count) -> RunComponents | LocalComponents:
    """The run's parts for `orchestrator.backend`: Ray actors (`RunComponents`), or everything in this process, the
    engine sampling from the learner's own weights (`LocalComponents`: Ray is never imported)."""
    if config.orchestrator.backend == "local":
        from marin_rl.orchestrator.local import LocalComponents

        return LocalComponents(config, section=section, count=count)
    from marin_rl.orchestrator.components import RunComponents

    return RunComponents(config, section=section, count=count)


class Orchestrator:
    """Owns the parts of one run and drives the loop (on Ray, or in this process: `orchestrator.backend`)."""

    def __init__(self, config: RunConfig, stop: StopRequest | None = None):
        config.validate()
        config = config.resolved()
        self.config = config
        self.output_dir = config.output_dir
        self.env_names = [e.name for e in config.envs]
        self.stop = stop or StopRequest()
        self.profile = LoopProfile()  # where the loop's time goes (started again when the loop starts)
        self.parts = make_components(
            config, section=lambda name: self.profile.section(name), count=lambda **c: self.profile.count(**c)
        )
        """The learner, the servers, the env workers and the rollout controller (Ray actors, or in this process)."""
        self.learner_budget = RestartBudget("learner processes", config.orchestrator.max_restarts_per_role)
        self.rolled_back_steps = 0
        """Learner steps lost to learner deaths (trained, then rolled back to a checkpoint and trained again)."""
        self._last_server_check = time.time()
        self.started_at = time.time()
        """When this process started the run (`run()`): `time/elapsed_s` counts from here."""
        # Run progress (saved in checkpoints).
        self.step = 0
        self.total_gen_tokens = 0
        self.total_trained_tokens = 0
        self.eval_start: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.warm: dict[str, Any] = {}
        self.last_saved_step: int | None = None
        # Loop state.
        self.served_version = 0
        self.training: list[Any] | None = None  # the learner step in flight (one handle per process)
        self.formed: FormedBatch | None = None  # the batch it trains on
        self.window = {"gen_tokens": 0, "since": time.time()}
        self.hooks = self._make_hooks()
        self.jsonl = None  # the metrics log (a rollback marks it like a resume)
        self._initial_state: dict[str, Any] | None = None  # pools and buffers before step 1: a rollback target
        self._warm_examples: list | None = None  # the warm start's demonstrations, for that rollback
        self.data_report: dict[str, float] = {}
        """What the environments loaded and skipped (`data/<env>/<key>`), from the check before the start."""
        self.progress: StepProgress | None = None
        """The RL phase's progress display while the loop runs."""

    @property
    def learner(self):
        """The learner's processes (`LearnerGroup`, or the in-process `LocalLearner`)."""
        return self.parts.learner

    @property
    def pools(self):
        """The env workers of each environment (`EnvPool`s of Ray actors, or `LocalWorkerPool`s)."""
        return self.parts.pools

    @property
    def servers(self):
        """The inference servers."""
        return self.parts.servers

    @property
    def rollouts(self) -> RolloutController | None:
        """The rollout pipeline (gates, groups in flight, admission, batcher)."""
        return self.parts.rollouts

    # ---- the loop -----------------------------------------------------------------------------------
    def _loop(self, tracker) -> None:
        """From `self.step` to `orchestrator.num_steps` (or a stop request). One iteration: book a finished learner
        step (its hooks may checkpoint), form a batch if the learner is idle, start the groups the staleness gate
        allows, wait briefly, admit finished groups into the buffers. A checkpoint is taken in the first part, so a
        resumed run, which starts at the second, continues the same sequence of decisions."""
        section = self.profile.section
        while True:
            try:
                with section("book"):
                    if self.training is not None and self._training_done():
                        self._complete_step(tracker)
                if self.step >= self.config.orchestrator.num_steps or (self.stop.requested and self.training is None):
                    return
                if self.training is None and not self.stop.requested:
                    with section("batch"):
                        self._try_train()
                if not self.stop.requested:
                    with section("launch"):
                        self._launch_groups()
                with section("wait"):
                    self._wait_for_anything()
                self._admit_finished_groups()
            except self.parts.learner_errors as e:
                if not self.learner.owns(e):
                    raise
                with section("recover"):
                    self._replace_learner(e)

    def _training_done(self) -> bool:
        """Whether every learner process has finished the step in flight (raises a dead process's error)."""
        return self.learner.finished(self.training)

    def _wait_for_anything(self, timeout_s: float = 0.05) -> None:
        """Block until a group or the learner step finishes, at most `timeout_s`."""
        self.parts.wait(self.training, timeout_s)

    def _try_train(self) -> None:
        """Form a batch and start a learner step on it (deterministic runs: only once no group is in flight)."""
        formed = self.rollouts.try_make_batch(self.step)
        if formed is not None:
            self.formed = formed
            self.training = self.learner.call("train_step", formed.batch)

    def _launch_groups(self) -> None:
        self.rollouts.launch(self.served_version, batches_formed=self.step + (self.training is not None))

    def _admit_finished_groups(self) -> None:
        admitted = self.rollouts.admit_finished(self.step)
        self.window["gen_tokens"] += admitted.sampled_tokens
        self.total_gen_tokens += admitted.sampled_tokens
        due = time.time() - self._last_server_check > self.config.inference.health_check_every_s
        if admitted.failures or due:  # a group failed or an env actor died: a server (or its node) may be gone
            self._last_server_check = time.time()
            self.parts.check_servers()

    def _complete_step(self, tracker) -> None:
        """Book a finished learner step: its metrics, the batch's and the buffers', the due hooks, the log line."""
        metrics = self.learner.get(self.training)[0]
        self.training = None
        self.step += 1
        step, last = self.step, self.step == self.config.orchestrator.num_steps
        metrics["learner/version"] = step
        metrics.update(self.formed.metrics)
        self.total_trained_tokens += int(self.formed.metrics["batches/trained_tokens"])
        self.formed = None
        metrics.update(self.rollouts.step_metrics(step))
        now = time.time()
        metrics["throughput/generated_tokens_per_s"] = self.window["gen_tokens"] / max(now - self.window["since"], 1e-9)
        metrics.update(self._clock(now))
        server_stats = self.parts.servers.stats()
        metrics.update(server_stats)
        self.profile.observe_servers(server_stats)
        metrics["learner/restarts"] = float(self.learner_budget.spent)
        metrics["learner/rolled_back_steps"] = float(self.rolled_back_steps)
        self.window = {"gen_tokens": 0, "since": now}
        # Hooks that need the learner (publish, export, checkpoint) run first; then the next learner step starts,
        # and the servers' weight update and the evaluation run while it trains (`StepHooks.split`). The batch is
        # the one the loop would form next anyway: nothing is admitted in between, and new groups start after.
        before, during = self.hooks.split(step, last, stopping=self.stop.requested)
        metrics.update(self.hooks.run(step, last, section=self.profile.section, hooks=before))
        if during:
            if not last and not self.stop.requested:
                with self.profile.section("batch"):
                    self._try_train()
            metrics.update(self.hooks.run(step, last, section=self.profile.section, hooks=during))
        metrics.update(self.profile.end_step(metrics.get("learner/step_time_s", 0.0)))
        tracker.log(metrics, step=step)
        if step % self.config.tracking.console_every == 0 or last:
            logger.info(console_line(step, metrics, self.env_names))
        if self.progress is not None:
            rewards = ((n, metrics.get(f"batches/{n}/reward/mean")) for n in self.env_names)
            self.progress.advance_to(step, " | ".join(f"{n} reward {r:.3f}" for n, r in rewards if r is not None))

    def _clock(self, now: float) -> dict[str, float]:
        """`time/elapsed_s`: seconds since this process started the run (a resumed run counts from its restart);
        `time/unix`: the Unix time of the row."""
        return {"time/elapsed_s": now - self.started_at, "time/unix": now}

    # ---- a dead learner ----------------------------------------------------------------------------------
    def _replace_learner(self, error: BaseException) -> None:
        """A learner process died: replace the whole learner and roll the run back, in-run, to the latest complete
        checkpoint (to the start of the run when there is none: the same initial weights and warm start).

        The servers and env actors stay up. The groups in flight are cancelled, and the restored problem order hands
        their problems out again; the buffers, counters and problem order are the checkpoint's, so steps trained
        since it are trained again (counted in `learner/rolled_back_steps`), and nothing is skipped or sampled twice
        beyond that. The servers get the restored weights before anything new is generated, and the metrics log
        gets a resume marker, so each step has one effective row. `RestartLimitExceeded` once the learner was
        replaced `orchestrator.max_restarts_per_role` times.
        """
        started, before = time.time(), self.step
        while True:
            self.learner_budget.spend("a learner process")
            cause = str(error).splitlines()[0][:200] if str(error) else ""
            logger.error(
                "a learner process died (%s: %s) after step %d; replacing the learner and rolling back to "
                "the latest checkpoint",
                type(error).__name__,
                cause,
                before,
            )
            self.learner.kill()
            self.training = self.formed = None
            dropped = self.rollouts.drop_in_flight()
            restarts = {n: pool.restarts for n, pool in self.pools.items()}
            path = latest_checkpoint(self.config.checkpoint_dir)
            try:
                self.parts.start_learner(wait=True)
                if path is not None:
                    self._restore(path)
                else:
                    self._warm_start()  # a fresh learner has the initial weights; the warm start is deterministic
                    self._load_run_state(self._initial_state)
                    self.last_saved_step = None
                self.parts.broadcast()
            except self.parts.learner_errors as e:
                if not self.learner.owns(e):
                    raise
                error = e
                continue
            break
        for n, pool in self.pools.items():  # counted over the whole run, not only up to the checkpoint
            pool.restarts = max(pool.restarts, restarts[n])
        self._begin_segment()  # the groups the lost steps accepted stay on disk, superseded
        self.served_version = self.step
        self.rolled_back_steps += before - self.step
        if self.jsonl is not None:
            self.jsonl.mark_resume(self.step, path)
        self.window = {"gen_tokens": 0, "since": time.time()}
        logger.warning(
            "learner replaced in %.1fs: rolled back from step %d to step %d (%s); %d group(s) in flight dropped",
            time.time() - started,
            before,
            self.step,
            path or "the start of the run",
            dropped,
        )

    # ---- step hooks -----------------------------------------------------------------------------------
    def _make_hooks(self) -> StepHooks:
        cfg = self.config

        def publish(step: int) -> dict[str, float]:
            return self.parts.publish()

        def broadcast(step: int) -> dict[str, float]:
            out = self.parts.apply_published()
            self.served_version = step
            return out

        def evaluate(step: int) -> dict[str, float]:
            self.last_eval = self.parts.evaluate()
            return self.last_eval

        def export(step: int) -> None:
            path = os.path.join(self.output_dir, "hf", f"step-{step}")
            self.learner.run("export_hf", path)
            logger.info("exported the policy as a Hugging Face checkpoint to %s", path)

        def checkpoint(step: int) -> dict[str, float] | None:
            if self.last_saved_step == step:
                return None
            return {"checkpoint/seconds": self.save_checkpoint()}

        ck = cfg.checkpoint
        return StepHooks(
            [
                StepHook("publish", cfg.broadcast.sync_every, publish),
                StepHook("broadcast", cfg.broadcast.sync_every, broadcast, uses_learner=False),
                StepHook("eval", cfg.orchestrator.eval_every, evaluate, uses_learner=False),
                StepHook("export", cfg.model.export_every, export),
                StepHook("checkpoint", ck.every, checkpoint, at_end=ck.save_on_exit, when_stopping=ck.save_on_exit),
            ]
        )

    def _begin_segment(self) -> None:
        """Groups accepted from now on belong to a new run segment, continuing the state just set up (fresh, or
        restored)."""
        segment = self.rollouts.begin_segment(self.step)
        logger.info("rollouts: run segment %d begins at step %d", segment, self.step)

    def _warm_start(self) -> dict[str, Any]:
        """Supervised warm start on the environments' demonstrations (the same ones again when a learner that died
        before the first checkpoint is replaced: an environment may draw them at random)."""
        if self.config.learner.warm_start.steps <= 0:
            return {}
        if self._warm_examples is None:
            self._warm_examples = self.parts.warm_start_examples()
        examples = self._warm_examples
        logger.info(
            "warm start: %d supervised steps on %d demonstrations", self.config.learner.warm_start.steps, len(examples)
        )
        result = self.learner.run("warm_start", examples)
        if result["losses"] and not result.get("cached"):  # a reused one: the learner's line says so
            logger.info("warm start done in %.1fs, final loss %.4f", result["seconds"], result["losses"][-1])
        return result

    # ---- checkpoints --------------------------------------------------------------------------------
    def _find_resume(self) -> str | None:
        """The checkpoint to resume from (None: start fresh); refuses to mix runs when resuming is off."""
        ckpt = self.config.checkpoint
        latest = latest_checkpoint(self.config.checkpoint_dir)
        if latest is not None and not ckpt.resume:
            raise RunRefused(
                f"checkpoint.resume is false but {self.config.checkpoint_dir} already holds checkpoints (latest: "
                f"{latest}); set checkpoint.resume: true to continue that run, or choose another output_dir or "
                "checkpoint.path"
            )
        return latest

    def _run_state(self) -> dict[str, Any]:
        return {
            "format": RUN_STATE_FORMAT,
            "step": self.step,
            "warm_start": self.warm,
            "eval_start": self.eval_start,
            "last_eval": self.last_eval,
            "generated_tokens": self.total_gen_tokens,
            "trained_tokens": self.total_trained_tokens,
            **self.rollouts.state_dict(),
        }

    def save_checkpoint(self) -> float:
        """Checkpoint the run at the current step (no learner step may be in flight); returns seconds taken.

        The driver's state is written first, then the learner's arrays, whose completion marker comes last; then
        incomplete leftovers and checkpoints beyond `checkpoint.keep` are deleted.
        """
        start = time.time()
        root = self.config.checkpoint_dir
        path = self.parts.begin_checkpoint(root, self.step)
        self.rollouts.flush()  # every group the checkpoint counts as accepted is in the rollout files first
        write_json(path, RUN_STATE_FILE, self._run_state())
        self.learner.run("save_checkpoint", path, self.step)
        prune_checkpoints(root, self.config.checkpoint.keep)
        self.last_saved_step = self.step
        self._initial_state = self._warm_examples = None  # a dead learner now returns to this checkpoint
        seconds = time.time() - start
        logger.info("checkpoint: saved step %d to %s in %.1fs", self.step, path, seconds)
        return seconds

    def _restore(self, path: str) -> None:
        """Load the learner, buffers, problem order and counters from the complete checkpoint at `path`."""
        state = read_json(path, RUN_STATE_FILE)
        if int(state.get("format", 1)) > RUN_STATE_FORMAT:
            raise ValueError(f"checkpoint {path} was written by a newer marin_rl (run state format {state['format']})")
        step = int(state["step"])
        if step != checkpoint_step(path):
            raise ValueError(f"checkpoint {path}: run state is at step {step}, its marker at {checkpoint_step(path)}")
        if set(state["pools"]) != set(self.pools):  # checked before the learner loads anything
            raise ValueError(f"checkpoint {path} has envs {sorted(state['pools'])}, the config {sorted(self.pools)}")
        version = self.learner.run("load_checkpoint", path)
        if version != step:
            raise ValueError(f"checkpoint {path}: the learner is at version {version}, the run at step {step}")
        self._load_run_state(state)
        self.last_saved_step = step

    def _load_run_state(self, state: dict[str, Any]) -> None:
        """Set the buffers, problem order and counters from a `_run_state()` (the learner is restored separately)."""
        step = int(state["step"])
        self.rollouts.load_state_dict(state)
        self.step = self.served_version = step
        self.warm = state["warm_start"]
        self.eval_start = state["eval_start"]
        self.last_eval = state["last_eval"]
        self.total_gen_tokens = int(state["generated_tokens"])
        self.total_trained_tokens = int(state["trained_tokens"])

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start everything, train (resuming from the latest checkpoint when there is one), and shut down."""
        cfg = self.config
        start_time = self.started_at = time.time()
        resume_path = self._find_resume()
        self.data_report = preflight(cfg, resume_path)  # before anything starts: the run dir's config, the data
        self.parts.start_backend()
        # After ray.init: Ray's driver installs its own SIGTERM handler (which aborts); ours must replace it.
        previous = self.stop.install()
        tracker = None
        try:
            self.parts.start()
            if resume_path is not None:
                self._restore(resume_path)
                logger.info("resumed from step %d at %s", self.step, resume_path)
            self._begin_segment()
            run_name = cfg.tracking.run_name or os.path.basename(os.path.normpath(self.output_dir))
            tracker, self.jsonl = make_tracker(
                self.output_dir,
                cfg.tracking.wandb_mode,
                cfg.tracking.wandb_project,
                run_name,
                resume_step=self.step if resume_path is not None else None,
                resume_path=resume_path,
            )
            tracker.log_hyperparameters(_redacted(asdict(cfg)))
            if resume_path is None:
                warm = self._warm_start()
                self.warm = {"final_loss": warm["losses"][-1] if warm.get("losses") else None}
                bmetrics = self.parts.broadcast()
                self.eval_start = self.last_eval = self.parts.evaluate()
                self._initial_state = self._run_state()  # where a learner that dies before a checkpoint returns
                logger.info("eval at start: %s", _fmt(self.eval_start))
                start = {
                    **self.eval_start,
                    **bmetrics,
                    **self.data_report,
                    "learner/version": 0,
                    **self._clock(time.time()),
                }
                tracker.log(start, step=0)
            else:
                self.parts.broadcast()  # the restored weights reach every server before any new generation
            self.served_version = self.step
            self.window = {"gen_tokens": 0, "since": time.time()}
            self.stop.armed = True
            self.profile = LoopProfile()
            with StepProgress("RL", cfg.orchestrator.num_steps, start=self.step) as self.progress:
                self._loop(tracker)
            self.progress = None
            self.stop.armed = False
            if self.stop.requested:
                if cfg.checkpoint.save_on_exit and self.last_saved_step != self.step:
                    self.save_checkpoint()  # stopped between learner steps: nothing saved this step yet
                raise KeyboardInterrupt("stopped on request after a checkpoint")
            summary = self._summary(start_time, resume_path)
            logger.info(format_profile(summary["profile"]))
            tracker.log_summary(summary)
            write_summary(self.output_dir, summary)
            plot_rewards(self.output_dir, self.jsonl.history, self.env_names)
            logger.info(headline_line(summary))
            return summary
        finally:
            self.stop.armed = False
            if tracker is not None:
                tracker.finish()
            self.parts.shutdown()
            self.stop.uninstall(previous)

    def _summary(self, start_time: float, resume_path: str | None) -> dict[str, Any]:
        summary = {
            "steps": self.step,
            **headline_summary(self.eval_start, self.last_eval, self.env_names),
            "generated_tokens": self.total_gen_tokens,
            "trained_tokens": self.total_trained_tokens,
            **self.rollouts.totals(),
            "server_restarts": self.parts.servers.restarts,
            "learner_restarts": self.learner_budget.spent,
            "rolled_back_steps": self.rolled_back_steps,
            "server_addresses": list(self.parts.servers.addresses),
            "broadcast_transport": self.parts.broadcast_transport,
            "final_checkpoint": os.path.join(self.output_dir, "hf", f"step-{self.step}"),
            "warm_start_steps": self.config.learner.warm_start.steps,
            "warm_start_final_loss": self.warm.get("final_loss"),
            "wall_time_s": time.time() - start_time,
            "output_dir": self.output_dir,
            "resumed_from": resume_path,
            "profile": self.profile.summary(),
            **self.data_report,
        }
        return summary


def _redacted(hparams: dict[str, Any]) -> dict[str, Any]:
    """The config as logged: secrets replaced."""
    return without_secrets(hparams, "<redacted>")


def _fmt(m: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in m.items() if isinstance(v, float))


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end; returns the summary (also written to `output_dir/summary.json`).

    Resumes from the latest complete checkpoint under `config.checkpoint_dir` when there is one (and
    `checkpoint.resume`). From the main thread, SIGINT and SIGTERM stop the run cleanly: the learner step in
    progress finishes, a checkpoint is saved, every actor is stopped, and KeyboardInterrupt is raised.
    """
    configure_logging()
    config.validate()
    config = config.resolved()
    if config.orchestrator.backend == "local" and config.learner.hosts > 1:  # one process per host (SPMD)
        import jax

        from marin_rl.orchestrator import spmd

        spmd.join(config)
        if jax.process_index() != 0:
            return spmd.follow(config)
    return Orchestrator(config).run()
