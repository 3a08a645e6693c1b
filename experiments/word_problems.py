"""Write a small synthetic word-problem data set in the GSM8K format, for offline runs of the GSM8K recipe.

Each row is `{"question": ..., "answer": "<worked solution with <<a+b=c>> annotations>\\n#### N"}`, like GSM8K's
train.jsonl, so `marin_rl.envs.math:MathEnvironment` (format 'gsm8k') reads it as it reads the real data. Problems
take one or two arithmetic steps (sums, differences, products, change from a purchase) over small numbers. The
output is deterministic: the same seed and counts always write the same files.

    python experiments/word_problems.py [OUT_DIR] [--train 320] [--test 80] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = "Ava Ben Carla Dev Elena Farid Grace Hiro Iris Jamal Kira Leo Maya Nora Omar Priya Rosa Sam Tara Victor".split()
ITEMS = "apples pencils books marbles cookies stickers oranges tickets cards shells stamps balloons muffins".split()
PLACES = "store market bakery library fair".split()


def problem(rng: random.Random) -> dict[str, str]:
    """One question and its worked answer, ending '#### N'."""
    name, other = rng.sample(NAMES, 2)
    item, place = rng.choice(ITEMS), rng.choice(PLACES)
    a, b, c = rng.randint(3, 40), rng.randint(2, 20), rng.randint(2, 6)
    kind = rng.randrange(5)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        steps, n = [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."], a + b
    elif kind == 1:
        q = f"{name} had {a + b} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        steps, n = [f"{name} has {a + b} - {b} = <<{a + b}-{b}={a}>>{a} {item} left."], a
    elif kind == 2:
        q = f"{name} buys {c} bags of {item} at the {place}. Each bag holds {b} {item}. How many {item} is that?"
        steps, n = [f"{c} bags of {b} is {c} * {b} = <<{c}*{b}={c * b}>>{c * b} {item}."], c * b
    elif kind == 3:
        q = (
            f"{name} has {a} {item} and buys {c} packs of {b} more at the {place}. "
            f"How many {item} does {name} have in all?"
        )
        steps = [
            f"The packs hold {c} * {b} = <<{c}*{b}={c * b}>>{c * b} {item}.",
            f"In all {name} has {a} + {c * b} = <<{a}+{c * b}={a + c * b}>>{a + c * b} {item}.",
        ]
        n = a + c * b
    else:
        price = rng.randint(2, 9)
        paid = price * c + b
        q = (
            f"One of the {item} costs ${price} at the {place}. {name} buys {c} of them and pays with ${paid}. "
            f"How many dollars of change does {name} get?"
        )
        steps = [
            f"They cost {c} * {price} = <<{c}*{price}={c * price}>>{c * price} dollars.",
            f"The change is {paid} - {c * price} = <<{paid}-{c * price}={b}>>{b} dollars.",
        ]
        n = b
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {n}"}


def write(out: Path, train: int, test: int, seed: int) -> None:
    """Write `train.jsonl` and `test.jsonl` (disjoint questions) under `out`."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < train + test:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:train]), ("test", rows[train:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).with_name("data") / "word_problems"))
    parser.add_argument("--train", type=int, default=320)
    parser.add_argument("--test", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(Path(args.out), args.train, args.test, args.seed)
