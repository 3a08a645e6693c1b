"""Colocated benchmark: the quickstart on the local backend (one process, the engine sampling from the learner's own
weights) against today's default (Ray: a learner process, a server process, env actors), back to back.

Both runs start from the same warm-started policy, as a user comparing trainers would: the quickstart's supervised
warm start is run once (`--make-warm`, in a process of its own) and exported as a Hugging Face checkpoint; then each
run is `python -m marin_rl.run --config <its config> --model.init_from_hf <checkpoint> --learner.warm_start.steps 0`,
launched from this process, one after the other, with nothing else running.

Printed for each run:
- start-up: launch to the step-0 evaluation being logged (imports, Ray, building and compiling, the first eval);
- time to `--reward`: launch to the first held-out evaluation at or above it (evaluations every 50 steps included);
- steps 1 -> N: wall time of the loop, and seconds per step;
- per step: the learner's step, generation (seconds inside the engine's calls), the weight hand-over (publish and
  apply) and the driver's own host work (its loop sections other than waiting), so the fixed per-step costs show;
- the held-out reward at every evaluation (the same learning per step is part of the comparison);
- the weight hand-over per version: bytes copied and seconds;
- resident copies of the policy: the local run measures, at every hand-over, the distinct device buffers the
  learner's version and the engine's served policy take (one copy: the engine serves the learner's arrays); the
  default holds one in the learner's process and one in each server's.

The last line is `default_over_local=<value>`: the default run's whole wall time over the local run's (launch to
exit). Run: `python benchmarks/colocated.py [--steps N]`; `--smoke` runs a few steps of each in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")


def make_warm_checkpoint(config_path: str, path: str) -> None:
    """The config's supervised warm start, exported as a Hugging Face checkpoint at `path` (run in a subprocess)."""
    from marin_rl.api.train import TrainEngine
    from marin_rl.config import make_environment, parse_config

    cfg = parse_config(["--config", config_path])
    engine = TrainEngine(cfg, transport=False)
    examples = []
    for e in cfg.envs:
        examples.append(make_environment(e, engine.tokenizer, seed=cfg.orchestrator.seed))
    t = time.time()
    result = engine.warm_start(examples[0])
    engine.export_hf(path)
    print(
        f"warm start: {len(result['losses'])} steps in {time.time() - t:.1f} s, final loss {result['losses'][-1]:.4f}"
    )


def run(config_path: str, output_dir: str, overrides: list[str]) -> tuple[float, float, list[dict], dict]:
    """Launch one run; returns (launch time, exit time, its metrics rows, its summary)."""
    cmd = [sys.executable, "-m", "marin_rl.run", "--config", config_path, "--output_dir", output_dir, *overrides]
    log = tempfile.TemporaryFile("w+")
    launch = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    end = time.time()
    if proc.returncode != 0:
        log.seek(0)
        sys.stderr.write(log.read()[-8000:])
        raise SystemExit(f"{os.path.basename(config_path)} failed (exit {proc.returncode})")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(output_dir, "summary.json")) as f:
        summary = json.load(f)
    return launch, end, rows, summary


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else 0.0


def describe(name: str, launch: float, end: float, rows: list[dict], target: float) -> dict[str, float]:
    """Print one run's figures; returns them."""
    # `time/unix` is the row's Unix time, comparable with `launch`; `time/elapsed_s` counts from the run's own start
    by_step = {r["step"]: r for r in rows if "step" in r and "time/unix" in r}
    steps = sorted(s for s in by_step if s >= 1)
    startup = by_step[0]["time/unix"] - launch
    reach = next((s for s in sorted(by_step) if s >= 1 and by_step[s].get("eval/mean_reward", -1) >= target), None)
    to_target = None if reach is None else by_step[reach]["time/unix"] - launch
    loop_s = by_step[steps[-1]]["time/unix"] - by_step[0]["time/unix"]
    stepped = [by_step[s] for s in steps]
    engine = [r["servers/0/engine_s"] for r in stepped if "servers/0/engine_s" in r]
    generation = (engine[-1] - engine[0]) / max(len(engine) - 1, 1) if len(engine) > 1 else 0.0
    driver = {}
    for key in {k for r in stepped for k in r if k.startswith("profile/driver/")}:
        section = key.split("/")[-1].removesuffix("_s")
        if section != "wait":  # per step: a section that ran on some steps only (eval, export) is spread over all
            driver[section] = sum(r.get(key, 0.0) for r in stepped) / len(stepped)
    handover = _mean(stepped, "broadcast/seconds") + _mean(stepped, "broadcast/publish_s")
    out = {
        "startup_s": startup,
        "to_target_s": -1.0 if to_target is None else to_target,
        "loop_s": loop_s,
        "step_s": loop_s / len(steps),
        "whole_s": end - launch,
        "learner_s": _mean(stepped, "learner/step_time_s"),
        "generation_s": generation,
        "handover_s": handover,
        "handover_bytes": _mean(stepped, "broadcast/bytes"),
        "host_s": sum(driver.values()),
    }
    evals = ", ".join(
        f"{s}: {by_step[s]['eval/mean_reward']:.3f}" for s in sorted(by_step) if "eval/mean_reward" in by_step[s]
    )
    reached = "not reached" if to_target is None else f"{to_target:.1f} s (step {reach})"
    print(f"{name}:")
    print(f"  start-up (launch -> step-0 evaluation) {startup:.1f} s; launch -> held-out {target}: {reached}")
    per_step = out["step_s"] * 1000
    print(f"  steps 1 -> {steps[-1]}: {loop_s:.1f} s ({per_step:.0f} ms per step); whole run {end - launch:.1f} s")
    print(
        f"  per step: learner {out['learner_s'] * 1000:.0f} ms, generation (inside engine calls) "
        f"{generation * 1000:.0f} ms, hand-over {handover * 1000:.1f} ms, driver host work "
        f"{out['host_s'] * 1000:.1f} ms ({', '.join(f'{k} {v * 1000:.1f}' for k, v in sorted(driver.items()))})"
    )
    print(f"  held-out reward by step: {evals}")
    return out


def smoke_config(path: str, directory: str) -> str:
    """A tiny variant of the experiment at `path`: a short warm start, few held-out problems, small batches."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["envs"][0]["args"]["num_eval"] = 4
    raw["envs"][0].update(concurrency=4, eval_samples_per_problem=1)
    raw["learner"]["warm_start"]["steps"] = 5
    raw["batcher"]["total_token_budget"] = 4 * raw["batcher"]["max_seq_len"]
    out = os.path.join(directory, os.path.basename(path))
    with open(out, "w") as f:
        yaml.safe_dump(raw, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", default=os.path.join(EXPERIMENTS, "quickstart_local.yaml"))
    parser.add_argument("--default", default=os.path.join(EXPERIMENTS, "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the configs')")
    parser.add_argument("--reward", type=float, default=0.8, help="held-out reward for the time-to-reward figure")
    parser.add_argument("--output-dir", default=None, help="where the runs write (default: a temporary dir)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of each run in seconds (for the test suite)")
    parser.add_argument("--make-warm", nargs=2, metavar=("CONFIG", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_warm:
        make_warm_checkpoint(*args.make_warm)
        return
    out = args.output_dir or tempfile.mkdtemp(prefix="colocated-bench-")
    local_cfg, default_cfg = args.local, args.default
    steps = args.steps or (3 if args.smoke else None)
    if args.smoke:
        local_cfg, default_cfg = smoke_config(local_cfg, out), smoke_config(default_cfg, out)
    warm = os.path.join(out, "warm-hf")
    subprocess.run([sys.executable, __file__, "--make-warm", default_cfg, warm], cwd=ROOT, check=True)
    overrides = ["--model.init_from_hf", warm, "--learner.warm_start.steps", "0", "--tracking.wandb_mode", "disabled"]
    if steps is not None:
        overrides += ["--orchestrator.num_steps", str(steps)]
    if args.smoke:
        overrides += ["--orchestrator.eval_every", "0", "--checkpoint.every", "0"]
    figures = {}
    for name, cfg in (("local (one process, colocated engine)", local_cfg), ("default (Ray)", default_cfg)):
        launch, end, rows, summary = run(cfg, os.path.join(out, name.split()[0]), overrides)
        figures[name.split()[0]] = describe(name, launch, end, rows, args.reward)
        figures[name.split()[0]]["rows"] = rows
    local, default = figures["local"], figures["default"]
    resident = [r["broadcast/resident_policy_bytes"] for r in local["rows"] if "broadcast/resident_policy_bytes" in r]
    policy = max(r["broadcast/policy_bytes"] for r in local["rows"] if "broadcast/policy_bytes" in r)
    print(
        f"weight hand-over per version: local {local['handover_bytes']:.0f} bytes copied in "
        f"{local['handover_s'] * 1000:.2f} ms; default {default['handover_bytes'] / 1e6:.2f} MB in "
        f"{default['handover_s'] * 1000:.1f} ms"
    )
    print(
        f"resident copies of the policy: local {max(resident) / policy:.2f} (distinct device buffers of the learner's "
        f"version and the engine's, {max(resident) / 1e6:.2f} MB, at most over every hand-over); default 2 (one in "
        "the learner's process, one in "
        "the server's)"
    )
    print(f"default_over_local={default['whole_s'] / local['whole_s']:.2f}")


if __name__ == "__main__":
    main()
