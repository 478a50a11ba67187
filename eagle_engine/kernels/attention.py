"""Attention over explicit keys and values: `attend` (GQA, additive mask) and the mask's
additive form (`score_bias`), shared by the model layers and by the torch definition of
attention over a KV pool (`reference.pool_attention`). Which kernel SDPA or the matmuls pick
per device and dtype is said at `attend`. Not here: caches, masks' meaning (`kv_cache.py`,
the phases) or the Triton pool kernel (`pool_attention.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
