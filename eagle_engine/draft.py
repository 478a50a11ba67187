"""Draft phase: `num_steps` levels of top-k expansion with cumulative path scores (EAGLE-2
dynamic tree), each decode step attending to the committed draft cache plus the exact ancestry
of every frontier node. Scratch KV rows live past the committed length and are overwritten by
the next draft extend. `draft_levels` is the one definition, over the requests of one head;
`Frontier`, `top_children` and `expand` are the expansion rule, shared with the static-shape
(CUDA-graph) draft in `cuda_graph.py`. Two faster implementations of the same function are
checked against it: that static draft (tests/test_cuda_graph.py) and, for a q8 head on a CPU,
one C++ call for a request's whole draft (`FusedDecoder.draft`, tests/test_cpu_lowbit.py).
With a `step_cut`, the levels stop once the frontier's best path is below it (`goes_on`).
Not here: choosing the final `num_draft_tokens` (`tree.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import TreeParams
from .io_struct import DraftTree, EagleDraftInput
from .kv_cache import KVCache
from .models.batched import SeqRows, draft_forward
from .models.draft_model import Eagle3Draft


@dataclass(slots=True)
class Frontier:
    """The K best paths so far: the nodes the next draft decode step expands. Tensors may carry
    leading batch dims (`...`: one request, or a static batch of them).
    Candidate layout (global index): level 1 = [0, K); level d >= 2 = K + (d-2)K^2 + row*K + c,
    where row is the frontier slot expanded and c its child rank by draft probability."""

    index: torch.Tensor  # [..., K] int64 global candidate index of each node
    score: torch.Tensor  # [..., K] float32 cumulative path probability
    ids: torch.Tensor  # [..., K] int64 target-vocab ids (the next decode step's input tokens)
    hidden: torch.Tensor  # [..., K, Hd] recycled hidden of each node's parent step
    ancestry: torch.Tensor  # [..., K, level*K] bool: which scratch rows are each node's ancestors
    offset: int  # global index of the next level's first candidate

    @classmethod
    def first(cls, topk_p: torch.Tensor, topk_ids: torch.Tensor,
              hidden: torch.Tensor) -> tuple[Frontier, DraftTree]:
        """Level 1 (the extend's top-k after the root) as frontier and as candidates:
        topk_p, topk_ids [..., K], hidden [..., K, Hd]."""
        K = topk_ids.shape[-1]
        dev = topk_ids.device
        index = torch.arange(K, device=dev).expand_as(topk_ids)
        ancestry = torch.zeros(*topk_ids.shape, 0, dtype=torch.bool, device=dev)
        front = cls(index, topk_p, topk_ids, hidden, ancestry, K)
        return front, DraftTree(topk_p, topk_ids, torch.full_like(topk_ids, -1))

    def scratch_seen(self) -> torch.Tensor:
        """[..., K, (level+1)*K] bool: which of the scratch rows from the committed length each
        node sees in the next draft step: its ancestors' and its own (written by that step)."""
        K = self.ids.shape[-1]
        eye = torch.eye(K, dtype=torch.bool, device=self.ids.device)
        return torch.cat([self.ancestry, eye.expand(*self.ids.shape[:-1], K, K)], dim=-1)


def top_children(logits: torch.Tensor, K: int, target_ids: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., K, draft_vocab] of a decode step over the frontier -> each node's top-K
    children: probabilities [..., K, K], target ids [..., K, K]. `target_ids` maps draft ids to
    target ids (`Eagle3Draft.target_ids`)."""
    child_p, child_idx = torch.softmax(logits, -1).topk(K, dim=-1)  # [..., K, K] each
    return child_p, target_ids(child_idx)


def expand(front: Frontier, child_p: torch.Tensor, child_ids: torch.Tensor,
           hidden: torch.Tensor) -> tuple[Frontier, DraftTree]:
    """One level: each frontier node's top-K children (probabilities [..., K, K], target ids
    [..., K, K], `top_children`) and the decode step's hidden [..., K, Hd] -> the K*K children
    as candidates, and the best K paths among them as the next frontier."""
    K = front.ids.shape[-1]
    path = (front.score[..., :, None] * child_p).flatten(-2)  # [..., K*K] cumulative probability
    level = DraftTree(scores=path, tokens=child_ids.flatten(-2),
                      parents=front.index.repeat_interleave(K, dim=-1))
    score, best = path.topk(K, dim=-1)  # [..., K]
    slot = best // K  # [..., K] frontier slot of each new node's parent
    own = slot[..., :, None] == torch.arange(K, device=slot.device)  # [..., K, K] its scratch row
    rows = slot[..., None]  # [..., K, 1]
    nxt = Frontier(front.offset + best, score, level.tokens.gather(-1, best),
                   torch.take_along_dim(hidden, rows, dim=-2),
                   torch.cat([torch.take_along_dim(front.ancestry, rows, dim=-2), own], dim=-1),
                   front.offset + K * K)
    return nxt, level


def goes_on(front: Frontier, tree: TreeParams) -> bool:
    """Whether the next draft decode step runs: always without a `step_cut`; with one, while the
    frontier's best path scores at least the cut (every child it adds scores at most that path).
    The check reads a scalar back: a host sync on a GPU."""
    return not tree.step_cut or float(front.score.max()) >= tree.step_cut


def join(levels: list[DraftTree]) -> DraftTree:
    """The levels' candidates in the candidate layout (along the last dim)."""
    return DraftTree(scores=torch.cat([lv.scores for lv in levels], -1),
                     tokens=torch.cat([lv.tokens for lv in levels], -1),
                     parents=torch.cat([lv.parents for lv in levels], -1))


@torch.inference_mode()
def draft(model: Eagle3Draft, inp: EagleDraftInput, cache: KVCache,
          tree: TreeParams) -> DraftTree:
    """One request's draft: `draft_levels` of it alone, or, for a q8 head on a CPU, the same
    levels as one C++ call (`FusedDecoder.draft`, the same bits: tests/test_cpu_lowbit.py)."""
    fused = model.fused
    if tree.num_steps > 1 and fused is not None and fused.drafts:
        return DraftTree(*fused.draft(model, inp.topk_p, inp.topk_ids, inp.hidden, inp.seq_len,
                                      tree.num_steps, cache.data, tree.step_cut))
    return draft_levels(model, [inp], [cache], [tree])[0]


@torch.inference_mode()
def draft_levels(model: Eagle3Draft, states: list[EagleDraftInput], caches: list[KVCache],
                 trees: list[TreeParams]) -> list[DraftTree]:
    """The draft of every request of one head, level by level: level 1 is the extend's top-k;
    each further level is one draft forward over every request's frontier (its K nodes at
    position seq_len + level - 1, written to scratch rows past its committed length, seeing its
    committed rows and its own ancestry) and `expand`. A request drops out after its
    `num_steps` levels, or once its `step_cut` stops it (`goes_on`). The forward is batched
    over the requests (`models/batched.py`): each gets the numbers it gets alone."""
    fronts, levels, prefixes = [], [], []
    for inp, tree in zip(states, trees):
        K = tree.topk
        front, first = Frontier.first(inp.topk_p, inp.topk_ids, inp.hidden.expand(K, -1))
        fronts.append(front)
        levels.append([first])
        prefixes.append(torch.ones(K, inp.seq_len, dtype=torch.bool, device=inp.hidden.device))
    live = list(range(len(trees)))
    for step in range(max(t.num_steps for t in trees) - 1):
        live = [i for i in live if step < trees[i].num_steps - 1 and goes_on(fronts[i], trees[i])]
        if not live:
            break
        rows = []
        for i in live:
            K, seq, front = trees[i].topk, states[i].seq_len, fronts[i]
            mask = torch.cat([prefixes[i], front.scratch_seen()], dim=1)  # [K, seq+(step+1)K]
            positions = torch.full((K,), seq + step, device=front.ids.device)
            rows.append(SeqRows(front.ids, positions, caches[i], seq + step * K, mask,
                                front.hidden))
        for i, (logits, h) in zip(live, draft_forward(model, rows, from_target=False)):
            K = trees[i].topk
            fronts[i], level = expand(fronts[i], *top_children(logits[0], K, model.target_ids),
                                      h[0])
            levels[i].append(level)
    return [join(lv) for lv in levels]
