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
        `at.rows[b]` of pool row `at.slots[b]` and attends over that whole row (mask
        [B, T, max_len])."""
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
            keys, values = k_cache.index_select(0, at.slots), v_cache.index_select(0, at.slots)
        return attend(q, keys.to(q.dtype), values.to(q.dtype), bias)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, hd] -> [B, T, hidden]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def grouped_queries(T: int, device: torch.device) -> bool:
    """Whether `attend` groups the queries by KV head: all but long queries (prefill) on CPU."""
    return device.type != "cpu" or T <= 64


def score_bias(mask: torch.Tensor | None, num_heads: int, num_kv_heads: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean mask [B, T, S] (True = visible) -> the additive bias `attend` adds to the scores
    (0 or -inf, in the model dtype), in `attend`'s row order: [B, 1, g*T, S] with rows (group,
    query) when queries are grouped (g = num_heads // num_kv_heads), else [B, 1, T, S]. Built
    once per forward, like the RoPE table, so no layer converts or expands the mask itself."""
    if mask is None:
        return None
    B, T, S = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))  # [B, T, S]
    if not grouped_queries(T, mask.device):
        return bias[:, None]
    g = num_heads // num_kv_heads
    return bias[:, None, None].expand(B, 1, g, T, S).reshape(B, 1, g * T, S)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, T, d], k/v [B, KVH, S, d], bias = `score_bias(mask)` or None -> [B, H, T, d].
    Short queries (decode, tree verify, draft steps) are grouped by their KV head
    ([B, KVH, g*T, d], g = H // KVH) and run SDPA on the groups: no backend copies the keys once
    per query head (SDPA's own GQA mode with a mask can fall back, on GPU, to the math kernel
    that repeats the KV cache per query head), and on CPU in bf16 PyTorch's flash kernel (fp32
    scores and softmax, probabilities rounded to bf16 for the product with the values, no
    per-shape setup) is ~3x faster than fp32 matmuls.
    Short fp32 queries on CPU use grouped fp32 matmuls instead: fp32 SDPA pays a kernel setup
    for every new key length, and the key length changes every step. Long queries on CPU
    (prefill) use SDPA's GQA mode."""
    B, H, T, d = q.shape
    kvh = k.shape[1]  # k [B, KVH, S, d]
    g = H // kvh
    if not grouped_queries(T, q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=H != kvh)
    qg = q.reshape(B, kvh, g * T, d)  # rows ordered (group, query)
    if q.device.type != "cpu" or q.dtype == torch.bfloat16:
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias).reshape(B, H, T, d)
    scores = (qg.float() @ k.float().transpose(-1, -2)) * d ** -0.5  # [B, KVH, g*T, S]
    if bias is not None:
        scores = scores + bias
    out = (scores.softmax(-1) @ v.float()).to(q.dtype)
    return out.view(B, kvh, g, T, d).reshape(B, H, T, d)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
