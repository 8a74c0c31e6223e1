"""The draft vocabulary: the target tokens the drafter's head predicts, and the maps between the two.

Built as SpecForge builds it (`generate_vocab_mapping_file`, `process_token_dict_to_mappings` in
`specforge/data/preprocessing.py`): count every loss-masked token of the training data; when fewer distinct
tokens than the draft vocabulary were seen, add token ids from 0 up with a count of 0; keep the
`draft_vocab_size` most frequent (ties in first-seen order, as `Counter.most_common` breaks them), sorted
by id. d2t[i] = used[i] - i (offsets), t2d[j] = whether target id j is in the draft vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

DEFAULT_DRAFT_VOCAB_SIZE = 32000


def token_counts(samples: Iterable[tuple[np.ndarray, np.ndarray]]) -> Counter:
    """Loss-masked token counts over (tokens, loss_mask) pairs, in SpecForge's insertion order: sample by
    sample, ascending ids within a sample (what `Tensor.unique` returns)."""
    counts: Counter = Counter()
    for tokens, loss_mask in samples:
        ids, n = np.unique(np.asarray(tokens)[np.asarray(loss_mask) == 1], return_counts=True)
        counts.update(dict(zip(ids.tolist(), n.tolist())))
    return counts


def draft_vocabulary(counts: Counter, draft_vocab_size: int, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft_vocab_size], t2d bool [target_vocab_size]) from token counts."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target_vocab_size}], got {draft_vocab_size}")
    counts = Counter(counts)
    if len(counts) < draft_vocab_size:
        # The same set expression and iteration as SpecForge, so the same zero-count ids are added.
        for token in set(range(draft_vocab_size)) - set(counts):
            counts[token] = 0
            if len(counts) >= draft_vocab_size:
                break
    used = np.sort(np.array([token for token, _ in counts.most_common(draft_vocab_size)], np.int64))
    t2d = np.zeros((target_vocab_size,), bool)
    t2d[used] = True
    return used - np.arange(draft_vocab_size, dtype=np.int64), t2d
