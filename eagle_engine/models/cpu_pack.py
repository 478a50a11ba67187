"""CPU inference layout for linear layers: weights pre-packed into oneDNN's blocked format.

On CPU, `F.linear` with a plain row-major weight runs a one-token product (decode) far below
memory bandwidth; the same product on a weight reordered once by oneDNN reads it much faster
and is no slower for many tokens (prefill, tree verify). `benchmarks/peers.py`
measures the dense decode beside the q4 one.
`pack_linears` swaps every `nn.Linear` of a loaded model for a `PackedLinear` that keeps the
dense weight (shared tensors such as a tied lm_head stay shared; checkpoint IO and dtype/device
queries keep working) and adds the packed copy.
Results equal `F.linear` up to float summation order. Not here: loading weights (`loader.py`).
"""
from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN packing applies on CPU builds with mkldnn (bf16 needs hardware support)."""
    if torch.device(device).type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """`nn.Linear` for inference with a oneDNN-packed weight; `weight` stays the dense one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in] dense (possibly shared, e.g. tied embeddings)
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (the weight's dtype) -> [..., out]. Inference only: no autograd."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `PackedLinear`; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
