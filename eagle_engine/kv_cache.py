"""Preallocated static KV cache with explicit verbs, plus the attention masks that index it.

A cache holds, per layer, keys and values `[batch, kv_heads, max_len, head_dim]` (views of one
tensor, in the dtype its model's `new_cache` asks for: the model's own, or float16 for the fused
low-bit CPU layers); the model writes rows at the `start` it is given and never tracks lengths
itself. The engine owns the committed length. `commit_rows` moves accepted tree rows next to
the committed prefix (rejected rows are simply left behind and overwritten later; nothing else
is copied), without a host read. `KVPool` holds several requests' caches (and a scratch row)
in one tensor for CUDA graphs: each request's row is an ordinary one-request `KVCache`, and a
static-shape forward writes and reads every request's rows through `CacheSlots`.
Not here: which rows are accepted (`verify.py`) or tree structure (`tree.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import TORCH, StepOps


@dataclass(slots=True)
class CacheSlots:
    """Where a static-shape forward over a `KVPool` writes and what it attends over: sequence
    b writes its token t at cache row `rows[b, t]` of the pool's batch row `slots[b]`, and
    attends over that row: its committed rows (< seq_len[b]) and, of the W rows from there,
    those `block` shows each token. `kernel`: attention reads the rows in use in place
    (`kernels/pool_attention.py`, CUDA); else its definition gathers whole rows
    (`kernels/reference.pool_attention`)."""

    slots: torch.Tensor  # [B] int64 the pool's batch row of each sequence
    rows: torch.Tensor  # [B, T] int64 the cache row each token is written to
    seq_len: torch.Tensor  # [B] int64 committed rows of each sequence
    block: torch.Tensor  # [B, T, W] bool which rows from seq_len each token sees
    kernel: bool = False


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        # one tensor for every layer's keys and values, so a commit is one gather and one write
        self._bind(torch.zeros(num_layers * 2 * batch, num_kv_heads, max_len, head_dim,
                               dtype=dtype, device=device), batch)  # [(layer, k|v, batch), ...]

    @classmethod
    def over(cls, data: torch.Tensor) -> KVCache:
        """A one-request cache on existing storage `data` [layers * 2, kvh, len, hd]."""
        cache = cls.__new__(cls)
        cache._bind(data, 1)
        return cache

    def _bind(self, data: torch.Tensor, batch: int) -> None:
        self.data = data  # [(layer, k|v, batch), kvh, len, hd]
        self.max_len = data.shape[2]
        rows = [data[i * batch:(i + 1) * batch] for i in range(data.shape[0] // batch)]
        self.layers = list(zip(rows[0::2], rows[1::2]))  # per layer (k, v) [B, kvh, len, hd]

    def keep_batch_rows(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding only the batch rows `rows` [n] (in that order) of this one."""
        L2, B = len(self.layers) * 2, self.layers[0][0].shape[0]
        _, kvh, max_len, hd = self.data.shape
        kept = KVCache(L2 // 2, rows.numel(), kvh, max_len, hd, self.data.dtype, self.data.device)
        kept.data.view(L2, rows.numel(), kvh, max_len, hd).copy_(
            self.data.view(L2, B, kvh, max_len, hd)[:, rows])
        return kept

    def commit_rows(self, src_rows: torch.Tensor, dst_start: int, ops: StepOps = TORCH
                    ) -> None:
        """Copy rows `src_rows` [n] (any order, all >= dst_start) to [dst_start, dst_start+n),
        with `ops.compact_kv`. On a GPU it copies every row, even rows already in place:
        checking would read the rows on the host. The C++ op (`cpu_step.cpp`) reads them
        there anyway and skips them."""
        ops.compact_kv(self.data, src_rows, dst_start)


class KVPool:
    """`slots` request caches and one scratch cache in one batch-major tensor. `row(r)` is
    request r's cache, laid out as a one-request `KVCache` (so prefill, the prefix cache and
    commits use it as any other); `layers` gives every row's keys and values per layer, for a
    forward over `CacheSlots`. The scratch row (`scratch`, the last) is where the padding of a
    static batch writes; no request reads it."""

    def __init__(self, num_layers: int, slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.max_len, self.scratch = max_len, slots
        self.data = torch.zeros(slots + 1, num_layers * 2, num_kv_heads, max_len, head_dim,
                                dtype=dtype, device=device)  # [row, (layer, k|v), kvh, len, hd]
        self.layers = [(self.data[:, 2 * i], self.data[:, 2 * i + 1])
                       for i in range(num_layers)]  # per layer (k, v) [slots + 1, kvh, len, hd]

    def row(self, r: int) -> KVCache:
        return KVCache.over(self.data[r])


def causal_mask(T: int, start: int, device: torch.device | str,
                valid_from: torch.Tensor | None = None) -> torch.Tensor:
    """[B or 1, T, start+T] bool: row i sees cache rows [0, start+i]. `valid_from` [B] hides the
    left padding of ragged batches (cache rows before it), except the row's own position."""
    rows = torch.arange(start, start + T, device=device)[:, None]
    cols = torch.arange(start + T, device=device)[None, :]
    mask = (cols <= rows)[None]  # [1, T, S]
    if valid_from is not None:
        mask = mask & (cols[None] >= valid_from[:, None, None])
        mask = mask | (cols[None] == rows[None])
    return mask


def tree_mask(ancestors: torch.Tensor, start: int) -> torch.Tensor:
    """ancestors [N, N] bool (ancestor-or-self) -> [1, N, start+N]: full prefix + tree block."""
    N = ancestors.shape[0]
    prefix = torch.ones(N, start, dtype=torch.bool, device=ancestors.device)
    return torch.cat([prefix, ancestors], dim=1)[None]
