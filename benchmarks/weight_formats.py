"""Each target weight format on this CPU: the cost of a target forward of 1, 4, 8, 16 tokens
(the verify cost curve) and closeness to fp32 on fixed text.

    PYTHONPATH=. python benchmarks/weight_formats.py [--context 300] [--repeats 21] \
        [--sizes 1,4,8,16]

Formats: q4 (the GGUF's Q4_1 codes, Q8_0 lm_head, int8 activations, float16 KV cache,
`models/cpu_lowbit.py`), the same linears without the fused C++ decoder (its Python layers, one
kernel call per linear) over a float32 KV cache, dense fp32, and dense bf16 where the CPU has
native bf16. Forward times are medians of
interleaved rounds after warm-up at `--context` tokens of cache (`bench.interleaved_medians`).
Closeness: teacher-forced next-token agreement and KL(fp32 || format) over fp32's greedy answers
to three prompts. Prints JSON with the CPU's vector flags.
"""
from __future__ import annotations

import argparse
import json

import torch

from eagle_engine.bench import interleaved_medians, target_forward
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.hardware import cpu_flags, native_bf16
from eagle_engine.engine import EagleEngine
from eagle_engine.kv_cache import causal_mask

PROMPTS = ("Give me three tips for staying productive.",
           "Explain why the sky is blue to a ten-year-old.",
           "Write a Python function that checks whether a string is a palindrome.")


@torch.inference_mode()
def closeness(reference: EagleEngine, engines: dict[str, EagleEngine],
              max_new_tokens: int = 96) -> dict[str, dict[str, float]]:
    """Teacher-forced next-token agreement and KL(fp32 || engine) on fp32's greedy answers."""
    sums = {label: [0, 0, 0.0] for label in engines}
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        answer = reference.generate(ids, SamplingParams(max_new_tokens=max_new_tokens)).token_ids
        seq = torch.tensor([ids + answer])
        n, first = seq.shape[1], len(ids) - 1
        pos, mask = torch.arange(n)[None], causal_mask(n, 0, "cpu")

        def logits(e: EagleEngine) -> torch.Tensor:
            cache = e.target.new_cache(max_len=n)
            return e.target(seq, pos, cache, 0, mask).logits[0, first:].float()  # [T, V]
        ref = logits(reference).log_softmax(-1)
        for label, e in engines.items():
            got = logits(e).log_softmax(-1)
            s = sums[label]
            s[0] += int((got.argmax(-1) == ref.argmax(-1)).sum())
            s[1] += got.shape[0]
            s[2] += float((ref.exp() * (ref - got)).sum())
    return {label: {"same_next_token": round(a / n, 4), "kl_from_fp32": round(kl / n, 5),
                    "tokens": n} for label, (a, n, kl) in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--sizes", default="1,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    unfused = EagleEngine.load(EngineConfig(drafts=(), weights="q4"))
    unfused.target.fused = None  # the same q4 linears through the Python layers
    unfused.cache = unfused.target.new_cache(max_len=unfused.config.max_len)  # float32 KV
    engines = {"q4": EagleEngine.load(EngineConfig(drafts=(), weights="q4")),
               "q4 Python layers, fp32 KV": unfused,
               "fp32": EagleEngine.load(EngineConfig(drafts=(), weights="dense", dtype="fp32"))}
    if native_bf16("cpu"):
        engines["bf16"] = EagleEngine.load(EngineConfig(drafts=(), weights="dense",
                                                        dtype="bf16"))
    sizes = [int(s) for s in args.sizes.split(",")]
    fns = {(label, n): target_forward(e, n, args.context)
           for label, e in engines.items() for n in sizes}
    ms = {k: v * 1000 for k, v in interleaved_medians(fns, args.repeats, 3).items()}
    near = closeness(engines["fp32"], {k: e for k, e in engines.items() if k != "fp32"})
    report = {"cpu_flags": cpu_flags(), "context": args.context, "vs_fp32": near,
              "forward_ms": {f"{label} n={n}": round(v, 2) for (label, n), v in ms.items()},
              "vs_own_1_token": {f"{label} n={n}": round(v / ms[(label, 1)], 2)
                                 for (label, n), v in ms.items()}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
