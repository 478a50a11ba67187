"""What do the q4 / q8 CPU kernels cost per number of activation rows, on the bundled target's
shapes, with the weights in cache (compute, not memory)?

    PYTHONPATH=. python benchmarks/lowbit_kernels.py [--threads 2] [--rows 1,2,4,8,16]

Times `q4_linear` over the four linears of one decoder layer (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576) and `q8_linear` over the lm_head (576->49152) on random
weights, mean microseconds of repeated calls after warm-up. A target forward of n tokens
streams 30 such layers and the lm_head from memory, so these figures are the compute floor
of `weight_formats.py`'s. Prints JSON with the CPU's vector flags.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from eagle_engine.config import cpu_flags
from eagle_engine.kernels import cpu_lowbit
from eagle_engine.models.cpu_lowbit import quantize_q4, quantize_q8

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def mean_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layer = [(n, k, cpu_lowbit.pack_q4(*quantize_q4(torch.randn(n, k, generator=g))))
             for n, k in LAYER]
    n, k = LM_HEAD
    head = cpu_lowbit.pack_q8(*quantize_q8(torch.randn(n, k, generator=g)))
    report: dict = {"cpu_flags": cpu_flags(), "threads": args.threads, "layer_us": {},
                    "lm_head_us": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {kk: torch.randn(m, kk, generator=g) for kk in {kk for _, kk in LAYER}}
        report["layer_us"][m] = round(sum(
            mean_us(lambda: cpu_lowbit.q4_linear(xs[kk], *packed, nn), 200)
            for nn, kk, packed in layer), 1)
        x = torch.randn(m, k, generator=g)
        report["lm_head_us"][m] = round(mean_us(lambda: cpu_lowbit.q8_linear(x, *head, n), 20), 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
