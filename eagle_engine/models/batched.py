"""Where a batch's rows go and what they see: the two row placements every phase runs over,
and the forwards over the rows of several requests at once that the eager one uses.

Each phase (`draft.draft_levels`, `verify.verify_forward`, `accept.extend_forward`) is defined
once over a batch of B requests with T rows each: token ids [B, T], and relative to each
request's committed length the positions (`pos` [B, T]), the cache rows (`offsets` [B, T])
and which of the rows from the committed length each token sees (`block` [B, T, W]; every
committed row is visible). A placement runs the model over such a batch:
- `OwnCaches` (the CPU, and a GPU without graphs): each request's own one-row cache, its
  committed length known on the host. Only each request's real rows run (`lens`; a ragged
  batch is padded to T, its pad rows never computed), written contiguously from the committed
  length plus the phase's `base`, and attention reads exactly the rows in use;
- `PoolSlots` (the static shapes CUDA graphs capture): the requests' rows of a `KVPool`,
  addressed by device tensors (slot, committed length), every row of the batch computed;
  attention reads each request's rows in use in place (`kernels/pool_attention.py`), or, off
  CUDA, its definition gathers whole rows (`kernels/reference.pool_attention`).
`OwnCaches` runs its requests through `target_forward` / `draft_forward`, which read each
weight once for all requests while attention runs per request over its own cache:
- fused low-bit layers (`cpu_lowbit.FusedDecoder`, the q4 target and q8 heads on CPU) do it in
  one C++ call whose row kernels give every row the same bits whatever rows run beside it;
- dense layers (`forward_many` of the layers, bf16 or fp32, CPU or GPU) do it with torch ops.
  A dense matrix product may round a row differently with a different number of rows beside
  it (fp32 on CPU switches kernels between one row and several), the same freedom a solo
  request's tree verify already has against its one-token decode; greedy answers are checked
  against solo ones in `tests/test_scheduler.py`.
Not here: the phases' logic (draft / verify / accept) or which requests run together
(`scheduler.py`, `batch_phases.py`, `cuda_graph.py`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..kernels.attention import score_bias
from ..kv_cache import CacheSlots, KVCache, KVPool
from .draft_model import Eagle3Draft
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


# per request: logits [n, V], the aux layers' inputs [n, A] or None, the final normed hidden [n, H]
TargetRows = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


class OwnCaches:
    """Each request's own one-row cache (`caches[b]`), its committed length `seq_lens[b]` known
    on the host (see the module docstring)."""

    def __init__(self, caches: list[KVCache], seq_lens: list[int]) -> None:
        self.caches, self.seq_lens = caches, seq_lens

    def subset(self, keep: list[int]) -> OwnCaches:
        """The requests `keep` (indices into this batch), in that order."""
        return OwnCaches([self.caches[b] for b in keep], [self.seq_lens[b] for b in keep])

    def _rows(self, ids: torch.Tensor, pos: torch.Tensor, base: int, block: torch.Tensor,
              lens: list[int] | None, pad_first: bool, hidden: torch.Tensor | None = None
              ) -> list[SeqRows]:
        """Each request's real rows (the first `lens[b]` of its T, or the last with `pad_first`;
        all T without `lens`) at positions seq_len + pos, written from cache row seq_len + base
        on, seeing its committed rows and its `block` columns up to its own last row. Nothing
        is uploaded: the committed lengths enter as host numbers."""
        T, seqs = ids.shape[1], []
        for b, (cache, seq) in enumerate(zip(self.caches, self.seq_lens)):
            n = T if lens is None else lens[b]
            real = slice(T - n, T) if pad_first else slice(0, n)
            mask = None  # a lone row at the committed length sees every row: no mask
            if n > 1 or base > 0:
                committed = torch.ones(n, seq, dtype=torch.bool, device=ids.device)
                mask = torch.cat([committed, block[b, real, :base + n]], dim=1)  # [n, seq+base+n]
            seqs.append(SeqRows(ids[b, real], pos[b, real] + seq, cache, seq + base, mask,
                                None if hidden is None else hidden[b, real]))
        return seqs

    def target(self, target: TargetModel, ids: torch.Tensor, pos: torch.Tensor,
               offsets: torch.Tensor, base: int, block: torch.Tensor, lens: list[int] | None,
               aux_layer_ids: tuple[int, ...]) -> list[TargetRows]:
        """The target over each request's real rows (the first `lens[b]`) -> per request
        its rows' outputs. `offsets` is for the static placement (here the real rows are
        contiguous from `base`). A request alone runs the target's own forward (the same
        computation, a few ops fewer than the batched one)."""
        seqs = self._rows(ids, pos, base, block, lens, pad_first=False)
        if len(seqs) == 1:
            s = seqs[0]
            outs = [target(s.ids[None], s.positions[None], s.cache, s.start,
                           None if s.mask is None else s.mask[None], aux_layer_ids)]
        else:
            outs = target_forward(target, seqs, aux_layer_ids)
        return [(o.logits[0], None if o.aux_hidden is None else o.aux_hidden[0],
                 o.final_hidden[0]) for o in outs]

    def draft(self, model: Eagle3Draft, ids: torch.Tensor, hidden: torch.Tensor,
              pos: torch.Tensor, offsets: torch.Tensor, base: int, block: torch.Tensor,
              lens: list[int] | None, from_target: bool, last_only: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over each request's real rows (the last `lens[b]`: pads come first) ->
        (logits [B, T|1, Vd], hidden [B, T|1, Hd]); a ragged batch (`lens`) needs
        `last_only`."""
        seqs = self._rows(ids, pos, base, block, lens, pad_first=True, hidden=hidden)
        outs = draft_forward(model, seqs, from_target, last_only)
        if last_only:
            outs = [(lg, h[:, -1:]) for lg, h in outs]
        if len(outs) == 1:
            return outs[0]
        return torch.cat([lg for lg, _ in outs]), torch.cat([h for _, h in outs])


class PoolSlots:
    """The requests' rows `slots` [B] of a `KVPool`, committed lengths `seq_len` [B], both
    device tensors (see the module docstring).
    `kernel`: attention reads the rows in use in place (`kernels/pool_attention.py`, on
    CUDA); else its definition gathers whole rows (`kernels/reference.pool_attention`)."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, seq_len: torch.Tensor,
                 kernel: bool) -> None:
        self.pool, self.slots, self.seq_len, self.kernel = pool, slots, seq_len, kernel

    def _at(self, offsets: torch.Tensor, block: torch.Tensor) -> CacheSlots:
        """Where the batch writes (rows [B, T]) and what it attends over."""
        return CacheSlots(self.slots, self.seq_len[:, None] + offsets, self.seq_len, block,
                          self.kernel)

    def target(self, target: TargetModel, ids: torch.Tensor, pos: torch.Tensor,
               offsets: torch.Tensor, base: int, block: torch.Tensor, lens: list[int] | None,
               aux_layer_ids: tuple[int, ...]) -> list[TargetRows]:
        """Every row of the batch -> per request its T rows' outputs (views)."""
        out = target(ids, self.seq_len[:, None] + pos, self.pool, 0, None, aux_layer_ids,
                     at=self._at(offsets, block))
        aux = [None] * ids.shape[0] if out.aux_hidden is None else out.aux_hidden.unbind(0)
        return list(zip(out.logits.unbind(0), aux, out.final_hidden.unbind(0)))

    def draft(self, model: Eagle3Draft, ids: torch.Tensor, hidden: torch.Tensor,
              pos: torch.Tensor, offsets: torch.Tensor, base: int, block: torch.Tensor,
              lens: list[int] | None, from_target: bool, last_only: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = model(ids, hidden, self.seq_len[:, None] + pos, self.pool, 0, None,
                          from_target, last_only, at=self._at(offsets, block))
        return logits, h[:, -1:] if last_only else h


Placement = OwnCaches | PoolSlots
