"""Token sampling: logits -> the exact distribution the baseline samples from, and draws from it.

`target_probs` is the one definition of the sampling distribution (temperature, then top-k, then
top-p, renormalized; computed by the engine's step backend, `kernels.StepOps`); the baseline
sampler and speculative verification both call it, which is what makes tree acceptance
lossless. Greedy is `greedy` (the first index of the maximum) everywhere. `ops` defaults to the
definitions (`kernels.TORCH`).
Not here: acceptance rules (`verify.py`).
"""
from __future__ import annotations

import torch

from .config import SamplingParams
from .kernels import TORCH, StepOps


def target_probs(logits: torch.Tensor, params: SamplingParams, ops: StepOps = TORCH
                 ) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V] (temperature > 0 only)."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return ops.sampling_probs(flat, params.temperature, params.top_k, params.top_p
                              ).view(logits.shape)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None, ops: StepOps = TORCH
                ) -> torch.Tensor:
    """probs [..., V] -> token ids [...] by inverse-CDF with one uniform coin per row (a coin on
    a zero-probability tail takes the row's most likely token)."""
    flat = probs.reshape(-1, probs.shape[-1])
    coins = torch.rand(flat.shape[0], generator=generator, device=probs.device)
    return ops.sample_rows(flat, coins).view(probs.shape[:-1])


def greedy(logits: torch.Tensor, ops: StepOps = TORCH) -> torch.Tensor:
    """logits [..., V] -> ids [...] of the first maximum, as `argmax` returns them."""
    return ops.argmax_rows(logits)


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None, ops: StepOps = TORCH) -> torch.Tensor:
    """logits [..., V] -> next token ids [...] under `params`."""
    if params.greedy:
        return greedy(logits, ops)
    return sample_from(target_probs(logits, params, ops), generator, ops)
