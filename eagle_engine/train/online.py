"""Stage 2 done per training step (`--online`): target features computed on the fly from a batch
of conversations instead of being cached on disk.

On a GPU one batched target forward of a 135M model costs less than reading cached features
back (4.6 KB per token in bf16 for this target), and the data can outgrow memory and disk; every
head trained in the run reads the same forward. On the CPU the cached path (`features.py`) is the
faster one, since each epoch would repeat the target forward. The features equal the cached
ones up to batching round-off (`tests/test_train_pipeline.py`). Not here: the loss or the
training loop (`trainer.py`).
"""
from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from ..kv_cache import causal_mask
from ..models.target import TargetModel
from .features import row_ids
from .trainer import SDPA_BACKENDS, Batch


@torch.inference_mode()
def _target_pass(target: TargetModel, ids: torch.Tensor, aux_ids: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T] right-padded -> (aux [B, T, A*H], final [B, T, H], argmax [B, T]). Padding
    sits after every real token, so under the causal mask it changes no real position. Without
    cuDNN's attention, as `ttt_attention`: T changes with every batch, and each new shape costs
    it a plan, which makes a step's target forward about 3x slower on a GPU."""
    B, T = ids.shape
    dev = target.device
    with sdpa_kernel(SDPA_BACKENDS):
        out = target(ids, torch.arange(T, device=dev)[None].expand(B, T),
                     target.new_cache(batch=B, max_len=T), 0, causal_mask(T, 0, dev), aux_ids)
    return out.aux_hidden, out.final_hidden, out.logits.argmax(-1)


def online_batch(target: TargetModel, rows: list[dict], group: list[int],
                 aux_ids: tuple[int, ...], in_vocab: torch.Tensor, max_tokens: int = 1024
                 ) -> Batch:
    """One training `Batch` for conversations `rows[group]`, features from one target forward.
    `in_vocab` [V] bool (on the target's device) marks the draft vocabulary."""
    dev = target.device
    seqs = [row_ids(rows[i], max_tokens) for i in group]
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.bool)  # [B, T] answer tokens with a next token
    for b, (i, s) in enumerate(zip(group, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        # answer positions; the last token's target lies past the end
        response[b, len(rows[i]["prompt_ids"]):len(s) - 1] = True
    ids, response = ids.to(dev), response.to(dev)
    aux, final, argmax = _target_pass(target, ids, aux_ids)
    # clone: inference tensors cannot be saved for the heads' backward
    return Batch(ids=ids, aux=aux.clone(), final=final.clone(), response=response,
                 in_vocab_target=in_vocab[argmax], argmax=argmax.clone())
