"""Baseline decode speed: our engine vs `transformers.generate` on the same model, one process.

    PYTHONPATH=. python benchmarks/baseline_vs_transformers.py [--tokens 128] [--prompts 4]

Runs the same chat prompts greedily through both, in fp32 and bf16, alternating per prompt
(ours with oneDNN-packed weights, the default on CPU, and with plain `F.linear`), and prints
tokens/s, the ratio of our best to transformers' best, the weight bytes read per token against
the machine's measured read bandwidth (the memory-bandwidth bound), and a profile of one decode
step grouped by operator. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import EagleEngine
from eagle_engine.models.loader import resolve_target

PROMPTS = ["Write a Python function that reverses a string.",
           "Give me three tips for staying productive.",
           "Explain what a hash table is in two sentences.",
           "What are the main causes of the seasons on Earth?"]


def read_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    x = torch.ones(mb * 1024 * 1024 // 4)
    x.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return x.numel() * 4 * repeats / (time.perf_counter() - t0) / 1e9


def ours(engine: EagleEngine, prompt: str, tokens: int) -> tuple[float, list[int]]:
    ids = engine.encode(prompt)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(ids, params)
    return len(out.token_ids) / (time.perf_counter() - t0), out.token_ids


def hf(model, tok, prompt: str, tokens: int) -> tuple[float, list[int]]:  # noqa: ANN001
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         min_new_tokens=tokens, do_sample=False)
    n = out.shape[1] - ids.shape[1]
    return n / (time.perf_counter() - t0), out[0, ids.shape[1]:].tolist()


def profile_step(engine: EagleEngine) -> list[tuple[str, float]]:
    """Self CPU time per operator for 20 decode steps of our engine (ms per step)."""
    ids = engine.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine.generate(ids, params)
    with torch.profiler.profile() as prof:
        engine.generate(ids, params)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return [(r.key, round(r.self_cpu_time_total / 1000 / 21, 3)) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_target("bundled")
    tok = AutoTokenizer.from_pretrained(directory)
    report: dict = {"threads": torch.get_num_threads(), "tokens": args.tokens}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine, plain = (EagleEngine.load(EngineConfig(drafts=(), dtype=dtype_name, max_len=2048,
                                                       weights="dense", packed_weights=packed))
                         for packed in (True, False))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        ours(engine, "Hi", 8), ours(plain, "Hi", 8), hf(model, tok, "Hi", 8)  # warm-up
        speeds_ours, speeds_plain, speeds_hf, same = [], [], [], 0
        for prompt in PROMPTS[:args.prompts]:
            s_ours, ids_ours = ours(engine, prompt, args.tokens)
            speeds_plain.append(ours(plain, prompt, args.tokens)[0])
            s_hf, ids_hf = hf(model, tok, prompt, args.tokens)
            speeds_ours.append(s_ours)
            speeds_hf.append(s_hf)
            same += ids_ours == ids_hf
        weights = sum(p.numel() * p.element_size() for n, p in engine.target.named_parameters()
                      if n != "embed_tokens.weight" or engine.target.cfg.tie_word_embeddings)
        report[dtype_name] = {
            "ours_tok_s": round(sum(speeds_ours) / len(speeds_ours), 2),
            "ours_plain_linear_tok_s": round(sum(speeds_plain) / len(speeds_plain), 2),
            "transformers_tok_s": round(sum(speeds_hf) / len(speeds_hf), 2),
            "greedy_identical": f"{same}/{len(speeds_ours)}",
            "weight_mb_per_token": round(weights / 1e6, 1),
            "profile_ms_per_step": profile_step(engine)}
        del engine, plain, model
    bw = read_bandwidth_gbs()
    best_ours = max(report[d]["ours_tok_s"] for d in ("fp32", "bf16"))
    best_hf = max(report[d]["transformers_tok_s"] for d in ("fp32", "bf16"))
    report["read_bandwidth_gb_s"] = round(bw, 1)
    report["best_ours_vs_best_transformers"] = round(best_ours / best_hf, 2)
    for d in ("fp32", "bf16"):
        bound = bw * 1e3 / report[d]["weight_mb_per_token"]
        report[d]["bandwidth_bound_tok_s"] = round(bound, 1)
        report[d]["fraction_of_bound"] = round(report[d]["ours_tok_s"] / bound, 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
