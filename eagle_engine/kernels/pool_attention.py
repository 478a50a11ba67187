"""Triton kernel: attention of a static batch over its requests' rows of a KV pool, in place.

Request b's queries (q [B, H, T, d]) attend over pool row `slots[b]` of the cache (k, v
[rows, KVH, L, d]): every committed row (< seq_len[b]) and, of the W rows from seq_len[b],
those its `block` [B, T, W] shows each query. One program per (request, KV head, block of
that head's grouped queries) reads only the rows [0, seq_len + W) of its request's pool row,
a bound it reads on the device (so a CUDA graph replays it at any length), with an online
softmax in fp32; no row is copied. Must match `reference.pool_attention` (the gather of whole
rows under the mask `reference.block_mask`) to rounding (tests/test_kernels.py, through the
Triton interpreter on a CPU). Not here: writing the new rows (`layers.Attention`), or which
backend runs (`CacheSlots.kernel`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys a loop step


@triton.jit
def _pool_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, seq_ptr, block_ptr,
                           sq_b, sq_h, sq_t, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l,
                           so_b, so_h, so_t, sb_b, sb_t, T, W, L, G, D, scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # query row of this KV head's group
    m_ok = m < G * T
    head = kvh * G + m // T  # [BLOCK_M] its query head
    t = m % T  # [BLOCK_M] its token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    slot = tl.load(slots_ptr + b)
    seq = tl.load(seq_ptr + b)
    end = tl.minimum(seq + W, L)  # the rows in use
    k_base = k_ptr + slot * sk_s + kvh * sk_h
    v_base = v_ptr + slot * sv_s + kvh * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + n[:, None] * sv_l + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        rel = n - seq  # [BLOCK_N] row from the committed length
        inside = (rel >= 0) & (rel < W) & n_ok
        shown = tl.load(block_ptr + b * sb_b + t[:, None] * sb_t + rel[None, :],
                        mask=m_ok[:, None] & inside[None, :], other=0)
        visible = ((n < seq)[None, :] | (shown != 0)) & n_ok[None, :]
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + head[:, None] * so_h + t[:, None] * so_t + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def pool_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   seq_len: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, d]; k, v [rows, KVH, L, d] (a `KVPool` layer); slots, seq_len [B] int64;
    block [B, T, W] bool -> [B, H, T, d] in q's dtype; no host sync."""
    B, H, T, D = q.shape
    _, KVH, L, _ = k.shape
    W = block.shape[-1]
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1, (q.stride(), k.stride(), v.stride())
    assert H % KVH == 0 and block.shape[:2] == (B, T), (q.shape, k.shape, block.shape)
    G = H // KVH
    block = block.contiguous().view(torch.uint8)
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    block_m = max(16, min(64, triton.next_power_of_2(G * T)))
    grid = (B, KVH, triton.cdiv(G * T, block_m))
    _pool_attention_kernel[grid](
        q, k, v, out, slots, seq_len, block, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), block.stride(0), block.stride(1),
        T, W, L, G, D, D ** -0.5, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), IEEE=q.dtype == torch.float32)
    return out
