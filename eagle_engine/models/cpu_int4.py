"""CPU target weights as 4-bit codes: groups of 32 inputs with one scale and one zero each.

That is the layout of a Q4_1 GGUF (the bundled target): every decoder linear is stored as codes
q in 0..15 with a scale d and a minimum m per block of 32 inputs (w = d*q + m). PyTorch's CPU
kernel `_weight_int4pack_mm_for_cpu` multiplies by such a weight directly (w = (q - 8) * scale +
zero, so scale = d and zero = m + 8d), reading a quarter of the bytes of a bf16 weight. Decoding
one token is bound by those bytes, but the kernel unpacks the weight again for every few input
rows, so its cost grows with the rows of a call: a target forward of 4 tokens costs 1.20 of one
token, of 8 tokens 1.67 (bf16: 1.04 and 1.10; README, "4-bit target weights").

`quantize_int4` takes each group's minimum and maximum as m and m + 15d. A Q4_1 block always
holds both ends (llama.cpp quantizes a block's minimum to 0 and its maximum to 15), so for the
weights the engine dequantizes from such a GGUF the codes come back exactly, from its fp32 and
from its bf16 copy alike, and from fp32 the scales and minimums too (tested on the bundled
target); the kernel takes scales and zeros in the activations' dtype, so in bf16 they round.
Any other weight is quantized to 4 bits, lossily. Not here: the bf16 oneDNN packing of the other
linears (`cpu_pack.py`) or choosing when to use this (`EngineConfig.int4_weights`).
"""
from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # inputs per (scale, zero) pair, as in Q4_0 / Q4_1


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """The kernel wants whole groups of inputs and outputs in multiples of 16."""
    return in_features % GROUP == 0 and out_features % 16 == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> codes [N, K] int32 in 0..15, scale and low [N, K/GROUP] float32 with
    weight ~= codes * scale + low per group (exactly for a weight on such a grid)."""
    N, K = weight.shape
    w = weight.float().view(N, K // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)  # [N, K/G]
    scale = (high - low) / 15
    step = torch.where(scale > 0, scale, 1.0)[..., None]
    codes = ((w - low[..., None]) / step).round().clamp(0, 15).to(torch.int32).view(N, K)
    return codes, scale, low


class Int4Linear(nn.Module):
    """A bias-free linear whose weight lives only as packed 4-bit codes (`quantize_int4`)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        weight = linear.weight.detach()  # [out, in]
        self.out_features, self.in_features = weight.shape
        if getattr(linear, "bias", None) is not None:
            raise ValueError("Int4Linear has no bias")
        if not int4_shape_ok(self.out_features, self.in_features):
            raise ValueError(f"int4 weights need in_features % {GROUP} == 0 and out_features % "
                             f"16 == 0, got {self.out_features}x{self.in_features}")
        codes, scale, low = quantize_int4(weight)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 2),
                             persistent=False)
        zero = low + 8 * scale
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1)
                             .contiguous().to(weight.dtype), persistent=False)  # [K/G, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (the weight's dtype) -> [..., out]. Inference only."""
        flat = x.reshape(-1, self.in_features)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return out.view(*x.shape[:-1], self.out_features)


def quantize_decoder_linears(model: nn.Module) -> tuple[int, int]:
    """Replace every bias-free `nn.Linear` under `model.layers` whose shape the kernel takes by
    an `Int4Linear` (embedding and lm_head stay as they are: the GGUF keeps them at 8 bits).
    Returns (replaced, left as they were)."""
    found = [(parent, name, child) for parent in model.layers.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    swaps = [(p, n, c) for p, n, c in found
             if c.bias is None and int4_shape_ok(c.out_features, c.in_features)]
    for parent, name, child in swaps:
        setattr(parent, name, Int4Linear(child))
    return len(swaps), len(found) - len(swaps)
