"""`EagerPhases`: the scheduler's phase backend without CUDA graphs, and the verify forward
over several requests at once.

Each phase takes the step's requests (`run.Run`s) of one head: a request alone runs its own
phase function (`draft.draft`, `verify.run_target`, `decode`, `accept.extend`: for a q8 head
on a CPU the draft and extend are one C++ call each), several share one batched forward
(`draft.draft_levels`, `target_many`, `accept.extend_rows`). `target_many` runs one target
forward over every request's rows, an EAGLE-3 request's tree (`tree_rows`: its ancestor mask,
depth positions, rows from its committed length) or a plain request's next token
(`decode_rows`), each on its own cache; every request's numbers are those of its solo forward
(`models/batched.py`), so acceptance, commit and read-back stay per request.
`EagerPhases.lease` gives a request caches sized to what it can use. Under CUDA graphs
`cuda_graph.GraphPhases` replaces both, and falls back to these phases for what no graph takes.
Not here: acceptance, which requests run together (`scheduler.py`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .accept import extend, extend_rows
from .config import SamplingParams, TreeParams
from .draft import draft, draft_levels
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kv_cache import KVCache, tree_mask
from .models.batched import SeqRows, target_forward
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits, run_target

if TYPE_CHECKING:
    from .run import Run


def tree_rows(vin: EagleVerifyInput, cache: KVCache) -> SeqRows:
    """A request's tree as target rows: KV rows [seq_len, seq_len+N) in node order."""
    return SeqRows(vin.tokens, vin.positions, cache, vin.seq_len,
                   tree_mask(vin.ancestors, vin.seq_len)[0])


def decode_rows(token: torch.Tensor, seq_len: int, cache: KVCache) -> SeqRows:
    """A plain request's next step: `token` [1] at position and cache row `seq_len`."""
    return SeqRows(token.view(1), torch.full((1,), seq_len, device=token.device), cache,
                   seq_len, None)


@torch.inference_mode()
def target_many(target: TargetModel, rows: list[SeqRows], aux_ids: list[tuple[int, ...]]
                ) -> list[TreeLogits]:
    """One target forward over every request's rows -> per request its logits [T, V] and
    features [T, W]: the inputs of its `aux_ids[i]` layers (ascending), or the final hidden
    when it has none. The forward captures the union of the layers; each request takes its
    own columns."""
    union = sorted(set().union(*aux_ids))
    outs = target_forward(target, rows, tuple(union))
    H = target.cfg.hidden_size
    result = []
    for out, ids in zip(outs, aux_ids):
        feats = out.final_hidden[0]  # [T, H]
        if ids:
            wanted = sorted(set(ids))
            feats = out.aux_hidden[0]  # [T, len(union) * H]
            if wanted != union:
                cols = torch.cat([torch.arange(union.index(a) * H, (union.index(a) + 1) * H,
                                               device=feats.device) for a in wanted])
                feats = feats.index_select(1, cols)
        result.append(TreeLogits(out.logits[0], feats))
    return result


def decode(target: TargetModel, token: torch.Tensor, seq_len: int, cache: KVCache
           ) -> torch.Tensor:
    """A plain request's step alone: `token` [1] (on the device) at position `seq_len` ->
    next-token logits [1, V]."""
    position = torch.full((1, 1), seq_len, device=token.device)
    return target(token.view(1, 1), position, cache, seq_len, None).logits[0, -1:]


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

    def draft(self, model: Eagle3Draft, runs: list[Run], states: list[EagleDraftInput]
              ) -> list[DraftTree]:
        if len(runs) == 1:
            return [draft(model, states[0], runs[0].draft_cache, runs[0].tree)]
        return draft_levels(model, states, [r.draft_cache for r in runs], [r.tree for r in runs])

    def verify(self, target: TargetModel, runs: list[Run], vins: list[EagleVerifyInput],
               plain: list[Run], tokens: list[torch.Tensor], seq_lens: list[int]
               ) -> list[TreeLogits]:
        """The target over the trees of `runs` and the next tokens of the `plain` requests ->
        the trees' logits and features, then the plain requests' logits."""
        if not runs and not plain:  # a step of prefills only
            return []
        if len(runs) + len(plain) == 1:
            if runs:
                return [run_target(target, vins[0], runs[0].cache, runs[0].aux_ids)]
            return [TreeLogits(decode(target, tokens[0], seq_lens[0], plain[0].cache), None)]
        rows = ([tree_rows(vin, r.cache) for r, vin in zip(runs, vins)]
                + [decode_rows(tok, n, r.cache) for r, tok, n in zip(plain, tokens, seq_lens)])
        return target_many(target, rows, [r.aux_ids for r in runs] + [() for _ in plain])

    def extend(self, model: Eagle3Draft, runs: list[Run], exts: list[EagleDraftExtendInput]
               ) -> list[EagleDraftInput]:
        if len(runs) == 1:
            return [extend(model, exts[0], runs[0].draft_cache, runs[0].tree.topk)]
        return extend_rows(model, exts, [r.draft_cache for r in runs],
                           [r.tree.topk for r in runs])
