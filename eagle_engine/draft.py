"""Draft phase: `num_steps` levels of top-k expansion with cumulative path scores (EAGLE-2
dynamic tree), each decode step attending to the committed draft cache plus the exact ancestry
of every frontier node. Scratch KV rows live past the committed length and are overwritten by
the next draft extend. `Frontier`, `top_children` and `expand` are the expansion rule itself,
shared with the static-shape (CUDA-graph) draft in `cuda_graph.py` and the batched draft in
`batch_phases.py`. A q8 head on a CPU runs each decode step (its forward and `top_children`) as
one C++ call (`FusedDecoder.draft`); `decode_children` is those steps in Python. With a
`step_cut`, the levels stop once the frontier's best path is below it (`goes_on`). Not here:
choosing the final `num_draft_tokens` (`tree.py`).
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


def top_children(logits: torch.Tensor, K: int, target_ids: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [K, draft_vocab] of a decode step over the frontier -> each node's top-K children:
    probabilities [K, K], target ids [K, K]. `target_ids` maps draft ids to target ids
    (`Eagle3Draft.target_ids`)."""
    child_p, child_idx = torch.softmax(logits, -1).topk(K, dim=-1)  # [K, K] each
    return child_p, target_ids(child_idx)


def expand(front: Frontier, child_p: torch.Tensor, child_ids: torch.Tensor,
           hidden: torch.Tensor) -> tuple[Frontier, DraftTree]:
    """One level: each frontier node's top-K children (probabilities [K, K], target ids [K, K],
    `top_children`) and the decode step's hidden [K, Hd] -> the K*K children as candidates,
    and the best K paths among them as the next frontier."""
    K = front.ids.numel()
    path = (front.score[:, None] * child_p).flatten()  # [K*K] cumulative probability
    level = DraftTree(scores=path, tokens=child_ids.flatten(),
                      parents=front.index.repeat_interleave(K))
    score, best = path.topk(K)
    slot = best // K  # [K] frontier slot of each new node's parent
    own = slot[:, None] == torch.arange(K, device=slot.device)  # [K, K] the parent's scratch row
    nxt = Frontier(front.offset + best, score, level.tokens[best], hidden[slot],
                   torch.cat([front.ancestry[slot], own], dim=1), front.offset + K * K)
    return nxt, level


def decode_children(model: Eagle3Draft, front: Frontier, position: int, start: int,
                    mask: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft decode step over the frontier as the head's forward and `top_children`, on any
    device: its K nodes at `position`, written to cache rows [start, start + K), seeing what
    mask [K, start + K] allows -> (children's probabilities [K, K], target ids [K, K], hidden
    [K, Hd]). A q8 head on a CPU runs it inside one C++ call for the whole draft
    (`FusedDecoder.draft`), same bits."""
    K = front.ids.numel()
    positions = torch.full((1, K), position, device=front.ids.device)
    logits, h = model(front.ids[None], front.hidden[None], positions, cache, start, mask[None],
                      from_target=False)
    return *top_children(logits[0], K, model.target_ids), h[0]


def goes_on(front: Frontier, tree: TreeParams) -> bool:
    """Whether the next draft decode step runs: always without a `step_cut`; with one, while the
    frontier's best path scores at least the cut (every child it adds scores at most that path).
    The check reads a scalar back: a host sync on a GPU."""
    return not tree.step_cut or float(front.score.max()) >= tree.step_cut


def join(levels: list[DraftTree]) -> DraftTree:
    return DraftTree(scores=torch.cat([lv.scores for lv in levels]),
                     tokens=torch.cat([lv.tokens for lv in levels]),
                     parents=torch.cat([lv.parents for lv in levels]))


@torch.inference_mode()
def draft(model: Eagle3Draft, inp: EagleDraftInput, cache: KVCache,
          tree: TreeParams) -> DraftTree:
    K, S, seq = tree.topk, tree.num_steps, inp.seq_len
    fused = model.fused
    if S > 1 and fused is not None and fused.drafts:
        return DraftTree(*fused.draft(model, inp.topk_p, inp.topk_ids, inp.hidden, seq, S,
                                      cache.data, tree.step_cut))
    front, first = Frontier.first(inp.topk_p, inp.topk_ids, inp.hidden.expand(K, -1))
    if S == 1:  # the extend's top-k is the whole draft
        return first
    levels = [first]
    dev = inp.topk_ids.device
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    prefix = torch.ones(K, seq, dtype=torch.bool, device=dev)
    for step in range(S - 1):
        if not goes_on(front, tree):
            break
        start = seq + step * K  # the scratch rows of this level's nodes
        mask = torch.cat([prefix, front.ancestry, eye], dim=1)  # [K, start + K]
        front, level = expand(front, *decode_children(model, front, seq + step, start, mask,
                                                      cache))
        levels.append(level)
    return join(levels)
