"""Triton kernel: KV compaction, moving accepted tree rows next to the committed prefix in place.

One program per (batch, head, head_dim block) gathers every accepted row into registers, waits
for all its threads, then scatters them to [dst_start, dst_start+n): sources may be in any order
and may overlap the destination, as in the reference (which gathers before it writes). Must
match `reference.compact_kv` exactly. Not here: which rows are accepted or dispatch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 1024  # rows one launch moves; an iteration commits at most num_steps + 1


@triton.jit
def _kv_compact_kernel(cache_ptr, src_ptr, n, dst_start, num_heads, stride_b, stride_h,
                       stride_row, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    base = cache_ptr + (pid // num_heads) * stride_b + (pid % num_heads) * stride_h
    r = tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (r[:, None] < n) & (d[None, :] < head_dim)  # [BLOCK_R, BLOCK_D]
    src = tl.load(src_ptr + r, mask=r < n, other=0)  # [BLOCK_R] source rows
    rows = tl.load(base + src[:, None] * stride_row + d[None, :], mask=ok)
    tl.debug_barrier()  # every source row is read before any destination row is written
    dst = (dst_start + r).to(tl.int64)
    tl.store(base + dst[:, None] * stride_row + d[None, :], rows, mask=ok)


def compact_kv(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
    """cache [B, H, max_len, d]: rows `src_rows` [n] int64 (>= dst_start, < max_len, any order)
    -> [dst_start, dst_start+n), in place; no host sync."""
    assert cache.dim() == 4 and cache.stride(3) == 1, (cache.shape, cache.stride())
    assert src_rows.dim() == 1 and src_rows.dtype == torch.int64, (src_rows.shape, src_rows.dtype)
    assert src_rows.is_contiguous() and src_rows.device == cache.device, src_rows.device
    B, H, max_len, head_dim = cache.shape
    n = src_rows.numel()
    assert n <= MAX_ROWS and 0 <= dst_start and dst_start + n <= max_len, (n, dst_start, max_len)
    if n == 0:
        return
    block_r = triton.next_power_of_2(n)
    block_d = min(triton.next_power_of_2(head_dim), max(16, 8192 // block_r))
    grid = (B * H, triton.cdiv(head_dim, block_d))
    _kv_compact_kernel[grid](cache, src_rows, n, dst_start, H, cache.stride(0), cache.stride(1),
                             cache.stride(2), head_dim, BLOCK_R=block_r, BLOCK_D=block_d)
