"""Seconds per GPU training step, with the TTT attention's kernels as the trainer runs them and
with cuDNN's attention allowed, and where a step's time goes.

    PYTHONPATH=. python benchmarks/gpu_training.py [--steps 8] [--tokens-per-batch 16384]
        [--profile]

Needs no GGUF, so a lent GPU runs it in one device call (the bundled target takes two calls in
parts, `deploy/gpu_window.sh`): the target is a random `LlamaForCausalLM` of the bundled
target's shape (SmolLM2-135M: 30 layers, 576 wide, 49,152 tokens), which costs what the
bundled one costs. The conversations are the first 4,000 of `data/answers/`, grouped into
batches of `--tokens-per-batch` as `train` groups them. Two heads train on each batch, as
in the shipped heads' GPU run: `aux` (the shipped recipe) and `auxnorm+normout`
(EAGLE-3.1), from scratch, TTT length 6, bf16 autocast.

For each setting (first the trainer's, `trainer.SDPA_BACKENDS`, for the TTT attention and the
batch's target forward; then the same list with cuDNN's attention first, the kernel PyTorch
picked by itself for both on an H200), one warm-up step, then `--steps` timed steps on the same
batches, each split into the batch (one target forward) and each head's `train_step`, with the
device synchronized between them.
Prints the median seconds of each part per setting and the ratio. `--profile` also prints
PyTorch's profiler table (host and device time per op) over three steps of each setting.
Not a test: timings depend on the machine; compare the settings within one run.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.nn.attention import SDPBackend

import eagle_engine.train.online as online
import eagle_engine.train.trainer as trainer
from eagle_engine.models.loader import load_target
from eagle_engine.train.features import row_ids
from eagle_engine.train.pipeline import MAX_TOKENS, HeadSpec, build_head
from eagle_engine.train.vocab import select_vocab, token_counts
from tests.helpers import make_hf_target

ANSWERS = Path(__file__).resolve().parent.parent / "data" / "answers" / \
    "smollm2-135m-instruct.jsonl.gz"
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
HEADS = (("aux", False, False), ("auxnorm+normout", True, True))  # name, fc_norm, norm_output


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(make_hf_target(Path(tmp), weight_scale=1.0, **SMOLLM2_135M),
                             trainer.train_dtype(torch.device(dev)), dev, 2048)
    with gzip.open(ANSWERS, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(4000), f)]
    hot = select_vocab(token_counts([r["response_ids"] for r in rows]), 8192,
                       target.cfg.vocab_size)
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool, device=dev)
    in_vocab[hot.to(dev)] = True
    params = trainer.TrainParams(ttt_length=6, tokens_per_batch=args.tokens_per_batch)
    heads = [build_head(HeadSpec(Path(name), 1, True, fc_norm, norm_output), target, hot, None,
                        params, dev, 0) for name, fc_norm, norm_output in HEADS]
    groups = trainer.group_batches([len(row_ids(r, MAX_TOKENS)) for r in rows],
                                   args.tokens_per_batch, random.Random(0))[:args.steps + 1]

    def step(group: list[int]) -> list[float]:
        """-> seconds of [the batch, each head's train_step]"""
        sync()
        marks = [time.perf_counter()]
        batch = online.online_batch(target, rows, group, target.cfg.default_aux_layer_ids(),
                                    in_vocab, MAX_TOKENS)
        sync()
        marks.append(time.perf_counter())
        for h in heads:
            trainer.train_step(h.model, h.opt, h.trainable, batch, h.target_head, params, 1e-4)
            sync()
            marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]

    settings = {"trainer's kernels (no cuDNN)": trainer.SDPA_BACKENDS,
                "cuDNN allowed": [SDPBackend.CUDNN_ATTENTION, *trainer.SDPA_BACKENDS]}
    parts = ["batch"] + [f"head {name}" for name, _, _ in HEADS]
    medians = {}
    for label, backends in settings.items():
        # the kernels the TTT attention and the batch's target forward may use
        with mock.patch.object(trainer, "SDPA_BACKENDS", backends), \
                mock.patch.object(online, "SDPA_BACKENDS", backends):
            step(groups[0])  # warm-up
            times = [step(g) for g in groups[1:]]
            if args.profile:
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
                with torch.profiler.profile(activities=activities) as prof:
                    for g in groups[1:4]:
                        step(g)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                                max_name_column_width=50))
        medians[label] = [statistics.median(t[i] for t in times) for i in range(len(parts))]
        print(f"{label}: " + ", ".join(f"{p} {m:.3f} s" for p, m in zip(parts, medians[label]))
              + f", step {sum(medians[label]):.3f} s", flush=True)
    a, b = (sum(m) for m in medians.values())
    print(f"| setting | {' | '.join(parts)} | step |\n|---|{'---|' * (len(parts) + 1)}")
    for label, m in medians.items():
        print(f"| {label} | {' | '.join(f'{x:.3f}' for x in m)} | {sum(m):.3f} |")
    print(f"cuDNN allowed / the trainer's kernels: {b / a:.2f}x the time a step")


if __name__ == "__main__":
    main()
