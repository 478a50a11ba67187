"""Batched self-distillation generation (`baseline.generate_batch`) of this tree against an
earlier commit, one invocation.

    PYTHONPATH=. python benchmarks/batch_generation.py [--before ac1ad6f] [--prompts 96]

Checks `--before` out into a temporary git worktree and runs a child process on each tree
(`PYTHONPATH` set to it): the bundled target in bf16 with packed weights answers the
first `--prompts` alpaca_eval prompts of `../shared/data/prompts/train.jsonl`, in file order, in
one batch (temperature 0.7, top-p 0.95, `--max-new-tokens`, seed 0), as the training pipeline's
generation does. Prints answer tokens per second for both and the ratio (ac1ad6f decodes every
row to the end of the batch; later commits drop finished rows). Not a test: timings depend on
the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT.parent / "shared" / "data" / "prompts" / "train.jsonl"


def child(num_prompts: int, max_new_tokens: int) -> dict[str, float]:
    import torch

    from eagle_engine.baseline import generate_batch
    from eagle_engine.chat import encode_chat
    from eagle_engine.config import SamplingParams
    from eagle_engine.models.cpu_pack import pack_linears
    from eagle_engine.models.loader import load_target, load_tokenizer, resolve_target

    directory = resolve_target("bundled")
    target = load_target(directory, torch.bfloat16, "cpu", 2048)
    pack_linears(target)
    tokenizer = load_tokenizer(directory)
    rows = [json.loads(x) for x in PROMPTS.read_text().split("\n") if x.strip()]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": r["turns"][0]}])
               for r in rows if r["source"] == "alpaca_eval"][:num_prompts]
    eos = tuple(tokenizer.convert_tokens_to_ids([tokenizer.eos_token]))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.95)
    t0 = time.perf_counter()
    answers = generate_batch(target, prompts, params, eos, torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - t0
    tokens = sum(len(a) for a in answers)
    return {"answer_tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="ac1ad6f", help="the commit to compare with")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.prompts, args.max_new_tokens)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old),
                        args.before], check=True)
        try:
            for label, tree in ((args.before, old), ("this tree", ROOT)):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", "--prompts", str(args.prompts),
                     "--max-new-tokens", str(args.max_new_tokens)],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, "PYTHONPATH": str(tree)}).stdout
                results[label] = json.loads(out.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           check=True)
    print(json.dumps(results, indent=1))
    before, now = (r["tokens_per_s"] for r in results.values())
    print(f"this tree vs {args.before}: {now / before:.2f}x answer tokens per second")


if __name__ == "__main__":
    main()
