"""Accept phase: commit the accepted path and refresh the draft.

`commit` makes the accepted tree rows of the target cache contiguous after the committed prefix
(rejected rows stay behind as garbage past the committed length; nothing else moves) and builds
the `EagleDraftExtendInput`. `extend` runs the draft over the accepted tokens paired with the
target features of the positions before them, which rewrites the draft cache rows that drafting
used as scratch, and yields the next `EagleDraftInput`. Not here: acceptance rules (`verify.py`).
"""
from __future__ import annotations

import torch

from .io_struct import EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput, EagleVerifyOutput
from .kv_cache import KVCache, causal_mask
from .models.draft_model import Eagle3Draft


def commit(vin: EagleVerifyInput, path: torch.Tensor, bonus: int, features: torch.Tensor,
           cache: KVCache) -> EagleVerifyOutput:
    """path [n+1] accepted node indices (root first); features [N, W] verify features."""
    cache.commit_rows(vin.seq_len + path, vin.seq_len)
    emitted = vin.tokens[path[1:]].tolist() + [bonus]
    tokens = torch.tensor(emitted, device=vin.tokens.device)
    extend = EagleDraftExtendInput(tokens=tokens, hidden=features[path], seq_len=vin.seq_len)
    return EagleVerifyOutput(accepted_nodes=path, emitted=emitted, extend=extend)


@torch.inference_mode()
def extend(model: Eagle3Draft, ext: EagleDraftExtendInput, cache: KVCache,
           topk: int) -> EagleDraftInput:
    """Write draft KV for positions [seq_len, seq_len+T) and take top-k after the last one."""
    T = ext.tokens.numel()
    dev = ext.tokens.device
    positions = torch.arange(ext.seq_len, ext.seq_len + T, device=dev)[None]
    mask = causal_mask(T, ext.seq_len, dev)
    logits, hidden = model(ext.tokens[None], ext.hidden[None], positions, cache, ext.seq_len,
                           mask, from_target=True, last_only=True)
    topk_p, topk_idx = torch.softmax(logits[0, -1], -1).topk(topk)
    return EagleDraftInput(topk_p=topk_p, topk_ids=model.hot_ids[topk_idx],
                           hidden=hidden[0, -1], root=int(ext.tokens[-1]),
                           seq_len=ext.seq_len + T)
