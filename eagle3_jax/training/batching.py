"""From samples to fixed-shape batches: long documents split, rows bucketed by length, epochs shuffled.

Each row holds one sample, right-padded to its bucket (`bucket_length`, the engine's prompt buckets: a
power of two from 16 up, capped at max_len), so padding stays under half a row and few shapes compile.
A row's last real token is taken out of the loss (it has no next token to teach), as SpecForge's data
normaliser does. The batches of an epoch are a pure function of (samples, seed, epoch): a resumed run
sees exactly the batches it would have.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eagle3_jax.decoding.request import bucket_length
from eagle3_jax.training.data import Sample


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, T] int32, right-padded with 0
    loss_mask: np.ndarray  # [B, T] float32, 0 on padding and on each row's last real token
    num_tokens: int  # real (unpadded) tokens


def split_long(samples: list[Sample], max_len: int) -> list[Sample]:
    """Documents longer than max_len become consecutive pieces of at most max_len tokens; pieces where
    no token but the last carries the loss teach nothing and are left out."""
    out = []
    for s in samples:
        for start in range(0, len(s.tokens), max_len):
            piece = Sample(s.tokens[start:start + max_len], s.loss_mask[start:start + max_len], s.source)
            if piece.loss_mask[:-1].any():
                out.append(piece)
    return out


def epoch_plan(lengths: list[int], batch_size: int, max_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of each batch of one epoch: shuffled within buckets, cut into batches, batches
    shuffled. The number of batches is the same every epoch."""
    rng = np.random.default_rng((seed, epoch))
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(bucket_length(n, max_len), []).append(i)
    batches = []
    for bucket in sorted(by_bucket):
        order = rng.permutation(by_bucket[bucket]).tolist()
        batches.extend(order[i:i + batch_size] for i in range(0, len(order), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]


def assemble(samples: list[Sample], indices: list[int], batch_size: int, max_len: int) -> Batch:
    """The rows of one batch; a short last batch is filled with empty rows (no loss) to keep its shape."""
    T = bucket_length(max(len(samples[i].tokens) for i in indices), max_len)
    tokens = np.zeros((batch_size, T), np.int32)
    mask = np.zeros((batch_size, T), np.float32)
    for row, i in enumerate(indices):
        s = samples[i]
        tokens[row, :len(s.tokens)] = s.tokens
        mask[row, :len(s.tokens) - 1] = s.loss_mask[:-1]
    return Batch(tokens, mask, sum(len(samples[i].tokens) for i in indices))
