"""Seconds per CPU training step of the default head, with glibc's allocator and with jemalloc.

    apt-get install libjemalloc2   # once
    PYTHONPATH=. python benchmarks/cpu_training.py [--steps 9] [--tokens-per-batch 8192]

Runs itself twice as a child process (an allocator is chosen when a process starts): once with
glibc's malloc and once with jemalloc preloaded and told to keep freed pages
(`MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`), the setting README.md gives for training
on the CPU. PyTorch's CPU allocator caches nothing, so with glibc every [tokens, draft vocab]
float tensor of a step (hundreds of MB) is a fresh mmap the kernel zeroes page by page.
Each child warm-starts a head from `assets/heads/eagle3-aux-1layer`
(fp32 master weights, bf16 autocast, as the trainer runs), builds batches of random-token
conversations of three lengths (256, 512 and 1000 tokens, `--tokens-per-batch` tokens each;
the cost of a step depends on the shapes, not on the tokens) with target features from one
forward of the bundled target, and times `train_step` over them in turn; the first round is
warm-up. Prints the median seconds per step for each length and both allocators, the ratio,
and each child's peak resident memory.
Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

LENGTHS = (256, 512, 1000)
HEAD = Path(__file__).resolve().parent.parent / "assets" / "heads" / "eagle3-aux-1layer"


JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def child(steps: int, tokens_per_batch: int) -> dict[str, float]:
    from eagle_engine.models.loader import load_target, resolve_target
    from eagle_engine.train.online import online_batch
    from eagle_engine.train.pipeline import HeadSpec, build_head, inherited_vocab
    from eagle_engine.train.trainer import TrainParams, train_step

    target = load_target(resolve_target("bundled"), torch.bfloat16, "cpu", 2048)
    cfg = target.cfg
    hot = inherited_vocab(HEAD, Counter(), 8192, cfg.vocab_size)  # the head's own ids
    params = TrainParams(tokens_per_batch=tokens_per_batch)
    head = build_head(HeadSpec(Path("bench"), 1, True), target, hot, HEAD, params, "cpu", 0)
    in_vocab = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    in_vocab[hot] = True
    gen = torch.Generator().manual_seed(0)
    batches = {}
    for T in LENGTHS:
        rows = [{"prompt_ids": torch.randint(0, cfg.vocab_size, (T // 8,), generator=gen).tolist(),
                 "response_ids": torch.randint(0, cfg.vocab_size, (T - T // 8,),
                                               generator=gen).tolist()}
                for _ in range(max(1, tokens_per_batch // T))]
        batches[T] = online_batch(target, rows, list(range(len(rows))), cfg.default_aux_layer_ids(),
                                  in_vocab)
    times: dict[int, list[float]] = {T: [] for T in LENGTHS}
    for r in range(steps // len(LENGTHS) + 1):
        for T, batch in batches.items():
            t0 = time.perf_counter()
            train_step(head.model, head.opt, head.trainable, batch, head.target_head, params, 1e-5)
            if r:  # the first round is warm-up
                times[T].append(time.perf_counter() - t0)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss: KB on Linux
    return {**{str(T): statistics.median(ts) for T, ts in times.items()}, "peak_rss_gb": peak_gb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=9, help="timed steps (after one warm-up round)")
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.tokens_per_batch)))
        return
    libs = glob.glob("/usr/lib/*/libjemalloc.so.2")
    if not libs:
        raise SystemExit("libjemalloc.so.2 not found: apt-get install libjemalloc2")
    glibc = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    envs = {"glibc": glibc, "jemalloc": {**glibc, "LD_PRELOAD": libs[0],
                                         "MALLOC_CONF": JEMALLOC_CONF}}
    results = {}
    for name, env in envs.items():
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps),
                              "--tokens-per-batch", str(args.tokens_per_batch)],
                             check=True, capture_output=True, text=True, env=env).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    print("| conversation length | s/step, glibc malloc | s/step, jemalloc | ratio |")
    print("|---|---|---|---|")
    for T in map(str, LENGTHS):
        a, b = results["glibc"][T], results["jemalloc"][T]
        print(f"| {T} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    print(f"peak resident memory: glibc {results['glibc']['peak_rss_gb']:.1f} GB, "
          f"jemalloc {results['jemalloc']['peak_rss_gb']:.1f} GB")


if __name__ == "__main__":
    main()
