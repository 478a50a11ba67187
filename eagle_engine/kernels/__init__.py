"""Tree bookkeeping kernels: Triton on CUDA when triton imports, the torch references otherwise.

The Triton modules are imported lazily, on the first CUDA call, so the CPU path never imports
triton. Every function keeps the reference's signature and results (tests/test_kernels.py).
"""
from __future__ import annotations

import importlib.util
from functools import cache

import torch

from . import reference


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [N] -> depth [N], ancestors [N, N] bool, retrieve [N, max_depth+1]."""
    if use_triton(parents):
        from .tree_build import build_tree_from_parents as kernel

        return kernel(parents.contiguous(), max_depth)
    return reference.build_tree_from_parents(parents, max_depth)


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                       depth: torch.Tensor, target_predict: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (best node, accept length) as 0-dim int64 tensors."""
    if use_triton(tokens):
        from .verify_greedy import verify_tree_greedy as kernel

        return kernel(tokens.contiguous(), parents.contiguous(), ancestors.contiguous(),
                      depth.contiguous(), target_predict.contiguous())
    return reference.verify_tree_greedy(tokens, parents, ancestors, depth, target_predict)


def compact_kv(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
    """Rows `src_rows` of cache [B, H, max_len, d] -> [dst_start, dst_start+n), in place."""
    if use_triton(cache):
        from .kv_compact import compact_kv as kernel

        kernel(cache, src_rows.contiguous(), dst_start)
        return
    reference.compact_kv(cache, src_rows, dst_start)


__all__ = ["build_tree_from_parents", "compact_kv", "triton_available", "use_triton",
           "verify_tree_greedy"]
