"""The driver: starts every component from one config, runs the asynchronous loop, and shuts it all down.

The parts are Ray actors (`orchestrator.backend: ray`, `RayBackend`) or live in this process, the embedded engine
sampling from the learner's own weights (`orchestrator.backend: local`, `LocalBackend`); the driver uses either only
through `marin_rl.orchestrator.backends.Backend`, and the loop, checkpoints, resume, metrics and reports are the
same code for both.

Loop (one driver thread, everything else in actors or worker threads), `Orchestrator._loop`:
  env actors generate groups → replay buffers admit them (validation, advantages, staleness) → the batcher forms a
  batch (token budget, packing) when the learner is idle → learner step (a new version) → step hooks: weights
  published every `broadcast.sync_every` steps, HF export, checkpoint; then the next learner step starts while the
  servers apply the weights and evaluation runs (`StepHooks.split`; on checkpoint steps, in order instead).
New groups start as the staleness gate allows (`marin_rl.rollouts.staleness`, which states the bound).

Problem order: the driver owns a `ProblemIterator` per environment (in its `EnvPool`) and hands problem indices to
the env actors. Checkpoints (`checkpoint.*`): after a learner step, every `checkpoint.every` steps and when the run
ends or is interrupted, the driver writes its state (replay buffers, problem iterators, counters) and the learner
writes its arrays, the completion marker last (`marin_rl.orchestrator.checkpoints`, in the directories of
`marin_rl.checkpoint_dirs`). Rerunning the same command resumes from the latest complete checkpoint: the learner is
restored, the servers get its weights before any generation, problems whose groups were in flight are handed out
again first, the warm start is not rerun and metrics.jsonl is appended to. Each start, resume and rollback begins a
run segment that the rollout files record (`RolloutController.begin_segment`), so readers count the groups of the
surviving timeline only
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
import time
from typing import Any

from marin_rl.config import RunConfig
from marin_rl.logs import configure_logging
from marin_rl.orchestrator.backends import Backend, make_backend, run_as_follower
from marin_rl.orchestrator.checkpoints import RunCheckpoints
from marin_rl.orchestrator.hooks import StepHook, StepHooks
from marin_rl.orchestrator.preflight import preflight
from marin_rl.orchestrator.profile import LoopProfile
from marin_rl.orchestrator.restarts import RestartBudget
from marin_rl.orchestrator.run_metrics import RunMetrics
from marin_rl.orchestrator.run_state import RunState
from marin_rl.orchestrator.run_summary import report_summary, run_summary
from marin_rl.orchestrator.stop import StopRequest
from marin_rl.orchestrator.warm_start import WarmStart
from marin_rl.progress import StepProgress
from marin_rl.replay.batcher import FormedBatch
from marin_rl.rollouts.controller import RolloutController

logger = logging.getLogger("marin_rl")


class Orchestrator:
    """Owns the parts of one run and drives the loop (on Ray, or in this process: `orchestrator.backend`)."""

    def __init__(self, config: RunConfig, stop: StopRequest | None = None):
        config = config.resolve()  # validated and derived once (a resolved config is returned as it is)
        self.config = config
        self.stop = stop or StopRequest()
        self.profile = LoopProfile()  # where the loop's time goes (started again when the loop starts)
        self.parts: Backend = make_backend(
            config, section=lambda name: self.profile.section(name), count=lambda **c: self.profile.count(**c)
        )
        """The learner, the servers, the env workers and the rollout controller (Ray actors, or in this process)."""
        self.learner_budget = RestartBudget("learner processes", config.orchestrator.max_restarts_per_role)
        self.rolled_back_steps = 0
        """Learner steps lost to learner deaths (trained, then rolled back to a checkpoint and trained again)."""
        self._last_server_check = time.time()
        self.state = RunState()
        """Run progress (saved in checkpoints)."""
        self.checkpoints = RunCheckpoints(config, self.parts)
        self.warm_start = WarmStart(config, self.parts)
        self.metrics = RunMetrics(config)
        """The metric rows: tracker, clock, throughput, console line, progress display."""
        # Loop state.
        self.served_version = 0
        self.training: list[Any] | None = None  # the learner step in flight (one handle per process)
        self.formed: FormedBatch | None = None  # the batch it trains on
        self.hooks = self._make_hooks()

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
    def _loop(self) -> None:
        """From `state.step` to `orchestrator.num_steps` (or a stop request). One iteration: book a finished learner
        step (its hooks may checkpoint), form a batch if the learner is idle, start the groups the staleness gate
        allows, wait briefly, admit finished groups into the buffers. A checkpoint is taken in the first part, so a
        resumed run, which starts at the second, continues the same sequence of decisions."""
        section = self.profile.section
        while True:
            try:
                with section("book"):
                    if self.training is not None and self._training_done():
                        self._complete_step()
                if self.state.step >= self.config.orchestrator.num_steps or (
                    self.stop.requested and self.training is None
                ):
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
        formed = self.rollouts.try_make_batch(self.state.step)
        if formed is not None:
            self.formed = formed
            self.training = self.learner.call("train_step", formed.batch)

    def _launch_groups(self) -> None:
        self.rollouts.launch(self.served_version, batches_formed=self.state.step + (self.training is not None))

    def _admit_finished_groups(self) -> None:
        admitted = self.rollouts.admit_finished(self.state.step)
        self.metrics.count_generated(admitted.sampled_tokens)
        self.state.generated_tokens += admitted.sampled_tokens
        due = time.time() - self._last_server_check > self.config.inference.health_check_every_s
        if admitted.failures or due:  # a group failed or an env actor died: a server (or its node) may be gone
            self._last_server_check = time.time()
            self.parts.check_servers()

    def _complete_step(self) -> None:
        """Book a finished learner step: its metrics, the batch's and the buffers', the due hooks, the log line."""
        metrics = self.learner.get(self.training)[0]
        self.training = None
        self.state.step += 1
        step, last = self.state.step, self.state.step == self.config.orchestrator.num_steps
        metrics["learner/version"] = step
        metrics.update(self.formed.metrics)
        self.state.trained_tokens += int(self.formed.metrics["batches/trained_tokens"])
        self.formed = None
        metrics.update(self.rollouts.step_metrics(step))
        metrics.update(self.metrics.step_columns())
        server_stats = self.parts.servers.stats()
        metrics.update(server_stats)
        self.profile.observe_servers(server_stats)
        metrics["learner/restarts"] = float(self.learner_budget.spent)
        metrics["learner/rolled_back_steps"] = float(self.rolled_back_steps)
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
        self.metrics.log_step(step, metrics, last)

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
        started, before = time.time(), self.state.step
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
            path = self.checkpoints.latest()
            try:
                self.parts.start_learner(wait=True)
                if path is not None:
                    self._restore(path)
                else:
                    self.warm_start.run()  # a fresh learner has the initial weights; the warm start is deterministic
                    self._load_run_state(self.checkpoints.rewind_to_start())
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
        self.served_version = self.state.step
        self.rolled_back_steps += before - self.state.step
        if self.metrics.jsonl is not None:
            self.metrics.jsonl.mark_resume(self.state.step, path)
        self.metrics.restart_window()
        logger.warning(
            "learner replaced in %.1fs: rolled back from step %d to step %d (%s); %d group(s) in flight dropped",
            time.time() - started,
            before,
            self.state.step,
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
            self.state.last_eval = self.parts.evaluate()
            return self.state.last_eval

        def checkpoint(step: int) -> dict[str, float] | None:
            if self.checkpoints.last_saved_step == step:
                return None
            return {"checkpoint/seconds": self.save_checkpoint()}

        ck = cfg.checkpoint
        return StepHooks(
            [
                StepHook("publish", cfg.broadcast.sync_every, publish),
                StepHook("broadcast", cfg.broadcast.sync_every, broadcast, uses_learner=False),
                StepHook("eval", cfg.orchestrator.eval_every, evaluate, uses_learner=False),
                StepHook("export", cfg.model.export_every, self.checkpoints.export_hf),
                StepHook("checkpoint", ck.every, checkpoint, at_end=ck.save_on_exit, when_stopping=ck.save_on_exit),
            ]
        )

    def _begin_segment(self) -> None:
        """Groups accepted from now on belong to a new run segment, continuing the state just set up (fresh, or
        restored)."""
        segment = self.rollouts.begin_segment(self.state.step)
        logger.info("rollouts: run segment %d begins at step %d", segment, self.state.step)

    # ---- checkpoints (`RunCheckpoints`) ---------------------------------------------------------------
    def _run_state(self) -> dict[str, Any]:
        """The driver's state a checkpoint saves: the run's counters and the rollout controller's state."""
        return {**self.state.state_dict(), **self.rollouts.state_dict()}

    def save_checkpoint(self) -> float:
        """Checkpoint the run at the current step (no learner step may be in flight); returns seconds taken
        (`RunCheckpoints.save`). From then on a dead learner returns to this checkpoint."""
        seconds = self.checkpoints.save(self.state.step, self._run_state())
        self.warm_start.forget()
        return seconds

    def _restore(self, path: str) -> None:
        """Load the learner, buffers, problem order and counters from the complete checkpoint at `path`."""
        self._load_run_state(self.checkpoints.restore(path))

    def _load_run_state(self, state: dict[str, Any]) -> None:
        """Set the buffers, problem order and counters from a `_run_state()` (the learner is restored separately)."""
        self.rollouts.load_state_dict(state)
        self.state.load_state_dict(state)
        self.served_version = self.state.step

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start everything, train (resuming from the latest checkpoint when there is one), and shut down."""
        cfg = self.config
        self.metrics.started_at = time.time()
        resume_path = self.checkpoints.find_resume()
        self.metrics.data_report = preflight(cfg, resume_path)  # before anything starts: the run dir's config, the data
        self.parts.start_backend()
        # After ray.init: Ray's driver installs its own SIGTERM handler (which aborts); ours must replace it.
        previous = self.stop.install()
        try:
            self.parts.start()
            if resume_path is not None:
                self._restore(resume_path)
                logger.info("resumed from step %d at %s", self.state.step, resume_path)
            self._begin_segment()
            self.metrics.open(self.state.step if resume_path is not None else None, resume_path)
            if resume_path is None:
                warm = self.warm_start.run()
                self.state.warm_start = {"final_loss": warm["losses"][-1] if warm.get("losses") else None}
                bmetrics = self.parts.broadcast()
                self.state.eval_start = self.state.last_eval = self.parts.evaluate()
                self.checkpoints.initial_state = self._run_state()  # a learner that dies before a checkpoint returns
                self.metrics.log_start(self.state.eval_start, bmetrics)
            else:
                self.parts.broadcast()  # the restored weights reach every server before any new generation
            self.served_version = self.state.step
            self.metrics.restart_window()
            self.stop.armed = True
            self.profile = LoopProfile()
            with StepProgress("RL", cfg.orchestrator.num_steps, start=self.state.step) as self.metrics.progress:
                self._loop()
            self.metrics.progress = None
            self.stop.armed = False
            if self.stop.requested:
                if cfg.checkpoint.save_on_exit and self.checkpoints.last_saved_step != self.state.step:
                    self.save_checkpoint()  # stopped between learner steps: nothing saved this step yet
                raise KeyboardInterrupt("stopped on request after a checkpoint")
            summary = run_summary(
                cfg,
                self.state,
                self.parts,
                self.metrics,
                learner_restarts=self.learner_budget.spent,
                rolled_back_steps=self.rolled_back_steps,
                resumed_from=resume_path,
                profile=self.profile.summary(),
            )
            report_summary(self.metrics, summary)
            return summary
        finally:
            self.stop.armed = False
            self.metrics.finish()
            self.parts.shutdown()
            self.stop.uninstall(previous)


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end; returns the summary (also written to `output_dir/summary.json`).

    Resumes from the latest complete checkpoint under `config.checkpoint_dir` when there is one (and
    `checkpoint.resume`). From the main thread, SIGINT and SIGTERM stop the run cleanly: the learner step in
    progress finishes, a checkpoint is saved, every actor is stopped, and KeyboardInterrupt is raised.
    """
    configure_logging()
    config = config.resolve()
    followed = run_as_follower(config)  # a multi-host local run: processes other than 0 follow the driver
    if followed is not None:
        return followed
    return Orchestrator(config).run()
