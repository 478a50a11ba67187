"""Forwards over the rows of several requests at once: the scheduler's batched phases.

Each request brings its own rows (`SeqRows`): token ids, positions, its own one-row KV cache,
the first cache row it writes and its mask over that cache. Every linear, norm and the lm_head
run once over all rows, so each weight is read once for all requests, while attention runs per
request over its own cache (the block-diagonal mask, never materialized):
- fused low-bit layers (`cpu_lowbit.FusedDecoder`, the q4 target and q8 heads on CPU) do it in
  one C++ call whose row kernels give every row the same bits whatever rows run beside it;
- dense layers (`forward_many` of the layers, bf16 or fp32, CPU or GPU) do it with torch ops.
  A dense matrix product may round a row differently with a different number of rows beside
  it (fp32 on CPU switches kernels between one row and several), the same freedom a solo
  request's tree verify already has against its one-token decode; greedy answers are checked
  against solo ones in `tests/test_scheduler.py`.
Not here: which requests run together or the phases' logic (`scheduler.py`, `batch_phases.py`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..kv_cache import KVCache
from .draft_model import Eagle3Draft
from .layers import score_bias
from .target import TargetModel, TargetOutput


@dataclass(slots=True)
class SeqRows:
    """One request's rows in a batched forward."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 RoPE positions
    cache: KVCache  # the request's own one-row cache
    start: int  # first cache row written
    mask: torch.Tensor | None  # [T, start+T] bool (True = visible); None: every row visible
    hidden: torch.Tensor | None = None  # [T, W] a draft's input (target features or recycled)


def _lens(seqs: list[SeqRows]) -> list[int]:
    return [s.ids.numel() for s in seqs]


def _last_rows(h: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """h [R, W], the sequences' rows one after the other -> [n, W] each sequence's last row
    (slices: no index tensor is uploaded)."""
    ends = itertools.accumulate(lens)
    return torch.cat([h[end - 1:end] for end in ends])


def target_forward(target: TargetModel, seqs: list[SeqRows], aux_layer_ids: tuple[int, ...],
                   last_only: bool = False) -> list[TargetOutput]:
    """Each sequence's `TargetModel.forward` output ([1, T, ...] tensors; logits [1, 1, V] with
    `last_only`), computed together: the fused C++ layers, or the dense layers' `forward_many`."""
    lens, starts = _lens(seqs), [s.start for s in seqs]
    h = target.embed_tokens(torch.cat([s.ids for s in seqs]))  # [R, H]
    rope = target.rope.table(torch.cat([s.positions for s in seqs])[None], h.dtype)
    if target.fused is None:
        c = target.cfg
        biases = [None if s.mask is None else
                  score_bias(s.mask[None], c.num_heads, c.num_kv_heads, h.dtype) for s in seqs]
        h, aux = target.decode_layers(h[None], aux_layer_ids, lambda i, layer, x: (
            layer.forward_many(x, rope, [s.cache.layers[i] for s in seqs], starts, biases,
                               lens)))  # [1, R, H] normed, [1, R, A]
        h, aux = h[0], None if aux is None else aux[0]
    else:
        _, h, aux = target.fused.many(h, rope.cos[0, 0], rope.sin[0, 0],
                                      [s.cache.data for s in seqs], starts, lens,
                                      [s.mask for s in seqs], aux_layer_ids)  # [R, H], [R, A]
    rows = _last_rows(h, lens) if last_only else h  # [n or R, H]
    logits = target.lm_head(rows).float()
    logits = logits.split(1) if last_only else logits.split(lens)
    auxs = aux.split(lens) if aux is not None else [None] * len(seqs)
    return [TargetOutput(lg[None], None if a is None else a[None], f[None])
            for lg, a, f in zip(logits, auxs, h.split(lens))]


def draft_forward(model: Eagle3Draft, seqs: list[SeqRows], from_target: bool,
                  last_only: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's `Eagle3Draft.forward` output (logits [1, T|1, Vd], hidden [1, T, Hd]),
    computed together: the fused C++ layers, or the dense layers' `forward_many`."""
    lens, starts = _lens(seqs), [s.start for s in seqs]
    hidden = torch.cat([s.hidden for s in seqs])  # [R, W]
    h = model.project(hidden) if from_target else hidden  # [R, Hd]
    embeds = model.embed_tokens(torch.cat([s.ids for s in seqs])).to(h.dtype)
    rope = model.rope.table(torch.cat([s.positions for s in seqs])[None], h.dtype)
    if model.fused is None:
        c = model.cfg
        biases = [None if s.mask is None else
                  score_bias(s.mask[None], c.num_heads, c.num_kv_heads, h.dtype) for s in seqs]
        h = h[None]  # [1, R, Hd]
        for i, layer in enumerate(model.layers):
            h = layer.forward_many(h, embeds[None], rope, [s.cache.layers[i] for s in seqs],
                                   starts, biases, lens)
        h = h[0]
        normed = model.norm(h)  # [R, Hd]
    else:
        h, normed, _ = model.fused.many(h, rope.cos[0, 0], rope.sin[0, 0],
                                        [s.cache.data for s in seqs], starts, lens,
                                        [s.mask for s in seqs], embeds=embeds)  # [R, Hd] each
    if model.cfg.norm_output:
        h = normed
    logits = model.lm_head(_last_rows(normed, lens) if last_only else normed).float()
    logits = logits.split(1) if last_only else logits.split(lens)
    return [(lg[None], hh[None]) for lg, hh in zip(logits, h.split(lens))]
