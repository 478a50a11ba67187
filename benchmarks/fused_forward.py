"""What does one fused q4 target forward of n rows cost at a given context length, and what
does a build with other compiler flags change?

    PYTHONPATH=. python benchmarks/fused_forward.py [--rows 1,3,8] [--contexts 200,600,1200] \
        [--compare-flags=-DLOWBIT_ROW_PAIRS=0] [--repeats 30]

Calls the bundled target's fused decoder layers (`fused_decoder` in `kernels/cpu_lowbit.cpp`,
the 30 layers and the final norm, without the lm_head) on n random rows after a random float16
cache of the given length; row 2 of a call hides one earlier row, as a tree row does. With
`--compare-flags` the kernels are also built with those flags (`-DLOWBIT_ROW_PAIRS=0`: attention
one query row at a time; `-DLOWBIT_PREFETCH_BYTES=0`: no weight prefetch; `-DLOWBIT_KV_AHEAD=0`:
no prefetch of the cache's keys and values), the two builds are called in alternating order,
and their outputs are checked to be the same bits. Prints the median milliseconds of each build
per shape, then JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from eagle_engine.config import EngineConfig
from eagle_engine.hardware import cpu_flags
from eagle_engine.engine import EagleEngine
from eagle_engine.kernels import cpu_lowbit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,3,8")
    p.add_argument("--contexts", default="200,600,1200")
    p.add_argument("--compare-flags", default="")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.manual_seed(0)
    target = EagleEngine.load(EngineConfig(weights="q4")).target
    fused, width = target.fused, target.cfg.hidden_size
    builds = {"default": cpu_lowbit.load()}
    if args.compare_flags:
        builds[args.compare_flags] = cpu_lowbit.load(tuple(args.compare_flags.split()))
    results = []
    for start in (int(x) for x in args.contexts.split(",")):
        cache = target.new_cache(max_len=start + 64)
        cache.data.normal_()
        for T in (int(x) for x in args.rows.split(",")):
            h = torch.randn(T, width)
            rope = target.rope.table(torch.arange(start, start + T)[None], h.dtype)
            mask = torch.ones(T, start + T, dtype=torch.bool)
            if T > 2:
                mask[2, start + 1] = False
            times: dict[str, list[float]] = {name: [] for name in builds}
            outs: dict[str, torch.Tensor] = {}
            for _ in range(args.repeats):
                for name, module in builds.items():
                    t0 = time.perf_counter()
                    out = module.fused_decoder(h, torch.empty(0), rope.cos[0, 0], rope.sin[0, 0],
                                               [cache.data], [start], [T], [mask], fused.weights,
                                               fused.heads, fused.kv_heads, fused.eps, [],
                                               fused.q8, fused.final_norm)
                    times[name].append(time.perf_counter() - t0)
                    outs[name] = out[0]
            same = all(torch.equal(o, outs["default"]) for o in outs.values())
            ms = {name: round(sorted(t)[len(t) // 2] * 1e3, 3) for name, t in times.items()}
            results.append({"context": start, "rows": T, "ms": ms, "same_bits": same})
            print(f"context {start:5d}, {T} rows: "
                  + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
                  + ("" if same else "  DIFFERENT BITS"), flush=True)
    print(json.dumps({"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
                      "results": results}))


if __name__ == "__main__":
    main()
