"""The quickstart as a Marin pipeline: demonstration data -> supervised fine-tuning -> RL, under Marin's executor.

    pip install -e ".[marin]"
    python experiments/marin_pipeline.py --prefix runs/marin            # about 10 minutes on 2 CPU cores
    python experiments/marin_pipeline.py --prefix runs/marin            # again: every step is skipped

Three `ExecutorStep`s, each writing under `<prefix>/<name>-<hash>/` (the hash covers the `versioned(...)` fields and
the inputs): `addition_sft_data` writes the demonstrations (`experiments/addition_sft_data.py`'s records: the addition
environment's training problems, 40% answered with a slip), `sft_addition` trains the quickstart model on them
(`experiments/sft_addition.yaml`) and exports `hf/step-N`, and `rl_addition` starts the quickstart's RL from that
export (`experiments/quickstart.yaml` without its own warm start) and reports the held-out reward before and after.
A step that finished is skipped when the pipeline runs again; one that failed or was interrupted runs again in the
same directory and resumes from its latest checkpoint. The prefix may be a gs:// URL.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import fsspec

try:
    from marin.execution import (
        ExecutorMainConfig,
        ExecutorStep,
        executor_main,
        output_path_of,
        this_output_path,
        versioned,
    )
except ModuleNotFoundError as e:  # the `marin` extra is not installed (a module missing inside Marin is re-raised)
    if e.name not in ("marin", "marin.execution"):
        raise
    raise SystemExit(
        "marin_rl: experiments/marin_pipeline.py needs marin-core (Marin's executor), the `marin` extra: "
        "pip install -e '.[marin]' in the marin_rl checkout"
    ) from None

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.marin import run_step
from marin_rl.tokenizer import build_char_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS = "addition_sft.jsonl"


@dataclass(frozen=True)
class AdditionDataConfig:
    output_path: str
    max_operand: int = 49
    error_rate: float = 0.4
    num_eval: int = 200
    seed: int = 0


def write_addition_records(config: AdditionDataConfig) -> dict:
    """Prompt/completion records of the addition environment's training problems, answered by its demonstrator (the
    held-out problems are left out), as `output_path/addition_sft.jsonl`."""
    env = AdditionEnvironment(
        build_char_tokenizer(),
        seed=config.seed,
        max_operand=config.max_operand,
        num_eval=config.num_eval,
        demo_error_rate=config.error_rate,
    )
    rows = [{"prompt": p.prompt, "completion": env.reference_completion(p)} for p in env.train_problems()]
    path = os.path.join(config.output_path, RECORDS)
    fs, plain = fsspec.core.url_to_fs(config.output_path)
    fs.makedirs(plain, exist_ok=True)
    with fsspec.open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return {"records": len(rows), "path": path}


def build_steps(
    sft_steps: int = 400, rl_steps: int = 300, eval_every: int = 50, num_cpus: int | None = None, smoke: bool = False
) -> list[ExecutorStep]:
    """The three steps. `smoke` shrinks the RL run (fewer sequences, held-out problems and checkpoints) for tests."""
    data = ExecutorStep(
        name="addition_sft_data",
        fn=write_addition_records,
        config=AdditionDataConfig(output_path=this_output_path(), error_rate=versioned(0.4)),
    )
    sft = run_step(
        "sft_addition",
        os.path.join(HERE, "sft_addition.yaml"),
        {
            "learner.sft.train_files": [output_path_of(data, RECORDS)],
            "learner.sft.steps": versioned(sft_steps),
            "learner.sft.eval_every": max(1, sft_steps // 4),
        },
    )
    rl_overrides = {
        "model.init_from_hf": output_path_of(sft, f"hf/step-{sft_steps}"),
        "learner.warm_start.steps": versioned(0),
        "orchestrator.num_steps": versioned(rl_steps),
        "orchestrator.eval_every": eval_every,
        "checkpoint.every": max(1, rl_steps // 3),
    }
    if num_cpus is not None:
        rl_overrides["orchestrator.num_cpus"] = num_cpus
    if smoke:
        rl_overrides["envs.0.num_eval_problems"] = 50
        rl_overrides["envs.0.eval_samples_per_problem"] = 2
    rl = run_step("rl_addition", os.path.join(HERE, "quickstart.yaml"), rl_overrides)
    return [data, sft, rl]


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default="runs/marin", help="where the steps write (local path or gs://)")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs for the RL step's local Ray cluster")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    ns = parser.parse_args(args)
    steps = build_steps(ns.sft_steps, ns.rl_steps, ns.eval_every, ns.num_cpus)
    executor_main(ExecutorMainConfig(prefix=ns.prefix, dry_run=ns.dry_run), steps=steps)
    if not ns.dry_run:
        fs, plain = fsspec.core.url_to_fs(ns.prefix)
        for found in sorted(fs.glob(f"{plain}/rl_addition-*/summary.json")):
            with fs.open(found) as f:
                s = json.load(f)
            print(
                f"{os.path.dirname(found)}: held-out reward {s['eval_reward_start']:.3f} -> {s['eval_reward_end']:.3f} "
                f"(gain {s['eval_reward_end'] - s['eval_reward_start']:+.3f}) after {s['steps']} RL steps"
            )


if __name__ == "__main__":
    main()
