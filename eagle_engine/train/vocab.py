"""Stage 3: the draft vocabulary. Counts the target's own tokens in the generated responses and
keeps the most frequent `size` ids (sorted ascending, as `d2t` offsets require); reports the
coverage of each candidate size so the size is chosen by measurement. Not here: training."""
from __future__ import annotations

from collections import Counter

import torch


def token_counts(responses: list[list[int]]) -> Counter:
    counts: Counter = Counter()
    for r in responses:
        counts.update(r)
    return counts


def coverage_table(counts: Counter, sizes: list[int]) -> dict[int, float]:
    """Fraction of response tokens covered by the top-`size` ids, per size."""
    total = sum(counts.values())
    freqs = [c for _, c in counts.most_common()]
    return {s: sum(freqs[:s]) / total for s in sizes}


def select_vocab(counts: Counter, size: int, vocab_size: int) -> torch.Tensor:
    """[size] sorted target ids; pads with the lowest unused ids if the data has fewer."""
    used = [t for t, _ in counts.most_common(size)]
    if len(used) < size:
        seen = set(used)
        used += [t for t in range(vocab_size) if t not in seen][:size - len(used)]
    return torch.tensor(sorted(used), dtype=torch.long)
