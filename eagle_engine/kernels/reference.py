"""Pure-torch references for the tree bookkeeping kernels. A CPU runs these until the q4 weights
have loaded the C++ kernels (`cpu_step.cpp`); the Triton and C++ kernels in this package must
match them exactly (tests/test_kernels.py, tests/test_cpu_step.py)."""
from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> ids [...] of each row's first maximum (NaN first where a row holds
    one); `max(-1)` is ~2.5-3x faster than `argmax` on CPU for the target's 49152-token rows
    (`benchmarks/step_ops.py`)."""
    return logits.max(-1).indices


def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [N] (-1 for the root, parent index < child index) ->
    depth [N] int64, ancestors [N, N] bool (ancestor-or-self), retrieve [N, min(N, max_depth+1)]
    int64 (root->node path of node indices, -1 padded)."""
    N = parents.numel()
    dev = parents.device
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    has_parent = (parents >= 0)[:, None]
    ancestors = eye
    for _ in range(max_depth):
        ancestors = eye | (ancestors[parents.clamp_min(0)] & has_parent)
    depth = ancestors.sum(1) - 1
    cols = torch.arange(N, device=dev).expand(N, N)
    path = torch.where(ancestors, cols, N).sort(dim=1).values[:, :max_depth + 1]
    retrieve = torch.where(path == N, -1, path)
    return depth, ancestors, retrieve


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                       depth: torch.Tensor, target_predict: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root path whose every token equals the target's argmax after its parent.
    tokens/parents/depth/target_predict [N] -> (best node, accept length = its depth)."""
    correct = tokens == target_predict[parents.clamp_min(0)]
    correct[0] = True
    ok = ~(ancestors & ~correct[None, :]).any(-1)  # [N] every node on the path is correct
    best = torch.where(ok, depth, -1).argmax()
    return best, depth.index_select(0, best.reshape(1)).reshape(())  # no host read of `best`


def compact_kv(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
    """cache [B, H, max_len, d]: rows `src_rows` [n] (>= dst_start) -> [dst_start, dst_start+n)."""
    n = src_rows.numel()
    cache[:, :, dst_start:dst_start + n] = cache[:, :, src_rows]
