"""`EagerPhases`: the scheduler's phase backend without CUDA graphs, and how a step's requests
become the batches of the phases' one definitions.

Each phase takes the step's requests (`Seat`s: `run.Run`s) of one head and runs its one definition
(`draft.draft_levels`, `verify.verify_forward`, `accept.extend_forward`) over them on their own
caches (`models/batched.OwnCaches`): the requests of one `topk` share a draft and an extend,
and every running request, EAGLE-3 and plain alike, shares the verify forward. A ragged batch
(trees of several sizes, extends of several lengths) is padded to its widest request; only
the real rows run. A request alone drafts and extends through `draft.draft` / `accept.extend`,
one C++ call each for a q8 head on a CPU. `EagerPhases.lease` gives a request caches sized to
what it can use. Under CUDA graphs `cuda_graph.GraphPhases` replaces both, and hands these
phases what no graph takes.
Not here: acceptance, which requests run together (`scheduler.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from .accept import draft_input, extend, extend_forward
from .config import SamplingParams, TreeParams
from .draft import draft, draft_levels
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kv_cache import KVCache
from .models.batched import OwnCaches
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits, verify_forward

T = TypeVar("T")


class Seat(Protocol):
    """What a phase backend reads of a request (`run.Run` is one)."""

    head: str | None
    tree: TreeParams
    aux_ids: tuple[int, ...]  # the target layers whose inputs its head reads
    cache: KVCache
    draft_cache: KVCache | None
    slot: int | None  # its row of the backend's pools (`GraphPhases`), None without


def per_topk(runs: list[Seat], alone: Callable[[int], T],
             together: Callable[[list[int]], list[T]]) -> list[T]:
    """Each request's output, the requests grouped by their tree's `topk` (a draft's frontier
    width): a request alone in its group through `alone(i)`, a group of several through
    `together(indices)`, which returns their outputs in that order."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.tree.topk, []).append(i)
    out: list[T | None] = [None] * len(runs)
    for group in groups.values():
        for i, o in zip(group, [alone(group[0])] if len(group) == 1 else together(group)):
            out[i] = o
    return out


def tree_batch(vins: list[EagleVerifyInput], tokens: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The trees `vins` and the plain requests' next `tokens` ([1] each, trees of one node) as
    one batch padded to the largest tree -> ids [B, N], depth [B, N], ancestors [B, N, N] (a
    pad node sees itself), real nodes per request."""
    lens = [v.tokens.numel() for v in vins] + [1] * len(tokens)
    if len(lens) == 1 and vins:  # a tree alone: views, nothing padded
        v = vins[0]
        return v.tokens[None], v.depth[None], v.ancestors[None], lens
    B, N = len(lens), max(lens)
    dev = (vins[0].tokens if vins else tokens[0]).device
    ids = torch.zeros(B, N, dtype=torch.long, device=dev)
    depth = torch.zeros(B, N, dtype=torch.long, device=dev)
    ancestors = torch.eye(N, dtype=torch.bool, device=dev).repeat(B, 1, 1)
    for b, v in enumerate(vins):
        n = lens[b]
        ids[b, :n], depth[b, :n], ancestors[b, :n, :n] = v.tokens, v.depth, v.ancestors
    for b, tok in enumerate(tokens, start=len(vins)):
        ids[b, :1] = tok
    return ids, depth, ancestors, lens


def extend_batch(exts: list[EagleDraftExtendInput]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Extends of several lengths as one batch, real rows last -> ids [B, T], hidden
    [B, T, W], offsets [B, T] (cache row - seq_len: pads after the real rows), real rows."""
    lens = [e.tokens.numel() for e in exts]
    B, T, first = len(exts), max(lens), exts[0]
    dev = first.tokens.device
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    hidden = torch.zeros(B, T, first.hidden.shape[-1], dtype=first.hidden.dtype, device=dev)
    offsets = torch.arange(T, device=dev).repeat(B, 1)
    for b, (e, n) in enumerate(zip(exts, lens)):
        ids[b, T - n:], hidden[b, T - n:] = e.tokens, e.hidden
        offsets[b] = offsets[b].roll(T - n)
    return ids, hidden, offsets, lens


class EagerPhases:
    """The phases over the step's requests as eager forwards (see the module docstring)."""

    def __init__(self, target: TargetModel, heads: dict[str, Eagle3Draft], max_len: int) -> None:
        self.target, self.heads, self.max_len = target, heads, max_len  # the context window

    def lease(self, prompt_len: int, params: SamplingParams, tree: TreeParams,
              head: str | None) -> tuple[int | None, KVCache, KVCache | None]:
        """A new request's (slot, target cache, draft cache): no slot, caches sized to what it
        can use (its prompt, `max_new_tokens` and its tree, at most the context window; the
        draft's also the tree's scratch rows)."""
        width = tree.max_rows if head else 1
        cache = self.target.new_cache(max_len=min(
            self.max_len, prompt_len + params.max_new_tokens + width + 2))
        draft_cache = None if head is None else self.heads[head].new_cache(
            cache.max_len + tree.topk * tree.num_steps)
        return None, cache, draft_cache

    def release(self, slot: int | None) -> None:
        """A request's slot is free again (nothing to do without slots)."""

    def warm_up(self, trees: dict[str, TreeParams]) -> list:
        """Nothing to make ahead: the eager phases have no graphs (`GraphPhases.warm_up`)."""
        return []

    def draft(self, model: Eagle3Draft, runs: list[Seat], states: list[EagleDraftInput]
              ) -> list[DraftTree]:
        def together(group: list[int]) -> list[DraftTree]:
            s = [states[i] for i in group]
            rows = OwnCaches([runs[i].draft_cache for i in group], [x.seq_len for x in s])
            return draft_levels(model, rows, torch.stack([x.topk_p for x in s]),
                                torch.stack([x.topk_ids for x in s]),
                                torch.stack([x.hidden for x in s]), [runs[i].tree for i in group])
        return per_topk(runs, lambda i: draft(model, states[i], runs[i].draft_cache,
                                              runs[i].tree), together)

    def verify(self, target: TargetModel, runs: list[Seat], vins: list[EagleVerifyInput],
               plain: list[Seat], tokens: list[torch.Tensor], seq_lens: list[int]
               ) -> list[TreeLogits]:
        """The target over the trees of `runs` and the next tokens of the `plain` requests ->
        the trees' logits and features, then the plain requests' logits."""
        if not runs and not plain:  # a step of prefills only
            return []
        ids, depth, ancestors, lens = tree_batch(vins, tokens)
        rows = OwnCaches([r.cache for r in runs + plain], [v.seq_len for v in vins] + seq_lens)
        return verify_forward(target, rows, ids, depth, ancestors,
                              [r.aux_ids for r in runs] + [None] * len(plain), lens)

    def extend(self, model: Eagle3Draft, runs: list[Seat], exts: list[EagleDraftExtendInput]
               ) -> list[EagleDraftInput]:
        def together(group: list[int]) -> list[EagleDraftInput]:
            e = [exts[i] for i in group]
            ids, hidden, offsets, lens = extend_batch(e)
            rows = OwnCaches([runs[i].draft_cache for i in group], [x.seq_len for x in e])
            topk_p, topk_ids, h = extend_forward(model, rows, ids, hidden, offsets, lens,
                                                 runs[group[0]].tree.topk)
            return [draft_input(x, topk_p[j], topk_ids[j], h[j]) for j, x in enumerate(e)]
        return per_topk(runs, lambda i: extend(model, exts[i], runs[i].draft_cache,
                                               runs[i].tree.topk), together)
