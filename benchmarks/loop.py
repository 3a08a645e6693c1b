"""Loop benchmark: the RL loop's trained tokens/s against the limit its two compute parts allow, and time to reward.

Three measurements in one run, all on the same machine:

- loop:    the experiment (default `experiments/quickstart.yaml`) run end to end by `python -m marin_rl.run`, as a
           user runs it. Its loop time is the driver's wall time from the first step to the last, evaluation
           included (the run's `profile`); its throughput is trained tokens over that time.
- learner: the learner alone (`TrainEngine`, in this process) training as many steps as the loop on batches of the
           same shape, packed from the run's own persisted rollouts (a step's cost depends on the batch's shape,
           not its contents).
- server:  the inference server alone (one embedded server in a process of its own, as in the loop, with the run's
           final weights) generating the run's accepted groups again (same problems, group size and sampling) at
           the run's concurrency, through the same HTTP client and environment code (`InferenceEngine.remote`).

Each part alone runs once to compile, then timed. `limit = max(learner_s, server_s)`: a loop that overlapped its
two parts perfectly, each as fast as alone, would take that long. `loop_over_limit = limit / loop_s` (1.0 is
perfect; the target is 0.8). On a machine where both parts share the same cores, running both at full speed at once
is not possible; the sum of the two is printed too, as the time a loop that did not overlap at all would take.

Also printed: the time from the first step to the first evaluation reaching `--reward` (held-out mean reward;
the evaluation's own time before it included), from the run's metrics.

The last line is `loop_over_limit=<value>`. Run: `python benchmarks/loop.py [--config X] [--steps N]`;
`--smoke` runs a tiny loop (a few steps, a short warm start) so the test suite checks that it works.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ROLES = {"ray::EnvActor": "env actors", "ray::ServerActor": "servers", "ray::LearnerActor": "learner"}


def _role(proc, driver_pid: int) -> str | None:
    """Which part of the run a process is (None: not the run's)."""
    if proc.pid == driver_pid:
        return "driver"
    cmd = " ".join(proc.info.get("cmdline") or [])
    for prefix, role in ROLES.items():
        if cmd.startswith(prefix):
            return role
    if cmd.startswith("ray::") or "raylet" in cmd or "gcs_server" in cmd or "ray/dashboard" in cmd:
        return "ray (raylet, gcs, agents, idle workers)"
    return None


def run_loop(config_path: str, output_dir: str, overrides: list[str]) -> tuple[dict, list]:
    """Run the experiment in a subprocess, as `python -m marin_rl.run` does; returns its summary and CPU samples
    (time, {pid: (role, cpu seconds)}) of the run's processes every half second (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    cmd = [sys.executable, "-m", "marin_rl.run", "--config", config_path, "--output_dir", output_dir, *overrides]
    print("loop: " + " ".join(cmd[1:]), flush=True)
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    samples = []
    while proc.poll() is None:
        if psutil is not None:
            now, cpu = time.time(), {}
            for p in psutil.process_iter(["cmdline", "cpu_times"]):
                role = _role(p, proc.pid)
                if role is not None and p.info["cpu_times"] is not None:
                    cpu[p.pid] = (role, p.info["cpu_times"].user + p.info["cpu_times"].system)
            samples.append((now, cpu))
        time.sleep(0.5)
    if proc.returncode != 0:
        log.seek(0)
        sys.stderr.write(log.read()[-8000:])
        raise SystemExit(f"the loop run failed (exit {proc.returncode})")
    with open(os.path.join(output_dir, "summary.json")) as f:
        return json.load(f), samples


def cpu_by_role(samples: list, start: float, end: float) -> dict[str, float]:
    """CPU seconds each role's processes used between `start` and `end` (the samples nearest to them)."""
    if not samples:
        return {}
    first = min(samples, key=lambda s: abs(s[0] - start))[1]
    last = min(samples, key=lambda s: abs(s[0] - end))[1]
    out: dict[str, float] = collections.defaultdict(float)
    for pid, (role, cpu) in last.items():
        out[role] += cpu - first.get(pid, (role, 0.0))[1]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def loop_window(rows: list[dict]) -> tuple[float, float]:
    """Wall-clock start (the step-0 row) and end (the last step's row) of the loop, in Unix time (the clock of
    `run_loop`'s CPU samples); in seconds since the run began for rows written without `time/unix`."""
    clock = "time/unix" if all("time/unix" in r for r in rows if "time/elapsed_s" in r) else "time/elapsed_s"
    times = [(r.get("step", 0), r[clock]) for r in rows if "time/elapsed_s" in r]
    return min(times)[1], max(times)[1]


def time_to_reward(rows: list[dict], target: float) -> tuple[float | None, int | None]:
    """Seconds from the loop's start to the first step whose evaluation reaches `target`, and that step (a step's
    row holds its evaluation and the time the step was booked)."""
    steps = sorted((r for r in rows if "time/elapsed_s" in r and r.get("step", 0) >= 1), key=lambda r: r["step"])
    if not steps:
        return None, None
    start = next((r["time/elapsed_s"] for r in rows if r.get("step") == 0 and "time/elapsed_s" in r), None)
    if start is None:  # older runs do not time step 0: one typical step before step 1
        first = steps[:3]
        start = first[0]["time/elapsed_s"] - (first[-1]["time/elapsed_s"] - first[0]["time/elapsed_s"]) / 2
    for r in steps:
        if r.get("eval/mean_reward", -1) >= target:
            return r["time/elapsed_s"] - start, r["step"]
    return None, None


def learner_alone(cfg, stored, steps: int, warmup: int = 2) -> float:
    """Seconds for `steps` learner steps on batches packed from `stored` rollouts (after `warmup` untimed ones)."""
    from marin_rl.api import TrainEngine
    from marin_rl.replay.packing import Sequence, pack

    seqs = [Sequence.from_rollout(s.rollout, s.advantage) for s in stored]
    rows, row_len = cfg.batcher.num_rows, cfg.batcher.max_seq_len
    batches, start = [], 0
    while len(batches) < min(steps, 16):  # a cycle of distinct batches, reused
        batch, placed = pack(seqs[start:] or seqs, rows, row_len)
        batches.append(batch)
        start = start + len(placed) if start + len(placed) < len(seqs) else 0
    trainer = TrainEngine(cfg)
    try:
        for i in range(warmup):
            trainer.train_batch(batches[i % len(batches)])
        t = time.perf_counter()
        for i in range(steps):
            trainer.train_batch(batches[i % len(batches)])
        return time.perf_counter() - t
    finally:
        trainer.close()


def serve(config_path: str, output_dir: str, checkpoint: str) -> None:
    """Child process of `server_alone`: one embedded server with the weights of `checkpoint` ('-': initial ones);
    prints its address, then serves until its stdin closes."""
    from marin_rl.api import InferenceEngine, TrainEngine
    from marin_rl.config import parse_config

    cfg = parse_config(["--config", config_path, "--output_dir", output_dir, "--broadcast.transport", "in_process"])
    trainer = TrainEngine(cfg)
    with InferenceEngine.local(cfg, tokenizer=trainer.tokenizer, num_servers=1) as inference:
        if checkpoint != "-":
            trainer.load(checkpoint)
        trainer.update_weights(inference)
        trainer.close()
        del trainer
        print(f"address={inference.addresses[0]}", flush=True)
        sys.stdin.read()


def server_alone(config_path: str, cfg, checkpoint: str | None, stored, concurrency: int) -> tuple[float, int]:
    """Seconds to generate the accepted groups of `stored` again on one embedded server (in a process of its own,
    as in the loop) with the run's final weights, at most `concurrency` groups at once through the same client and
    environment code (after an untimed warm-up); and the tokens sampled."""
    from marin_rl.api import InferenceEngine
    from marin_rl.config import make_environment
    from marin_rl.tokenizer import load_tokenizer

    env_cfg = cfg.envs[0]
    env = make_environment(env_cfg, load_tokenizer(cfg.tokenizer), seed=0)
    by_id = {p.id: p for p in env.train_problems()}
    groups: dict[str, str] = {}
    for s in stored:
        groups.setdefault(s.group_id, s.rollout.problem_id)
    problems = [by_id[pid] for pid in groups.values()]
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", config_path, cfg.output_dir, checkpoint or "-"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = None
        for line in server.stdout:
            if line.startswith("address="):
                address = line.strip().split("=", 1)[1]
                break
        if address is None:
            raise SystemExit(f"the benchmark's server did not start (exit {server.wait()})")
        with InferenceEngine.remote([address]) as inference:
            warm = problems[: min(len(problems), concurrency)]
            inference.rollout_batch(warm, env, group_size=env_cfg.group_size, max_concurrent=concurrency)
            t = time.perf_counter()
            out = inference.rollout_batch(problems, env, group_size=env_cfg.group_size, max_concurrent=concurrency)
            seconds = time.perf_counter() - t
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    tokens = sum(r.num_sampled_tokens for g in out for r in g.rollouts)
    return seconds, tokens


def smoke_config(path: str) -> str:
    """A tiny variant of the experiment at `path`: a short warm start, few held-out problems."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["envs"][0]["args"]["num_eval"] = 4
    raw["envs"][0].update(concurrency=4, eval_samples_per_problem=1)
    raw["learner"]["warm_start"]["steps"] = 5
    raw["batcher"]["total_token_budget"] = 4 * raw["batcher"]["max_seq_len"]
    out = os.path.join(tempfile.mkdtemp(prefix="loop-bench-"), "smoke.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(raw, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "experiments", "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    parser.add_argument("--reward", type=float, default=0.8, help="held-out reward for the time-to-reward figure")
    parser.add_argument("--output-dir", default=None, help="where the loop run writes (default: a temporary dir)")
    parser.add_argument("--from-run", default=None, help="a finished run's output dir: measure only the parts alone")
    parser.add_argument("--smoke", action="store_true", help="a tiny loop in seconds (for the test suite)")
    parser.add_argument("--serve", nargs=3, metavar=("CONFIG", "OUTPUT_DIR", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        serve(*args.serve)
        return

    if args.output_dir and not args.from_run and os.path.exists(os.path.join(args.output_dir, "checkpoints")):
        # the run would resume there (at its last step, doing nothing) and the loop would measure nothing
        raise SystemExit(f"--output-dir {args.output_dir} already holds a run; give a new directory (or --from-run)")
    config_path = smoke_config(args.config) if args.smoke else args.config
    steps = args.steps or (2 if args.smoke else None)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="loop-bench-run-")
    overrides = ["--tracking.wandb_mode", "disabled"]
    if steps is not None:
        overrides += ["--orchestrator.num_steps", str(steps)]
    if args.smoke:
        overrides += ["--orchestrator.eval_every", "0", "--checkpoint.every", "0"]
    samples: list = []
    if args.from_run:  # measure the parts against a finished run of the same config
        output_dir = args.from_run
        with open(os.path.join(output_dir, "summary.json")) as f:
            summary = json.load(f)
    else:
        summary, samples = run_loop(config_path, output_dir, overrides)
    rows = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    if samples:
        start, end = loop_window(rows)
        cpu = cpu_by_role(samples, start, end)
        if cpu:
            cores = os.cpu_count() or 1
            print(
                f"CPU seconds over the loop ({end - start:.1f} s x {cores} cores = {(end - start) * cores:.0f} "
                "core-seconds):"
            )
            for role, seconds in cpu.items():
                print(f"  {role:<40} {seconds:8.1f} s  ({seconds / ((end - start) * cores):6.1%} of the cores)")

    from marin_rl.checkpoint_dirs import latest_checkpoint
    from marin_rl.config import parse_config
    from marin_rl.replay.store import read_rollouts

    cfg = parse_config(["--config", config_path, "--output_dir", output_dir, "--broadcast.transport", "in_process"])
    profile = summary["profile"]
    loop_s, n_steps, trained = profile["wall_s"], summary["steps"], summary["trained_tokens"]
    stored = read_rollouts(os.path.join(output_dir, "rollouts", cfg.envs[0].name)).rollouts
    stored.sort(key=lambda s: s.accepted_at)
    print(
        f"loop: {n_steps} steps, {trained:,} trained tokens in {loop_s:.1f} s ({trained / loop_s:,.0f} tok/s; "
        f"{len(stored):,} accepted rollouts)",
        flush=True,
    )

    learner_s = learner_alone(cfg, stored, n_steps)
    print(f"learner alone: {n_steps} steps in {learner_s:.1f} s ({trained / learner_s:,.0f} trained tok/s)", flush=True)
    concurrency = cfg.envs[0].concurrency * cfg.envs[0].replicas
    server_s, sampled = server_alone(config_path, cfg, latest_checkpoint(cfg.checkpoint_dir), stored, concurrency)
    n_groups = len({s.group_id for s in stored})
    print(
        f"server alone: {n_groups:,} groups ({sampled:,} sampled tokens) in {server_s:.1f} s "
        f"({sampled / server_s:,.0f} tok/s) at {concurrency} groups at once",
        flush=True,
    )

    limit = max(learner_s, server_s)
    reached_s, reached_step = time_to_reward(rows, args.reward)
    rows = collections.OrderedDict(
        [
            ("loop (s)", loop_s),
            ("learner alone (s)", learner_s),
            ("server alone (s)", server_s),
            ("limit = slower part (s)", limit),
            ("no overlap = sum (s)", learner_s + server_s),
            ("loop tok/s", trained / loop_s),
            ("limit tok/s", trained / limit),
            ("loop over no-overlap", (learner_s + server_s) / loop_s),
            ("eval reward start", summary["eval_reward_start"]),
            ("eval reward end", summary["eval_reward_end"]),
        ]
    )
    for k, v in rows.items():
        print(f"  {k:<26} {v:10.3f}")
    if reached_s is None:
        print(f"  time to held-out reward {args.reward}: not reached")
    else:
        print(f"  time to held-out reward {args.reward}: {reached_s:.1f} s (evaluation at step {reached_step})")
    print(f"loop_over_limit={limit / loop_s:.3f}")


if __name__ == "__main__":
    main()
