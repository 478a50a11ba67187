"""Draft phase: `num_steps` levels of top-k expansion with cumulative path scores (EAGLE-2
dynamic tree), each decode step attending to the committed draft cache plus the exact ancestry
of every frontier node. Scratch KV rows live past the committed length and are overwritten by
the next draft extend. Not here: choosing the final `num_draft_tokens` (`tree.py`).
"""
from __future__ import annotations

import torch

from .config import TreeParams
from .io_struct import DraftTree, EagleDraftInput
from .kv_cache import KVCache
from .models.draft_model import Eagle3Draft


@torch.inference_mode()
def draft(model: Eagle3Draft, inp: EagleDraftInput, cache: KVCache,
          tree: TreeParams) -> DraftTree:
    """Candidate layout (global index): level 1 = [0, K); level d >= 2 = K + (d-2)K^2 + row*K + c,
    where row is the frontier slot expanded and c its child rank by draft probability."""
    K, S, seq = tree.topk, tree.num_steps, inp.seq_len
    dev = inp.topk_ids.device
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    scores, tokens = [inp.topk_p], [inp.topk_ids]
    parents = [torch.full((K,), -1, dtype=torch.long, device=dev)]
    frontier = torch.arange(K, device=dev)  # [K] global index of each frontier node
    frontier_score, frontier_ids = inp.topk_p, inp.topk_ids  # [K], [K]
    hidden = inp.hidden.expand(K, -1)  # [K, Hd] recycled hidden of each frontier node's parent
    ancestry = torch.zeros(K, 0, dtype=torch.bool, device=dev)  # [K, i*K] over scratch rows
    offset = K
    hot_ids = model.hot_ids
    for step in range(S - 1):
        start = seq + step * K
        prefix = torch.ones(K, seq, dtype=torch.bool, device=dev)
        mask = torch.cat([prefix, ancestry, eye], dim=1)[None]  # [1, K, seq + (step+1)K]
        positions = torch.full((1, K), seq + step, device=dev)
        logits, h = model(frontier_ids[None], hidden[None], positions, cache, start, mask,
                          from_target=False)
        child_p, child_idx = torch.softmax(logits[0], -1).topk(K, dim=-1)  # [K, K]
        child_ids = hot_ids[child_idx]
        path = frontier_score[:, None] * child_p  # [K, K] cumulative probability
        scores.append(path.flatten())
        tokens.append(child_ids.flatten())
        parents.append(frontier.repeat_interleave(K))
        frontier_score, best = path.flatten().topk(K)  # next frontier: best K paths
        slot = best // K  # frontier slot of each new node's parent
        frontier = offset + best
        frontier_ids = child_ids.flatten()[best]
        hidden = h[0, slot]
        ancestry = torch.cat([ancestry[slot], eye[slot]], dim=1)
        offset += K * K
    return DraftTree(scores=torch.cat(scores), tokens=torch.cat(tokens),
                     parents=torch.cat(parents))
