"""Summarise stored rollouts: `python -m marin_rl.inspect_rollouts PATH [--samples N] [--tokenizer DIR]`.

PATH is a Parquet file or a directory (e.g. `runs/NAME/rollouts` or `gs://bucket/run/rollouts/addition`). Prints
per-environment counts, token and reward statistics (named rewards too), a few samples (stored text, or token ids
decoded with `--tokenizer`), and any file that could not be read. Exit status 1 if a file was unreadable.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np

from marin_rl.replay.store import StoredRollout, read_rollouts


def _stats(values: list[float]) -> str:
    v = np.asarray(values, dtype=np.float64)
    return f"mean {v.mean():.4f}  std {v.std():.4f}  min {v.min():.4f}  max {v.max():.4f}"


def summarize(path: str, samples: int = 3, tokenizer=None, out=None) -> int:
    """Print the summary of the rollouts at `path` to `out` (stdout); returns the number of unreadable files."""
    out = sys.stdout if out is None else out
    result = read_rollouts(path)
    by_env: dict[str, list[StoredRollout]] = defaultdict(list)
    for s in result.rollouts:
        by_env[s.rollout.environment].append(s)
    print(
        f"{path}: {len(result.files)} files, {len(result.rollouts)} rollouts, {len(result.errors)} unreadable", file=out
    )
    for env in sorted(by_env):
        rows = by_env[env]
        rs = [s.rollout for s in rows]
        print(f"\n== {env}: {len(rs)} rollouts in {len({s.group_id for s in rows})} groups", file=out)
        print(f"  tokens/rollout     {_stats([r.num_tokens for r in rs])}", file=out)
        print(f"  generated/rollout  {_stats([r.num_sampled_tokens for r in rs])}", file=out)
        print(f"  reward             {_stats([r.reward for r in rs])}", file=out)
        print(f"  advantage          {_stats([s.advantage for s in rows])}", file=out)
        named: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            for t in r.turns:
                for k, v in t.rewards.items():
                    named[k].append(v)
        for k in sorted(named):
            print(f"  rewards/{k:<10} {_stats(named[k])}", file=out)
        versions = [r.oldest_version for r in rs]
        print(f"  policy versions    {min(versions)}..{max(versions)}", file=out)
        print(f"  truncated          {np.mean([r.truncated for r in rs]):.3f}", file=out)
        for s in rows[-samples:] if samples > 0 else []:
            r = s.rollout
            print(f"  -- sample {r.rollout_uid[:8]} problem={r.problem_id} reward={r.reward:g}", file=out)
            for t in r.turns:
                text = tokenizer.decode(t.token_ids) if tokenizer is not None else t.message
                print(f"     [{t.role}{'*' if t.is_sampled else ''}] {text!r}", file=out)
    for file, reason in result.errors:
        print(f"\nUNREADABLE {file}: {reason}", file=out)
    return len(result.errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="Parquet file or directory (local or fsspec URL)")
    parser.add_argument("--samples", type=int, default=3, help="samples shown per environment")
    parser.add_argument("--tokenizer", default=None, help="decode token ids with this HF tokenizer directory")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

        tokenizer = load_tokenizer(TokenizerConfig(path=args.tokenizer))
    try:
        bad = summarize(args.path, args.samples, tokenizer)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
