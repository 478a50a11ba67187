"""The step backends: the per-iteration bookkeeping and sampling ops an engine runs, chosen once
per engine and held by it (`EagleEngine.ops`), never from process-wide state.

    TORCH   the definitions (`reference.py`), on any device
    TRITON  on CUDA: tree building, greedy verification and KV compaction as Triton kernels
            (`tree_build.py`, `verify_greedy.py`, `kv_compact.py`), the rest as TORCH
    cpp     on a CPU with the q4 kernels built (`cpu_step.cpp`, one module with the q4 layers):
            every op, plus tree selection and acceptance as one C++ call each (`tree_input`,
            `greedy_accept`, `sampled_accept`)

Each faster op keeps the definition's signature and results (tests/test_kernels.py,
tests/test_cpu_step.py). The Triton modules are imported on the first call, so the CPU path
never imports triton.
Not here: what the ops compute for a tree (`tree.py`, `verify.py`, `sampling.py`).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from . import cpu_lowbit, reference


@dataclass(frozen=True)
class StepOps:
    """One backend's ops; `cpp`: the C++ step module, whose one-call tree selection and
    acceptance the tree and verify phases take when it is there."""

    name: str
    argmax_rows: Callable[[torch.Tensor], torch.Tensor]  # logits [..., V] -> ids [...]
    # logits [M, V] float32, temperature, top_k, top_p -> probabilities [M, V]
    sampling_probs: Callable[[torch.Tensor, float, int, float], torch.Tensor]
    # probs [M, V] float32, coins [M] -> ids [M] by inverse CDF
    sample_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # parents [N], max_depth -> depth [N], ancestors [N, N] bool, retrieve [N, max_depth+1]
    build_tree_from_parents: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
    # tokens, parents, ancestors, depth, target_predict -> (best node, accept length)
    verify_tree_greedy: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # cache [B, H, max_len, d], src_rows [n], dst_start -> rows moved in place
    compact_kv: Callable[[torch.Tensor, torch.Tensor, int], None]
    cpp: ModuleType | None = None


TORCH = StepOps("torch", reference.argmax_rows, reference.sampling_probs,
                reference.sample_rows, reference.build_tree_from_parents,
                reference.verify_tree_greedy, reference.compact_kv)


def _tree_build(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, ...]:
    from .tree_build import build_tree_from_parents

    return build_tree_from_parents(parents.contiguous(), max_depth)


def _verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                   depth: torch.Tensor, target_predict: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    from .verify_greedy import verify_tree_greedy

    return verify_tree_greedy(tokens.contiguous(), parents.contiguous(), ancestors.contiguous(),
                              depth.contiguous(), target_predict.contiguous())


def _compact(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
    from .kv_compact import compact_kv

    compact_kv(cache, src_rows.contiguous(), dst_start)


TRITON = StepOps("triton", reference.argmax_rows, reference.sampling_probs,
                 reference.sample_rows, _tree_build, _verify_greedy, _compact)


def cpp_ops(cpu: ModuleType) -> StepOps:
    """The C++ ops of the built module `cpu` (float32 logits; other dtypes take the
    definitions)."""

    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or not logits.numel():
            return reference.argmax_rows(logits)
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()
        return cpu.argmax_rows(flat).view(logits.shape[:-1])

    def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                       ) -> torch.Tensor:
        if logits.dtype != torch.float32:
            return reference.sampling_probs(logits, temperature, top_k, top_p)
        return cpu.sampling_probs(logits.contiguous(), temperature, top_k, top_p)

    def sample_rows(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
        if probs.dtype != torch.float32:
            return reference.sample_rows(probs, coins)
        return cpu.sample_rows(probs.contiguous(), coins.contiguous())

    def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                                ) -> tuple[torch.Tensor, ...]:
        return tuple(cpu.tree_from_parents(parents.contiguous(), max_depth))

    def compact_kv(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
        if not cache.is_contiguous():
            return reference.compact_kv(cache, src_rows, dst_start)
        cpu.compact_rows(cache, src_rows.contiguous(), dst_start)

    return StepOps("cpp", argmax_rows, sampling_probs, sample_rows, build_tree_from_parents,
                   reference.verify_tree_greedy, compact_kv, cpu)


def step_ops(device: torch.device, cpp: bool) -> StepOps:
    """The backend for an engine on `device`: TRITON on CUDA when triton imports; on a CPU the
    C++ ops when `cpp` (q4 weights, whose load builds the module), else TORCH."""
    if device.type == "cuda":
        return TRITON if importlib.util.find_spec("triton") is not None else TORCH
    if device.type == "cpu" and cpp:
        return cpp_ops(cpu_lowbit.load())
    return TORCH


__all__ = ["TORCH", "TRITON", "StepOps", "cpp_ops", "step_ops"]
