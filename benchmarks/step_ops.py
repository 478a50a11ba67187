"""Bookkeeping of one EAGLE-3 iteration against what it replaced, one process.

    PYTHONPATH=. python benchmarks/step_ops.py [--context 400] [--calls 2000]

Times, in microseconds per call on SmolLM2-135M shapes (30 layers, 3 KV heads, head dim 64,
49,152-token vocabulary, bf16): committing 3 accepted tree rows with `KVCache.commit_rows` (one
gather over the one-tensor cache) against the per-layer loop it replaced (60 calls of the same
reference compaction on the layer views), and greedy selection over 1 and 8 logit rows with
`sampling.greedy` (`max`) against `argmax`. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from eagle_engine.kernels import reference
from eagle_engine.kv_cache import KVCache
from eagle_engine.sampling import greedy

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 30, 3, 64, 49152


def mean_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - t0) / calls * 1e6, 1)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    cache = KVCache(LAYERS, 1, KV_HEADS, 4096, HEAD_DIM, torch.bfloat16, "cpu")
    src = torch.tensor([2, 4, 7]) + args.context  # accepted tree rows, to [context, context+3)

    def per_layer() -> None:
        for k, v in cache.layers:
            reference.compact_kv(k, src, args.context)
            reference.compact_kv(v, src, args.context)

    report: dict = {"threads": torch.get_num_threads(), "us_per_call": {
        "commit 3 rows: KVCache.commit_rows (one tensor)": mean_us(
            lambda: cache.commit_rows(src, args.context), args.calls),
        "commit 3 rows: per-layer loop (before)": mean_us(per_layer, args.calls)}}
    for rows in (1, 8):
        logits = torch.randn(rows, VOCAB)
        report["us_per_call"][f"greedy {rows} rows: max (sampling.greedy)"] = mean_us(
            lambda: greedy(logits), args.calls)
        report["us_per_call"][f"greedy {rows} rows: argmax (before)"] = mean_us(
            lambda: logits.argmax(-1), args.calls)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
