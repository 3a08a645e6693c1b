"""A reproducible random `PackedBatch` for the tests that train in subprocesses on several devices or processes
(imported by their worker scripts, which get this directory on `PYTHONPATH`: `subprocess_env(TESTS)`)."""

import numpy as np

from marin_rl.types import PackedBatch


def random_packed_batch(seed: int, rows: int, seq: int, vocab: int, segments: int) -> PackedBatch:
    """`rows` rows of `seq` tokens, each `segments` packed segments of random lengths and then padding; the loss
    covers every segment's tokens from position 3 on, with random advantages and sampler log-probs near uniform."""
    rng = np.random.default_rng(seed)
    segs = np.full((rows, seq), -1, np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(8, seq - 4), size=segments, replace=False))
        start = 0
        for s, end in enumerate(cuts):
            segs[r, start:end] = s
            pos[r, start:end] = np.arange(end - start)
            start = end
    loss_mask = (segs >= 0) & (pos >= 3)
    return PackedBatch(
        input_ids=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        position_ids=pos,
        segment_ids=segs,
        loss_mask=loss_mask,
        advantages=np.where(loss_mask, rng.normal(size=(rows, seq)), 0).astype(np.float32),
        sampler_logprobs=np.where(loss_mask, -np.log(vocab) + 0.1 * rng.normal(size=(rows, seq)), 0).astype(np.float32),
        token_versions=np.where(loss_mask, 0, -1).astype(np.int32),
    )
