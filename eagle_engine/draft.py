"""Draft phase: `num_steps` levels of top-k expansion with cumulative path scores (EAGLE-2
dynamic tree), each decode step attending to the committed draft cache plus the exact ancestry
of every frontier node. Scratch KV rows live past the committed length and are overwritten by
the next draft extend. `Frontier` and `expand` are the expansion rule itself, shared with the
static-shape (CUDA-graph) draft in `cuda_graph.py`. Not here: choosing the final
`num_draft_tokens` (`tree.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import TreeParams
from .io_struct import DraftTree, EagleDraftInput
from .kv_cache import KVCache
from .models.draft_model import Eagle3Draft


@dataclass(slots=True)
class Frontier:
    """The K best paths so far: the nodes the next draft decode step expands.
    Candidate layout (global index): level 1 = [0, K); level d >= 2 = K + (d-2)K^2 + row*K + c,
    where row is the frontier slot expanded and c its child rank by draft probability."""

    index: torch.Tensor  # [K] int64 global candidate index of each node
    score: torch.Tensor  # [K] float32 cumulative path probability
    ids: torch.Tensor  # [K] int64 target-vocab ids (the next decode step's input tokens)
    hidden: torch.Tensor  # [K, Hd] recycled hidden of each node's parent step
    ancestry: torch.Tensor  # [K, level*K] bool: which scratch rows are each node's ancestors
    offset: int  # global index of the next level's first candidate

    @classmethod
    def first(cls, topk_p: torch.Tensor, topk_ids: torch.Tensor,
              hidden: torch.Tensor) -> tuple[Frontier, DraftTree]:
        """Level 1 (the extend's top-k after the root) as frontier and as candidates."""
        K = topk_ids.numel()
        dev = topk_ids.device
        front = cls(torch.arange(K, device=dev), topk_p, topk_ids, hidden,
                    torch.zeros(K, 0, dtype=torch.bool, device=dev), K)
        return front, DraftTree(topk_p, topk_ids, torch.full((K,), -1, dtype=torch.long,
                                                             device=dev))


def expand(front: Frontier, logits: torch.Tensor, hidden: torch.Tensor,
           target_ids: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Frontier, DraftTree]:
    """One level: logits [K, draft_vocab] and hidden [K, Hd] of the decode step over the frontier
    -> the K*K children (each node's top-K) as candidates, and the best K paths among them as
    the next frontier. `target_ids` maps draft ids to target ids (`Eagle3Draft.target_ids`)."""
    K = front.ids.numel()
    child_p, child_idx = torch.softmax(logits, -1).topk(K, dim=-1)  # [K, K]
    path = (front.score[:, None] * child_p).flatten()  # [K*K] cumulative probability
    level = DraftTree(scores=path, tokens=target_ids(child_idx).flatten(),
                      parents=front.index.repeat_interleave(K))
    score, best = path.topk(K)
    slot = best // K  # [K] frontier slot of each new node's parent
    own = slot[:, None] == torch.arange(K, device=slot.device)  # [K, K] the parent's scratch row
    nxt = Frontier(front.offset + best, score, level.tokens[best], hidden[slot],
                   torch.cat([front.ancestry[slot], own], dim=1), front.offset + K * K)
    return nxt, level


def join(levels: list[DraftTree]) -> DraftTree:
    return DraftTree(scores=torch.cat([lv.scores for lv in levels]),
                     tokens=torch.cat([lv.tokens for lv in levels]),
                     parents=torch.cat([lv.parents for lv in levels]))


@torch.inference_mode()
def draft(model: Eagle3Draft, inp: EagleDraftInput, cache: KVCache,
          tree: TreeParams) -> DraftTree:
    K, S, seq = tree.topk, tree.num_steps, inp.seq_len
    dev = inp.topk_ids.device
    front, first = Frontier.first(inp.topk_p, inp.topk_ids, inp.hidden.expand(K, -1))
    levels = [first]
    if S == 1:  # the extend's top-k is the whole draft
        return first
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    prefix = torch.ones(K, seq, dtype=torch.bool, device=dev)
    positions = torch.full((1, K), seq, device=dev)
    for step in range(S - 1):
        mask = torch.cat([prefix, front.ancestry, eye], dim=1)[None]  # [1, K, seq + (step+1)K]
        logits, h = model(front.ids[None], front.hidden[None], positions + step, cache,
                          seq + step * K, mask, from_target=False)
        front, level = expand(front, logits[0], h[0], model.target_ids)
        levels.append(level)
    return join(levels)
