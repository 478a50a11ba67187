"""4-bit against bf16 target weights on CPU: target forwards of n tokens, one process.

    PYTHONPATH=. python benchmarks/int4_weights.py [--context 300] [--repeats 21] [--sizes 1,4,8,16]

Loads the target twice, with bf16 weights packed for oneDNN (the default) and with
`EngineConfig(int4_weights=True)` (decoder linears as 4-bit codes, `models/cpu_int4.py`), and
times target forwards of n tokens after `--context` tokens for both, interleaved in rounds
(`bench.interleaved_medians`) so the two see the same machine. Also reports how closely each
follows the fp32 model (the GGUF's weights without rounding): on the fp32 model's own greedy
answers to three prompts, teacher-forced, how often each predicts the same next token and the
mean KL divergence of its next-token distribution from fp32's.

What to read: decoding one token is a matrix-vector product bound by the bytes of the weights,
so 4-bit weights make it faster; EAGLE-3 pays off when verifying n tree tokens costs about as
much as one token, and the int4 kernel unpacks the weights again for every few input rows, so
its cost grows with n. Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import json

import torch

from eagle_engine.bench import interleaved_medians, target_forward
from eagle_engine.config import EngineConfig, SamplingParams
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
            return e.target(seq, pos, e.cache, 0, mask).logits[0, first:].float()  # [T, V]
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
    engines = {"bf16": EagleEngine.load(EngineConfig(drafts=())),
               "int4": EagleEngine.load(EngineConfig(drafts=(), int4_weights=True))}
    if engines["bf16"].target.dtype != torch.bfloat16:
        raise SystemExit(f"needs a CPU with bf16 support (loaded {engines['bf16'].config.dtype})")
    sizes = [int(s) for s in args.sizes.split(",")]
    fns = {(label, n): target_forward(e, n, args.context)
           for label, e in engines.items() for n in sizes}
    ms = {k: v * 1000 for k, v in interleaved_medians(fns, args.repeats, 3).items()}
    near = closeness(EagleEngine.load(EngineConfig(drafts=(), dtype="fp32", max_len=1024)),
                     engines)
    report = {"context": args.context, "vs_fp32": near,
              "forward_ms": {f"{label} n={n}": round(v, 2) for (label, n), v in ms.items()},
              "vs_own_1_token": {f"{label} n={n}": round(v / ms[(label, 1)], 2)
                                 for (label, n), v in ms.items()},
              "int4_vs_bf16": {f"n={n}": round(ms[("int4", n)] / ms[("bf16", n)], 2)
                               for n in sizes}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
