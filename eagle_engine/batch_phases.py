"""The verify forward over several requests at once: one target forward over every request's
rows, an EAGLE-3 request's tree (`tree_rows`: its ancestor mask, depth positions, rows from its
committed length) or a plain request's next token (`decode_rows`), each on its own cache.

Every request's numbers are those of its solo forward (`models/batched.py`), so acceptance,
commit and read-back stay per request (`run.Run`, `scheduler.py`). The batched draft and
extend are the phases' own definitions (`draft.draft_levels`, `accept.extend_rows`).
Not here: acceptance, which requests run together (`scheduler.py`).
"""
from __future__ import annotations

import torch

from .io_struct import EagleVerifyInput
from .kv_cache import KVCache, tree_mask
from .models.batched import SeqRows, target_forward
from .models.target import TargetModel
from .verify import TreeLogits


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
