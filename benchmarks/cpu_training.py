"""Seconds per CPU training step of the default head, with and without `keep_freed_memory`.

    PYTHONPATH=. python benchmarks/cpu_training.py [--steps 9] [--tokens-per-batch 8192]

Runs itself twice as a child process (the allocator setting holds for a whole process): once
with glibc's defaults and once after `train.pipeline.keep_freed_memory()`, as the `train`
command does on the CPU. Each child warm-starts a head from `assets/heads/eagle3-aux-1layer`
(fp32 master weights, bf16 autocast, as the trainer runs), builds batches of random-token
conversations of three lengths (256, 512 and 1000 tokens, `--tokens-per-batch` tokens each;
the cost of a step depends on the shapes, not on the tokens) with target features from one
forward of the bundled target, and times `train_step` over them in turn; the first round is
warm-up. Prints the median seconds per step for each length and both settings, and the ratio.
Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

LENGTHS = (256, 512, 1000)
HEAD = Path(__file__).resolve().parent.parent / "assets" / "heads" / "eagle3-aux-1layer"


def child(steps: int, tokens_per_batch: int, keep: bool) -> dict[str, float]:
    from eagle_engine.models.draft_model import Eagle3Draft
    from eagle_engine.models.loader import load_target, resolve_target
    from eagle_engine.train.online import online_batch
    from eagle_engine.train.pipeline import draft_config, inherited_vocab, init_head, \
        keep_freed_memory
    from eagle_engine.train.trainer import TrainParams, new_head, train_step

    if keep and not keep_freed_memory():
        raise SystemExit("mallopt is not available (not glibc)")
    target = load_target(resolve_target("bundled"), torch.bfloat16, "cpu", 2048)
    cfg = target.cfg
    hot = inherited_vocab(HEAD, torch.arange(8192))
    model = Eagle3Draft(draft_config(cfg, 1, True, 8192), 2048 + 64).float()
    init_head(model, target, hot, HEAD)
    model.share_embedding(target.embed_tokens)
    model.embed_tokens.weight.requires_grad_(False)
    params = TrainParams(tokens_per_batch=tokens_per_batch)
    head = new_head("bench", model, target.lm_head.weight.detach(), params)
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
            train_step(model, head.opt, head.trainable, batch, head.target_head, params, 1e-5)
            if r:  # the first round is warm-up
                times[T].append(time.perf_counter() - t0)
    return {str(T): statistics.median(ts) for T, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=9, help="timed steps (after one warm-up round)")
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--child", choices=["default", "keep"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.tokens_per_batch, args.child == "keep")))
        return
    results = {}
    for setting in ("default", "keep"):
        out = subprocess.run([sys.executable, __file__, "--child", setting, "--steps",
                              str(args.steps), "--tokens-per-batch", str(args.tokens_per_batch)],
                             check=True, capture_output=True, text=True).stdout
        results[setting] = json.loads(out.strip().splitlines()[-1])
    print("| conversation length | s/step, glibc defaults | s/step, keep_freed_memory | ratio |")
    print("|---|---|---|---|")
    for T in results["default"]:
        a, b = results["default"][T], results["keep"][T]
        print(f"| {T} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
