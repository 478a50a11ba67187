"""Building blocks shared by the target and the draft: RMSNorm, RoPE, GQA attention (optionally
with Qwen3's per-head q/k RMSNorm), SwiGLU MLP.

Attention takes explicit positions, an explicit KV cache slice and an explicit boolean mask; it
keeps no state of its own. Weights are fused (qkv, gate_up) so a decode step is few kernels.
Not here: how masks are built (engine phases) or where cache rows live (`kv_cache.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import reference
from ..kernels.attention import attend
from ..kv_cache import CacheSlots


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with `llama3` or `linear` scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float()
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.float()


class Rope(nn.Module):
    """Precomputed cos/sin tables for `max_len` positions (sized to the target's context)."""

    def __init__(self, head_dim: int, max_len: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_len, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_len, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """Look up cos/sin once per forward for positions [B, T]; every layer reuses them."""
        return RopeTable(self.cos[positions].unsqueeze(1).to(dtype),  # [B, 1, T, hd]
                         self.sin[positions].unsqueeze(1).to(dtype))


@dataclass(slots=True)
class RopeTable:
    cos: torch.Tensor  # [B, 1, T, head_dim]
    sin: torch.Tensor  # [B, 1, T, head_dim]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, hd] -> rotated x."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


class Attention(nn.Module):
    """GQA self-attention over an external KV cache. `in_dim` is 2*hidden for the EAGLE input layer.
    `qk_norm_eps` (Qwen3) adds `q_norm` / `k_norm`: RMSNorms over head_dim, each head of q and k
    normed before RoPE; None (Llama, Qwen2, the heads) has neither."""

    def __init__(self, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, bias: bool, qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        out = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_proj = nn.Linear(in_dim, out, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        qk_norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeTable,
                kv: tuple[torch.Tensor, torch.Tensor], start: int,
                bias: torch.Tensor | None, at: CacheSlots | None = None) -> torch.Tensor:
        """x [B, T, in_dim]; kv = (k, v) caches [B, kv_heads, max_len, hd] of this layer.
        New keys/values are written at cache rows [start, start+T); attention reads rows
        [0, start+T) under `bias` = `score_bias(mask)` of a mask [B, T, start+T] (None =
        every row visible). With `at` (static shapes for CUDA graphs) kv is a `KVPool`'s layer
        ([slots + 1, kv_heads, max_len, hd]) and `start` is ignored: sequence b writes its rows
        `at.rows[b]` of pool row `at.slots[b]` and attends over that row as `at` says (the
        Triton kernel with `at.kernel`, else its torch definition; `bias` unused)."""
        q, k, v = self._project(x, rope)
        return self._output(self._cached(q, k, v, kv, start, bias, at))

    def forward_many(self, x: torch.Tensor, rope: RopeTable,
                     kvs: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int],
                     biases: list[torch.Tensor | None], lens: list[int]) -> torch.Tensor:
        """Several sequences' rows one after the other, x [1, R, in_dim] (R = sum(lens)), each
        attending over its own cache `kvs[i]` from row `starts[i]` under `biases[i]` (as in
        `forward`): the projections read their weights once for all rows."""
        if len(lens) == 1:
            return self.forward(x, rope, kvs[0], starts[0], biases[0])
        q, k, v = self._project(x, rope)  # [1, heads, R, hd] each
        outs = [self._cached(qi, ki, vi, kv, start, bias) for qi, ki, vi, kv, start, bias in
                zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2), kvs, starts, biases)]
        return self._output(torch.cat(outs, dim=2))

    def _project(self, x: torch.Tensor, rope: RopeTable
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in_dim] -> q [B, H, T, hd], k and v [B, KVH, T, hd], q and k rotated."""
        B, T, _ = x.shape
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, heads, self.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        qk = qkv[:, :self.num_heads + self.num_kv_heads]  # [B, heads + kv_heads, T, hd]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = rope.apply(qk)  # one rotation for q and k
        return qk[:, :self.num_heads], qk[:, self.num_heads:], \
            qkv[:, self.num_heads + self.num_kv_heads:]

    @staticmethod
    def _cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], start: int, bias: torch.Tensor | None,
                at: CacheSlots | None = None) -> torch.Tensor:
        """Write k/v [B, KVH, T, hd] into the cache and attend q [B, H, T, hd] over it
        (`forward` says which rows) -> [B, H, T, hd]."""
        B, T = q.shape[0], q.shape[2]
        k_cache, v_cache = kv  # in the model's dtype, or float16 (a q4 target's, read widened)
        if at is None:
            k_cache[:B, :, start:start + T] = k
            v_cache[:B, :, start:start + T] = v
            keys, values = k_cache[:B, :, :start + T], v_cache[:B, :, :start + T]
        else:
            rows = (at.slots[:, None], slice(None), at.rows)  # indexes [B, T, KVH, hd]
            k_cache[rows] = k.transpose(1, 2).to(k_cache.dtype)
            v_cache[rows] = v.transpose(1, 2).to(v_cache.dtype)
            if at.kernel:  # CUDA: the rows in use, read in place
                from ..kernels.pool_attention import pool_attention

                return pool_attention(q, k_cache, v_cache, at.slots, at.seq_len, at.block)
            return reference.pool_attention(q, k_cache, v_cache, at.slots, at.seq_len, at.block)
        return attend(q, keys.to(q.dtype), values.to(q.dtype), bias)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, hd] -> [B, T, hidden]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
