"""Does the C++ step backend pay for itself? Each op of an EAGLE-3 iteration that it replaces,
timed with the torch definitions (`kernels.TORCH`) and with the C++ ops (`kernels.cpp_ops`),
in one process.

    PYTHONPATH=. python benchmarks/step_ops.py [--calls 2000]

Shapes of the bundled target (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, a 49,152-token
vocabulary, the q4 engine's float16 cache) and q4's default tree (k3 s2 n5, cut 0.1, a sure
context chain of up to 8 more nodes): the tree input from the head's 12 candidates and an
8-token chain from the context, greedy and sampled acceptance over its 13 rows, the KV commit
of 3 accepted rows after 400 committed ones, and the greedy pick of 1 row. Prints
microseconds per call for each backend and their ratio. Not a test: timings depend on the
machine and its load.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from eagle_engine.config import Q4_TREE, SamplingParams
from eagle_engine.io_struct import ContextDraft, DraftTree
from eagle_engine.kernels import TORCH, cpp_ops, cpu_lowbit
from eagle_engine.kv_cache import KVCache
from eagle_engine.sampling import greedy
from eagle_engine.tree import tree_input
from eagle_engine.verify import greedy_acceptance, sampled_acceptance

LAYERS, KV_HEADS, HEAD_DIM, VOCAB, CONTEXT = 30, 3, 64, 49152, 400


def mean_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - t0) / calls * 1e6, 1)


def candidates(g: torch.Generator) -> DraftTree:
    """Level 1 (3 nodes) and level 2 (9 nodes) of a k3 s2 draft, path probabilities falling."""
    first = torch.rand(3, generator=g).sort(descending=True).values
    second = (first.repeat_interleave(3) * torch.rand(9, generator=g)).clamp_max(0.99)
    return DraftTree(torch.cat([first, second]), torch.randint(3, VOCAB, (12,), generator=g),
                     torch.cat([torch.full((3,), -1), torch.arange(3).repeat_interleave(3)]))


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    drafted = candidates(g)
    ctx = ContextDraft(torch.randint(3, VOCAB, (8,), generator=g).tolist(),
                       [0.9 ** (i + 1) for i in range(8)], match_len=4)
    root = torch.tensor([11])
    backends = {"torch": TORCH, "cpp": cpp_ops(cpu_lowbit.load())}
    vin = tree_input(drafted, ctx, root, CONTEXT, Q4_TREE, TORCH)
    logits = torch.randn(vin.tokens.numel(), VOCAB, generator=g)
    sampled = SamplingParams(temperature=0.7, top_p=0.9)
    cache = KVCache(LAYERS, 1, KV_HEADS, 1024, HEAD_DIM, torch.float16, "cpu")
    src = torch.tensor([2, 4, 7]) + CONTEXT  # accepted tree rows, to [CONTEXT, CONTEXT + 3)
    one = torch.randn(1, VOCAB, generator=g)
    ops: dict[str, Callable] = {
        f"tree input ({vin.tokens.numel()} nodes, with the context's chain)":
            lambda o: tree_input(drafted, ctx, root, CONTEXT, Q4_TREE, o),
        f"greedy acceptance ({vin.tokens.numel()} rows)": lambda o: greedy_acceptance(
            vin, logits, o),
        f"sampled acceptance ({vin.tokens.numel()} rows, T 0.7, top-p 0.9)":
            lambda o: sampled_acceptance(vin, logits, sampled, torch.Generator().manual_seed(0),
                                         o),
        "KV commit of 3 rows": lambda o: cache.commit_rows(src, CONTEXT, o),
        "greedy pick, 1 row": lambda o: greedy(one, o),
    }
    report: dict = {"threads": torch.get_num_threads(), "us_per_call": {}}
    for name, op in ops.items():
        us = {b: mean_us(lambda o=o: op(o), args.calls) for b, o in backends.items()}
        report["us_per_call"][name] = {**us, "torch / cpp": round(us["torch"] / us["cpp"], 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
