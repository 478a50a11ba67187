"""What do the q4 / q8 CPU kernels cost per number of activation rows, on the bundled target's
shapes, with the weights in cache (compute, not memory), and streamed from memory?

    PYTHONPATH=. python benchmarks/lowbit_kernels.py [--threads 2] [--rows 1,2,4,8,16] \
        [--streamed] [--compare-flags=-mno-avx512vnni] [--compare-commit REV]

Times `q4_linear` over the four linears of one decoder layer (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576) and `q8_linear` over the lm_head (576->49152) on random
weights, mean microseconds of repeated calls after warm-up. A target forward of n tokens
streams 30 such layers and the lm_head from memory, so these figures are the compute floor
of a target forward (`bench --costs`). `--streamed` also times what a forward reads: 30
distinct copies of the layer's linears and the lm_head one after the other (~96 MB, so each
comes from memory),
median milliseconds of 7 passes. `--compare-flags` also builds the kernels with those compiler
flags added (`-mno-avx512vnni`: the AVX2 products on a VNNI CPU; `-DLOWBIT_PREFETCH_BYTES=0`:
no prefetch hints; `-DLOWBIT_TILE6=0`: 5 or 6 rows as a tile of 4 and one of 1 or 2) and times
both builds in alternating rounds, after checking that they give the same bits.
`--compare-commit` does the same with the kernels and the weight packing of another commit (git
revision), built from its sources: a change of the packed layout compares in one process.
Prints JSON with the CPU's vector flags.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from eagle_engine.hardware import cpu_flags
from eagle_engine.kernels import cpu_lowbit
from eagle_engine.models.cpu_lowbit import quantize_q4, quantize_q8

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LM_HEAD = (49152, 576)
TARGET_LAYERS = 30


def mean_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def commit_kernels(rev: str) -> ModuleType:
    """`eagle_engine.kernels.cpu_lowbit` as of git revision `rev`, its sources (those of today's
    `SOURCES` and `HEADERS`) in a temporary folder; its `load()` builds them into their own
    cache folder."""
    folder = Path(tempfile.mkdtemp(prefix="lowbit-"))
    for path in [Path(cpu_lowbit.__file__), *cpu_lowbit.SOURCES, *cpu_lowbit.HEADERS]:
        (folder / path.name).write_bytes(subprocess.run(
            ["git", "show", f"{rev}:eagle_engine/kernels/{path.name}"], check=True,
            capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location("eagle_engine.kernels.cpu_lowbit_base",
                                                  folder / Path(cpu_lowbit.__file__).name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--streamed", action="store_true",
                    help="also time 30 distinct layers and the lm_head, read from memory")
    ap.add_argument("--compare-flags", default="",
                    help="space-separated compiler flags of a second build to time beside this one")
    ap.add_argument("--compare-commit", default="",
                    help="a git revision whose kernels and packing to time beside this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    packing = {}  # a build's module for pack_q4 / pack_q8 where it is not today's
    builds = {"default": cpu_lowbit.load()}
    if args.compare_flags:
        builds[args.compare_flags] = cpu_lowbit.load(tuple(args.compare_flags.split()))
    if args.compare_commit:
        base = commit_kernels(args.compare_commit)
        builds[args.compare_commit] = base.load((f"-DLOWBIT_COMMIT={args.compare_commit}",))
        packing[args.compare_commit] = base
    g = torch.Generator().manual_seed(0)
    natural = [(n, k, quantize_q4(torch.randn(n, k, generator=g))) for n, k in LAYER]
    n, k = LM_HEAD
    head_codes = quantize_q8(torch.randn(n, k, generator=g))
    layers = {key: [(nn, kk, packing.get(key, cpu_lowbit).pack_q4(*codes))
                    for nn, kk, codes in natural] for key in builds}
    heads = {key: packing.get(key, cpu_lowbit).pack_q8(*head_codes) for key in builds}
    report: dict = {"cpu_flags": cpu_flags(), "threads": args.threads,
                    **{key: {"layer_us": {}, "lm_head_us": {}, "streamed_ms": {}}
                       for key in builds}}
    # 30 distinct copies of the layer: a pass reads ~66 MB of q4 codes and scales, then the
    # lm_head's ~30 MB, more than the caches keep between passes
    stacks = {key: [[(nn, kk, tuple(t.clone() for t in packed)) for nn, kk, packed in layer]
                     for _ in range(TARGET_LAYERS)] for key, layer in layers.items()
              } if args.streamed else {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {kk: torch.randn(m, kk, generator=g) for kk in {kk for _, kk in LAYER}}
        x = torch.randn(m, k, generator=g)
        calls = {key: (lambda b=b, layer=layers[key]: [b.q4_linear(xs[kk], *packed, nn)
                                                       for nn, kk, packed in layer],
                       lambda b=b, head=heads[key]: b.q8_linear(x, *head, n))
                 for key, b in builds.items()}
        outs = [(*layer_fn(), head_fn()) for layer_fn, head_fn in calls.values()]
        if any(not all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:]):
            raise SystemExit(f"the builds {list(builds)} give different numbers at {m} rows")
        for _ in range(3):  # alternating rounds; the best of each build
            for key, (layer_fn, head_fn) in calls.items():
                for name, fn, reps in (("layer_us", layer_fn, 200), ("lm_head_us", head_fn, 20)):
                    us = round(mean_us(fn, reps), 1)
                    report[key][name][m] = min(report[key][name].get(m, us), us)
        if stacks:
            passes: dict[str, list[float]] = {key: [] for key in builds}
            for _ in range(7):  # alternating passes; the median of each build
                for key, b in builds.items():
                    t0 = time.perf_counter()
                    for linears in stacks[key]:
                        for nn, kk, packed in linears:
                            b.q4_linear(xs[kk], *packed, nn)
                    b.q8_linear(x, *heads[key], n)
                    passes[key].append(time.perf_counter() - t0)
            for key, ts in passes.items():
                report[key]["streamed_ms"][m] = round(sorted(ts)[len(ts) // 2] * 1e3, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
