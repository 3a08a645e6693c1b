"""Summarise stored rollouts: `python -m marin_rl.inspect_rollouts PATH [--samples N] [--tokenizer DIR]
[--all-timelines]`.

PATH is a Parquet file or a directory (e.g. `runs/NAME/rollouts` or `gs://bucket/run/rollouts/addition`). Prints
per-environment counts, token and reward statistics (named rewards too), a few samples (stored text, or token ids
decoded with `--tokenizer`), and any file that could not be read. Exit status 1 if a file was unreadable.

Counts and statistics cover the run's surviving timeline: groups accepted by steps that a resume or a rollback
discarded (and that were sampled again) are counted apart as superseded. `--all-timelines` includes them and lists
each directory's run segments (`marin_rl.replay.store`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import numpy as np

from marin_rl.replay.store import ReadResult, StoredRollout, read_rollouts


def _stats(values: list[float]) -> str:
    v = np.asarray(values, dtype=np.float64)
    return f"mean {v.mean():.4f}  std {v.std():.4f}  min {v.min():.4f}  max {v.max():.4f}"


def _segments(result: ReadResult, out) -> None:
    """Each directory's run segments: where each started and how many of its groups survive."""
    groups: dict[tuple[str, int], set[str]] = defaultdict(set)
    superseded: dict[tuple[str, int], set[str]] = defaultdict(set)
    for s in result.rollouts:
        key = (os.path.dirname(s.file), s.segment)
        groups[key].add(s.group_id)
        if s.superseded:
            superseded[key].add(s.group_id)
    for directory, segments in sorted(result.timelines.items()):
        print(f"\ntimeline of {directory}:", file=out)
        for seg in segments:
            key = (directory, seg["segment"])
            origin = "from the start" if seg["parent"] is None else f"from segment {seg['parent']}"
            after = "" if seg["parent"] is None else f" (after {seg['start_group']} groups)"
            print(
                f"  segment {seg['segment']}: {origin} at step {seg['start_step']}{after}, {len(groups[key])} groups, "
                f"{len(superseded[key])} superseded",
                file=out,
            )


def summarize(path: str, samples: int = 3, tokenizer=None, out=None, all_timelines: bool = False) -> int:
    """Print the summary of the rollouts at `path` to `out` (stdout): of the surviving timeline, or with
    `all_timelines` of every segment (and the segments); returns the number of unreadable files."""
    out = sys.stdout if out is None else out
    result = read_rollouts(path, timeline="all" if all_timelines else "surviving")
    by_env: dict[str, list[StoredRollout]] = defaultdict(list)
    for s in result.rollouts:
        by_env[s.rollout.environment].append(s)
    counted = f"{len(result.rollouts)} rollouts"
    if result.superseded and all_timelines:
        counted += f" ({result.superseded} of them superseded by resumes or rollbacks)"
    elif result.superseded:
        counted += f" ({result.superseded} superseded by resumes or rollbacks; --all-timelines shows them)"
    print(f"{path}: {len(result.files)} files, {counted}, {len(result.errors)} unreadable", file=out)
    if all_timelines:
        _segments(result, out)
    for env in sorted(by_env):
        rows = by_env[env]
        rs = [s.rollout for s in rows]
        gone = len({s.group_id for s in rows if s.superseded})
        note = f" ({gone} groups superseded)" if gone else ""
        print(f"\n== {env}: {len(rs)} rollouts in {len({s.group_id for s in rows})} groups{note}", file=out)
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
    parser.add_argument(
        "--all-timelines",
        action="store_true",
        help="also count the groups that resumes and rollbacks superseded, and list the run segments",
    )
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

        tokenizer = load_tokenizer(TokenizerConfig(path=args.tokenizer))
    try:
        bad = summarize(args.path, args.samples, tokenizer, all_timelines=args.all_timelines)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
