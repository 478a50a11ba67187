"""The phases of an EAGLE-3 iteration, and a plain decode step, over several requests at once.

    draft_many   `draft.draft` for the requests of one head: each level is one draft forward
                 over every request's frontier rows (a request with fewer steps, or whose
                 `step_cut` stops it, drops out), expanded per request by `draft.expand`
    target_many  one target forward over every request's rows: an EAGLE-3 request's tree
                 (`tree_rows`: its ancestor mask, depth positions, rows from its committed
                 length) or a plain request's next token (`decode_rows`), each on its own cache
    extend_many  `accept.extend` for the requests of one head in one draft forward

Every request's numbers are those of its solo phase (`models/batched.py`), so acceptance,
commit and read-back stay per request (`engine.Run`, `scheduler.py`). A head with one request
runs that solo phase itself (`draft.draft`, `accept.extend`): with a q8 head on a CPU each is
one C++ call, which the batched Python steps are not, and a one-request scheduler decoded 1-2%
faster with them (docs/results.md, section 40).
Not here: acceptance, which requests run together (`scheduler.py`).
"""
from __future__ import annotations

import torch

from .accept import draft_input_after, extend
from .config import TreeParams
from .draft import Frontier, draft, expand, goes_on, join, top_children
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kv_cache import KVCache, causal_mask, tree_mask
from .models.batched import SeqRows, draft_forward, target_forward
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits


@torch.inference_mode()
def draft_many(model: Eagle3Draft, states: list[EagleDraftInput], caches: list[KVCache],
               trees: list[TreeParams]) -> list[DraftTree]:
    """`draft.draft(model, states[i], caches[i], trees[i])` for every i, level by level."""
    if len(states) == 1:
        return [draft(model, states[0], caches[0], trees[0])]
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
            eye = torch.eye(K, dtype=torch.bool, device=front.ids.device)
            mask = torch.cat([prefixes[i], front.ancestry, eye], dim=1)  # [K, seq+(step+1)K]
            positions = torch.full((K,), seq + step, device=front.ids.device)
            rows.append(SeqRows(front.ids, positions, caches[i], seq + step * K, mask,
                                front.hidden))
        for i, (logits, h) in zip(live, draft_forward(model, rows, from_target=False)):
            K = trees[i].topk
            fronts[i], level = expand(fronts[i], *top_children(logits[0], K, model.target_ids),
                                      h[0])
            levels[i].append(level)
    return [join(lv) for lv in levels]


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


@torch.inference_mode()
def extend_many(model: Eagle3Draft, exts: list[EagleDraftExtendInput], caches: list[KVCache],
                topks: list[int]) -> list[EagleDraftInput]:
    """`accept.extend(model, exts[i], caches[i], topks[i])` for every i, in one forward."""
    if len(exts) == 1:
        return [extend(model, exts[0], caches[0], topks[0])]
    rows = []
    for ext, cache in zip(exts, caches):
        T, dev = ext.tokens.numel(), ext.tokens.device
        rows.append(SeqRows(ext.tokens, torch.arange(ext.seq_len, ext.seq_len + T, device=dev),
                            cache, ext.seq_len, causal_mask(T, ext.seq_len, dev)[0], ext.hidden))
    outs = draft_forward(model, rows, from_target=True, last_only=True)
    return [draft_input_after(model, ext, logits[0, -1], hidden[0, -1], k)
            for ext, (logits, hidden), k in zip(exts, outs, topks)]
