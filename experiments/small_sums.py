"""Write the small-sums data set of `experiments/smollm2_math.yaml`: every 'a + b' with operands 1..10, as JSONL
rows `{"question": "7 + 3", "answer": "10"}` (`MathEnvironment`'s format 'jsonl'; the math verifier reads the answer
from free text).

The held-out split is made of *unordered* pairs: when '3 + 7' is held out, so is '7 + 3', so a held-out gain cannot
come from having trained on the same sum written the other way round. The output is deterministic.

    python experiments/small_sums.py [OUT_DIR] [--max-operand 10] [--held-out-pairs 15] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def split(max_operand: int, held_out_pairs: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): the sums of unordered operand pairs in 1..max_operand, `held_out_pairs` of them
    (both orders) held out after a shuffle seeded with `seed`."""
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(a, max_operand + 1)]
    if not 0 < held_out_pairs < len(pairs):
        raise ValueError(f"--held-out-pairs must be in (0, {len(pairs)}) for --max-operand {max_operand}")
    random.Random(seed).shuffle(pairs)

    def rows(chosen):
        out = [{"question": f"{a} + {b}", "answer": str(a + b)} for a, b in chosen]
        out += [{"question": f"{b} + {a}", "answer": str(a + b)} for a, b in chosen if a != b]
        return sorted(out, key=lambda row: [int(x) for x in row["question"].split(" + ")])

    return rows(pairs[held_out_pairs:]), rows(pairs[:held_out_pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=str(Path(__file__).parent / "data" / "small_sums"))
    parser.add_argument("--max-operand", type=int, default=10)
    parser.add_argument("--held-out-pairs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, test = split(args.max_operand, args.held_out_pairs, args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(train)} training and {len(test)} held-out sums to {out}")


if __name__ == "__main__":
    main()
