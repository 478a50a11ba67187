"""Verify phase: one target forward over the whole tree (ancestor mask, depth positions), then
lossless acceptance: greedy (longest path agreeing with the target argmax, plus the bonus token)
or tree speculative sampling (siblings tried in draft order against one coin per level, residual
distribution on rejection), which reproduces the target's sampling distribution exactly.
Not here: cache compaction or the draft extend (`accept.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .io_struct import EagleVerifyInput
from .kernels import verify_tree_greedy
from .kv_cache import KVCache, tree_mask
from .models.target import TargetModel
from .sampling import greedy, sample_from, target_probs


@dataclass(slots=True)
class TreeLogits:
    logits: torch.Tensor  # [N, vocab] float32: row i = target distribution after node i
    features: torch.Tensor  # [N, EagleDraftExtendInput.hidden_size_for] draft-extend inputs


def run_target(target: TargetModel, vin: EagleVerifyInput, cache: KVCache,
               aux_layer_ids: tuple[int, ...]) -> TreeLogits:
    """Target forward on the tree; KV rows [seq_len, seq_len+N) hold the tree in node order."""
    out = target(vin.tokens[None], vin.positions[None], cache, vin.seq_len,
                 tree_mask(vin.ancestors, vin.seq_len), aux_layer_ids)
    feats = out.aux_hidden if aux_layer_ids else out.final_hidden
    return TreeLogits(out.logits[0], feats[0])


def accept_greedy(vin: EagleVerifyInput, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """-> (accepted node path [len] root first, bonus token)."""
    predict = greedy(logits)  # [N]
    best, length = verify_tree_greedy(vin.tokens, vin.parents, vin.ancestors, vin.depth, predict)
    path = vin.retrieve_indices[best, :int(length) + 1]
    return path, int(predict[best])


def accept_sampled(vin: EagleVerifyInput, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, int]:
    """Tree speculative sampling with deterministic top-k drafts (q = point mass): at each level,
    child k is accepted iff sum_{j<k} p(x_j) <= u < sum_{j<=k} p(x_j) for one uniform u; if all
    children fail, the bonus is drawn from p with those children removed (renormalized). This is
    inverse-CDF sampling of p with the children listed first, so every emitted token ~ p."""
    probs = target_probs(logits, params)  # [N, V]
    parents = vin.parents.tolist()
    tokens = vin.tokens.tolist()
    node, path = 0, [0]
    while True:
        children = [c for c in range(len(parents)) if parents[c] == node]
        if not children:
            return torch.tensor(path, device=logits.device), int(sample_from(probs[node], generator))
        p = probs[node]
        u = float(torch.rand((), generator=generator, device=logits.device))
        cumulative, accepted = 0.0, None
        for c in children:
            cumulative += float(p[tokens[c]])
            if u < cumulative:
                accepted = c
                break
        if accepted is None:
            residual = p.clone()
            residual[[tokens[c] for c in children]] = 0
            if float(residual.sum()) <= 0:  # children held all the mass; u rounded past it
                residual = p
            bonus = int(sample_from(residual / residual.sum(), generator))
            return torch.tensor(path, device=logits.device), bonus
        node = accepted
        path.append(node)
