"""Draft phase: `num_steps` levels of top-k expansion with cumulative path scores (EAGLE-2
dynamic tree), each decode step attending to the committed draft cache plus the exact ancestry
of every frontier node. Scratch KV rows live past the committed length and are overwritten by
the next draft extend. `draft_levels` is the one definition, over a batch of requests of one
head, run over either row placement (`models/batched.py`): eagerly over the requests' own
caches, and as the function a CUDA graph captures over pool rows (`cuda_graph.DraftRunner`).
`Frontier`, `top_children` and `expand` are the expansion rule. For a q8 head on a CPU, a
request alone drafts in one C++ call (`FusedDecoder.draft`), checked against `draft_levels`
bit for bit (tests/test_cpu_lowbit.py). With a `step_cut`, a request's levels stop once its
frontier's best path is below it (`going_on`).
Not here: choosing the final `num_draft_tokens` (`tree.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import TreeParams
from .io_struct import DraftTree, EagleDraftInput
from .kv_cache import KVCache
from .models.batched import OwnCaches, Placement
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

    def select(self, keep: list[int]) -> Frontier:
        """The batch rows `keep` [n] of a batched frontier ([B, K] fields)."""
        return Frontier(*(torch.stack([t[b] for b in keep]) for t in (
            self.index, self.score, self.ids, self.hidden, self.ancestry)), self.offset)

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


def going_on(front: Frontier, trees: list[TreeParams]) -> list[int]:
    """Which of the batch's requests run the next draft decode step: all without a `step_cut`;
    one with a cut while its frontier's best path scores at least the cut (every child it adds
    scores at most that path). A cut reads the scores back: a host sync on a GPU, which is why
    no CUDA graph takes a tree with one."""
    if not any(t.step_cut for t in trees):
        return list(range(len(trees)))
    best = front.score.amax(-1).tolist()  # [B]
    return [b for b, t in enumerate(trees) if not t.step_cut or best[b] >= t.step_cut]


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
    rows = OwnCaches([cache], [inp.seq_len])
    return draft_levels(model, rows, inp.topk_p[None], inp.topk_ids[None], inp.hidden[None],
                        [tree])[0]


@torch.inference_mode()
def draft_levels(model: Eagle3Draft, rows: Placement, topk_p: torch.Tensor,
                 topk_ids: torch.Tensor, hidden: torch.Tensor, trees: list[TreeParams]
                 ) -> list[DraftTree]:
    """The draft of a batch of requests of one head and one `topk` K, level by level: level 1
    is each request's extend top-k (topk_p, topk_ids [B, K], under its recycled hidden
    [B, Hd]); each further level is one draft forward over the batch's frontiers (K nodes a
    request at position seq_len + level - 1, written to the K scratch rows past its committed
    length that the level owns, each seeing its committed rows and its own ancestry) and
    `expand`. A request leaves the batch after its `num_steps` levels, or once its `step_cut`
    stops it (`going_on`). -> each request's candidates [capacity]."""
    B, K = topk_ids.shape
    front, first = Frontier.first(topk_p, topk_ids, hidden[:, None].expand(B, K, -1))
    levels = [[DraftTree(first.scores[b], first.tokens[b], first.parents[b])] for b in range(B)]
    live = list(range(B))  # the requests of the batch still drafting, in batch order
    slots = torch.arange(K, device=topk_ids.device)  # [K]
    for step in range(max(t.num_steps for t in trees) - 1):
        going = [j for j in going_on(front, [trees[b] for b in live])
                 if step < trees[live[j]].num_steps - 1]
        if not going:
            break
        if len(going) < len(live):
            front, rows, live = front.select(going), rows.subset(going), [live[j] for j in going]
        pos = torch.full_like(front.ids, step)  # [B, K] position - seq_len
        logits, h = rows.draft(model, front.ids, front.hidden, pos, step * K + slots,
                               step * K, front.scratch_seen(), None, from_target=False)
        front, level = expand(front, *top_children(logits, K, model.target_ids), h)
        for j, b in enumerate(live):
            levels[b].append(DraftTree(level.scores[j], level.tokens[j], level.parents[j]))
    return [join(lv) for lv in levels]
