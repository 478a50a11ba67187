"""Tree bookkeeping and sampling kernels: Triton on CUDA when triton imports, C++ on a CPU once
the q4 weights have loaded the CPU kernels (`cpu_step.cpp`), the torch references otherwise.

The Triton modules are imported lazily, on the first CUDA call, so the CPU path never imports
triton. Every function keeps the reference's signature and results (tests/test_kernels.py,
tests/test_cpu_step.py).
"""
from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType

import torch

from . import cpu_lowbit, reference


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def cpu_step(t: torch.Tensor) -> ModuleType | None:
    """For a CPU tensor, the CPU kernels' module once this process has loaded it, else None."""
    return cpu_lowbit.built() if t.device.type == "cpu" else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> ids [...] of each row's first maximum."""
    cpu = cpu_step(logits)
    if cpu is not None and logits.dtype == torch.float32 and logits.numel():
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()
        return cpu.argmax_rows(flat).view(logits.shape[:-1])
    return reference.argmax_rows(logits)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                   ) -> torch.Tensor:
    """logits [M, V] float32 -> probabilities [M, V] (temperature > 0; top_k 0 and top_p 1:
    off). The plain sampler and tree acceptance both call this, so they share one distribution."""
    cpu = cpu_step(logits)
    if cpu is not None and logits.dtype == torch.float32:
        return cpu.sampling_probs(logits.contiguous(), temperature, top_k, top_p)
    return reference.sampling_probs(logits, temperature, top_k, top_p)


def sample_rows(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """probs [M, V] float32, coins [M] float32 in [0, 1) -> ids [M] by inverse CDF."""
    cpu = cpu_step(probs)
    if cpu is not None and probs.dtype == torch.float32:
        return cpu.sample_rows(probs.contiguous(), coins.contiguous())
    return reference.sample_rows(probs, coins)


def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [N] -> depth [N], ancestors [N, N] bool, retrieve [N, max_depth+1]."""
    if use_triton(parents):
        from .tree_build import build_tree_from_parents as kernel

        return kernel(parents.contiguous(), max_depth)
    cpu = cpu_step(parents)
    if cpu is not None:
        return tuple(cpu.tree_from_parents(parents.contiguous(), max_depth))
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
    cpu = cpu_step(cache)
    if cpu is not None and cache.is_contiguous():
        cpu.compact_rows(cache, src_rows.contiguous(), dst_start)
        return
    reference.compact_kv(cache, src_rows, dst_start)


__all__ = ["argmax_rows", "build_tree_from_parents", "compact_kv", "cpu_step", "sample_rows",
           "sampling_probs", "triton_available", "use_triton", "verify_tree_greedy"]
