"""Triton kernel: tree bookkeeping from a parent array (ancestor mask, depth, retrieve indices).

One program per node walks up to `max_depth` parent links, so the whole tree is built in one
launch with no host round trip. Must match `reference.build_tree_from_parents` exactly
(tests/test_kernels.py). Not here: choosing the tree (`tree.py`) or dispatch (`__init__.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_build_kernel(parents_ptr, depth_ptr, ancestors_ptr, retrieve_ptr, N, width,
                       MAX_DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    on_path = cols < 0  # [BLOCK_N] all False: ancestors-or-self of node i
    node = i.to(tl.int64)
    for _ in range(MAX_DEPTH + 1):  # self, then up to MAX_DEPTH parent links (the reference's)
        live = node >= 0
        on_path = on_path | ((cols == node) & live)
        parent = tl.load(parents_ptr + tl.maximum(node, 0))
        node = tl.where(live, parent, -1)
    count = tl.sum(on_path.to(tl.int32), axis=0)
    tl.store(depth_ptr + i, (count - 1).to(tl.int64))
    tl.store(ancestors_ptr + i * N + cols, on_path.to(tl.uint8), mask=cols < N)
    # parents precede children, so ascending node index is root -> node order
    rank = tl.cumsum(on_path.to(tl.int32), axis=0) - 1  # [BLOCK_N] slot of each path node
    slots = tl.arange(0, BLOCK_D)
    hit = on_path[None, :] & (rank[None, :] == slots[:, None])  # [BLOCK_D, BLOCK_N]
    path = tl.max(tl.where(hit, cols[None, :], -1), axis=1)  # [BLOCK_D] node index or -1
    tl.store(retrieve_ptr + i * width + slots, path.to(tl.int64), mask=slots < width)


def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [N] int64 (-1 for the root, parent index < child index) ->
    depth [N] int64, ancestors [N, N] bool (ancestor-or-self), retrieve [N, W] int64 with
    W = min(N, max_depth+1) (a tree of N nodes is at most N-1 deep), -1 padded."""
    assert parents.dim() == 1 and parents.dtype == torch.int64, (parents.shape, parents.dtype)
    assert parents.is_contiguous() and max_depth >= 0, max_depth
    N = parents.numel()
    dev = parents.device
    depth = torch.empty(N, dtype=torch.int64, device=dev)  # [N]
    ancestors = torch.empty(N, N, dtype=torch.bool, device=dev)  # [N, N]
    width = min(N, max_depth + 1)
    retrieve = torch.empty(N, width, dtype=torch.int64, device=dev)  # [N, W]
    _tree_build_kernel[(N,)](parents, depth, ancestors.view(torch.uint8), retrieve, N, width,
                             MAX_DEPTH=max_depth, BLOCK_N=triton.next_power_of_2(N),
                             BLOCK_D=triton.next_power_of_2(width))
    return depth, ancestors, retrieve
