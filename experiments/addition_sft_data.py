"""Write the addition prompt/completion records that `experiments/sft_addition.yaml` trains on.

    python experiments/addition_sft_data.py runs/data/addition_sft.jsonl [--max-operand 49] [--error-rate 0.4]

One JSON object per line, `{"prompt": "12+7=", "completion": "19"}`, for every training problem of the quickstart's
addition environment (`AdditionEnvironment` with the same `max_operand` and seed), so the environment's 200 held-out
problems stay unseen by both the supervised and the RL run. The completions come from the environment's demonstrator:
with `--error-rate` 0.4 (as in the quickstart's warm start) 40% of them slip by ±1 or ±10, which leaves the RL
phase something to fix; `--error-rate 0` writes exact sums. The output may be a local path or an fsspec URL.
"""

from __future__ import annotations

import argparse
import json

import fsspec

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.tokenizer import build_char_tokenizer


def records(max_operand: int, error_rate: float, num_eval: int, seed: int) -> list[dict[str, str]]:
    """Prompt/completion records of the environment's training problems, answered by its demonstrator."""
    env = AdditionEnvironment(
        build_char_tokenizer(), seed=seed, max_operand=max_operand, num_eval=num_eval, demo_error_rate=error_rate
    )
    return [{"prompt": p.prompt, "completion": env.reference_completion(p)} for p in env.train_problems()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="JSONL file to write (local path or fsspec URL)")
    parser.add_argument("--max-operand", type=int, default=49, help="largest operand (envs[].args.max_operand)")
    parser.add_argument("--error-rate", type=float, default=0.4, help="share of demonstrations that slip by ±1/±10")
    parser.add_argument("--num-eval", type=int, default=200, help="the environment's held-out problems (excluded)")
    parser.add_argument("--seed", type=int, default=0, help="the environment's seed (orchestrator.seed)")
    args = parser.parse_args()
    rows = records(args.max_operand, args.error_rate, args.num_eval, args.seed)
    fs, path = fsspec.core.url_to_fs(args.output)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fsspec.open(args.output, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    wrong = sum(r["completion"] != str(sum(map(int, r["prompt"].rstrip("=").split("+")))) for r in rows)
    print(f"wrote {len(rows)} records to {args.output} ({wrong} with a slipped answer)")


if __name__ == "__main__":
    main()
