"""Attention cost when the key length changes every call, as it does in decoding, one process.

    PYTHONPATH=. python benchmarks/attention_shapes.py [--start 300] [--calls 60]

Times the attention core of one SmolLM2-135M layer (9 query heads, 3 KV heads, head dim 64) for
1, 4 and 8 query tokens (decode, draft step, tree verify; causal mask past one query, as the
engine passes one) over key lengths start, start+1, ... (each length new, as in decoding), then
over the same lengths again (seen), for: our `attend` in bf16 (SDPA on queries grouped by KV
head) and in fp32 (grouped fp32 matmuls), the grouped fp32 matmuls on bf16 inputs (what bf16
ran before SDPA), the grouped matmuls with the q @ k product in bf16 (before that), and
PyTorch's SDPA in fp32. A gap between the new and the seen column is per-shape kernel setup,
paid once per forward (the other layers reuse the kernel). Not a test: timings depend on the
machine and its load.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.layers import attend, score_bias

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            score_dtype: torch.dtype) -> torch.Tensor:
    B, H, T, d = q.shape
    kvh, S = k.shape[1], k.shape[2]
    g = H // kvh
    qg = q.reshape(B, kvh, g * T, d)
    scores = (qg.to(score_dtype) @ k.to(score_dtype).transpose(-1, -2)).float() * d ** -0.5
    if mask is not None:
        scores = scores.view(B, kvh, g, T, S).masked_fill(~mask[:, None, None], float("-inf"))
    probs = scores.view(B, kvh, g * T, S).softmax(-1)
    out = (probs @ v.float()).to(q.dtype)
    return out.view(B, kvh, g, T, d).reshape(B, H, T, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                          attn_mask=None if mask is None else mask[:, None])


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: torch.Tensor | None) -> torch.Tensor:
    return attend(q, k, v, score_bias(mask, HEADS, KV_HEADS, q.dtype))


VARIANTS = {
    "ours bf16: attend (grouped SDPA)": (ours, torch.bfloat16),
    "ours fp32: attend (grouped fp32 matmuls)": (ours, torch.float32),
    "bf16, grouped fp32 matmuls (before SDPA)": (
        lambda q, k, v, m: grouped(q, k, v, m, torch.float32), torch.bfloat16),
    "bf16, grouped, bf16 q @ k (before that)": (
        lambda q, k, v, m: grouped(q, k, v, m, torch.bfloat16), torch.bfloat16),
    "SDPA fp32": (sdpa, torch.float32),
}


def mean_us(fn, dtype: torch.dtype, T: int, lengths: list[int]) -> float:  # noqa: ANN001
    total = 0.0
    for S in lengths:
        q = torch.randn(1, HEADS, T, HEAD_DIM, dtype=dtype)
        k = torch.randn(1, KV_HEADS, S, HEAD_DIM, dtype=dtype)
        v = torch.randn(1, KV_HEADS, S, HEAD_DIM, dtype=dtype)
        mask = causal_mask(T, S - T, "cpu") if T > 1 else None
        t0 = time.perf_counter()
        fn(q, k, v, mask)
        total += time.perf_counter() - t0
    return round(total / len(lengths) * 1e6, 1)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", type=int, default=300)
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args()
    report: dict = {"threads": torch.get_num_threads(), "us_per_call": {}}
    for fn, dtype in VARIANTS.values():  # library start-up, outside every measured length
        mean_us(fn, dtype, 1, [args.start - 1] * 3)
    for T in (1, 4, 8):
        for i, (name, (fn, dtype)) in enumerate(VARIANTS.items()):
            start = args.start + (3 * i + (T // 4)) * args.calls  # lengths no variant saw yet
            lengths = list(range(start, start + args.calls))
            new = mean_us(fn, dtype, T, lengths)
            seen = mean_us(fn, dtype, T, lengths)
            report["us_per_call"][f"T={T} {name}"] = {"new_length": new, "seen_length": seen}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
