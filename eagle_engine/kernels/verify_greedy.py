"""Triton kernel: greedy tree verification (best accepted node and its accept length).

A single program scores the whole tree: node j is correct when its token equals the target's
argmax after its parent; a node is acceptable when every node on its root path is correct; the
deepest acceptable node wins, first index on ties. The ancestor mask is read in column blocks
so registers stay bounded for large trees. Must match `reference.verify_tree_greedy` exactly.
Not here: turning the best node into a token path (`verify.py`) or dispatch (`__init__.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_greedy_kernel(tokens_ptr, parents_ptr, ancestors_ptr, depth_ptr, predict_ptr,
                          out_ptr, N, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)
    row_ok = rows < N
    bad = rows < 0  # [BLOCK_N] all False: some node on the row's path is wrong
    for j0 in range(0, N, BLOCK_J):
        cols = j0 + tl.arange(0, BLOCK_J)
        col_ok = cols < N
        parent = tl.maximum(tl.load(parents_ptr + cols, mask=col_ok, other=0), 0)
        token = tl.load(tokens_ptr + cols, mask=col_ok, other=0)
        predicted = tl.load(predict_ptr + parent, mask=col_ok, other=0)
        wrong = (token != predicted) & (cols != 0) & col_ok  # [BLOCK_J] the root is always right
        anc = tl.load(ancestors_ptr + rows[:, None] * N + cols[None, :],
                      mask=row_ok[:, None] & col_ok[None, :], other=0)  # [BLOCK_N, BLOCK_J]
        hits = ((anc != 0) & wrong[None, :]).to(tl.int32)
        bad = bad | (tl.max(hits, axis=1) != 0)
    depth = tl.load(depth_ptr + rows, mask=row_ok, other=0)
    score = tl.where(row_ok & ~bad, depth, -1)  # [BLOCK_N]
    best_depth, best = tl.max(score, axis=0, return_indices=True,
                              return_indices_tie_break_left=True)  # first index on ties
    tl.store(out_ptr, best.to(tl.int64))
    tl.store(out_ptr + 1, best_depth.to(tl.int64))


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                       depth: torch.Tensor, target_predict: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/parents/depth/target_predict [N] int64, ancestors [N, N] bool ->
    (best node, accept length = its depth), both 0-dim int64 on the device; no host sync."""
    N = tokens.numel()
    for name, t in (("tokens", tokens), ("parents", parents), ("depth", depth),
                    ("target_predict", target_predict)):
        assert t.shape == (N,) and t.dtype == torch.int64 and t.is_contiguous(), (name, t.shape,
                                                                                  t.dtype)
        assert t.device == tokens.device, (name, t.device)
    assert ancestors.shape == (N, N) and ancestors.dtype == torch.bool, ancestors.shape
    assert ancestors.is_contiguous() and ancestors.device == tokens.device
    out = torch.empty(2, dtype=torch.int64, device=tokens.device)  # [best, accept length]
    _verify_greedy_kernel[(1,)](tokens, parents, ancestors.view(torch.uint8), depth,
                                target_predict, out, N, BLOCK_N=triton.next_power_of_2(N),
                                BLOCK_J=min(16, triton.next_power_of_2(N)))
    return out[0], out[1]
