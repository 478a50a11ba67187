"""Does the prefix cache stay within its bound in resident memory under churn?

    PYTHONPATH=. python benchmarks/prefix_churn.py [--stores 3000] [--bound-mb 512] \
        [--tune-malloc]

Stores `--stores` entries of random lengths (48 to 1,600 rows: chat turns) into a
`PrefixCache` of `--bound-mb`, from target and draft caches shaped like the bundled q4 engine's
(30 layers, 3 KV heads, head dim 64, float16; a one-layer head), one fresh request cache per
store, as the scheduler allocates them, and looks each prompt up first. Prints the process's
resident memory (VmRSS) every 250 stores, with the cache's own byte count. Runs against any
checkout that has `PrefixCache.store(tokens, target_cache, head, draft_cache, draft_rows)`;
`--tune-malloc` first applies `eagle_engine.memory.tune_malloc` (checkouts that have it).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from eagle_engine.kv_cache import KVCache
from eagle_engine.prefix_cache import PrefixCache

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stores", type=int, default=3000)
    p.add_argument("--bound-mb", type=int, default=512)
    p.add_argument("--tune-malloc", action="store_true")
    args = p.parse_args()
    if args.tune_malloc:
        from eagle_engine import memory

        memory.tune_malloc()
    rng = random.Random(0)
    pc = PrefixCache(args.bound_mb * 2 ** 20)
    rows = []
    start = rss_mb()
    for i in range(args.stores):
        n = rng.randint(48, 1600)
        tokens = [rng.randrange(3, 49152) for _ in range(n)]
        pc.lookup(tokens, "head")
        target = KVCache(LAYERS, 1, KV_HEADS, n + 64, HEAD_DIM, torch.float16, "cpu")
        draft = KVCache(1, 1, KV_HEADS, n + 64, HEAD_DIM, torch.float16, "cpu")
        target.data.normal_()
        draft.data.normal_()
        pc.store(tokens, target, "head", draft, n - 1)
        if (i + 1) % 250 == 0:
            rows.append({"stores": i + 1, "rss_mb": rss_mb(),
                         "cache_mb": round(pc.nbytes / 2 ** 20, 1), "entries": len(pc)})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"start_rss_mb": start, "end_rss_mb": rss_mb(), "bound_mb": args.bound_mb,
                      "peak_rss_mb": max(r["rss_mb"] for r in rows)}))


if __name__ == "__main__":
    main()
