"""Stage 3: the draft vocabulary. Counts the target's own tokens in the generated responses and
keeps the most frequent `size` ids (sorted ascending, as `d2t` offsets require); reports the
coverage of each candidate size so the size is chosen by measurement. A warm start keeps the
trained head's ids and adds the data's most frequent others, and `carry_rows` gives the grown
vocabulary lm_head rows: the trained head's own where it has them, and for new ids the target's
rows through the linear map that best takes the target's rows to the trained head's on the ids
both share. Not here: training."""
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


def select_vocab(counts: Counter, size: int, vocab_size: int,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """[size] sorted target ids: the ids of `keep` first (a trained head's vocabulary; its `size`
    most frequent when it is larger), then the data's most frequent, then the lowest unused."""
    ranked = [t for t, _ in counts.most_common()]
    rank = {t: i for i, t in enumerate(ranked)}
    first = sorted(keep.tolist(), key=lambda t: rank.get(t, len(rank))) if keep is not None else []
    used = list(dict.fromkeys(first + ranked))[:size]
    if len(used) < size:
        seen = set(used)
        used += [t for t in range(vocab_size) if t not in seen][:size - len(used)]
    return torch.tensor(sorted(used), dtype=torch.long)


def carry_rows(src_rows: torch.Tensor, src_hot: torch.Tensor, hot: torch.Tensor,
               target_rows: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """lm_head rows [len(hot), H] for the draft vocabulary `hot`, from a trained head's rows
    `src_rows` [len(src_hot), H] over its vocabulary `src_hot`: copied for the ids both hold; for
    the others the target's rows `target_rows` [V, H] times the least-squares map (ridge-damped
    by `ridge` times the mean eigenvalue) from the target's rows to the trained head's on the
    shared ids. A new row started as the bare target row would outscore every trained row (the
    trained rows moved away from the target's in training), so the map keeps the scales."""
    src_rows, target_rows = src_rows.float(), target_rows.float()
    where = torch.full((target_rows.shape[0],), -1, dtype=torch.long)
    where[src_hot] = torch.arange(src_hot.numel())
    pos = where[hot]  # [len(hot)] row of each id in src_rows, or -1
    old = pos >= 0
    out = target_rows[hot].clone()
    out[old] = src_rows[pos[old]]
    if bool(old.all()) or not bool(old.any()):
        return out
    x, y = target_rows[hot[old]], src_rows[pos[old]]  # [n_shared, H] each
    gram = x.T @ x
    damp = ridge * gram.trace() / gram.shape[0]
    m = torch.linalg.solve(gram + damp * torch.eye(gram.shape[0]), x.T @ y)  # [H, H]
    out[~old] = target_rows[hot[~old]] @ m
    return out
