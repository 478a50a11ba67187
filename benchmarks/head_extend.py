"""Do the head's draft extend and its whole draft as one C++ call each pay against their
Python steps?

    PYTHONPATH=. python benchmarks/head_extend.py --prompts ../shared/data/prompts/mtbench.jsonl \
        [--limit 80] [--tree k=2,s=1,n=3,cut=0.05] [--steps extend] [--max-new-tokens 128]

One process, the bundled q4 target: plain decoding, the default head (its extend one C++ call,
`FusedDecoder.extend`, and its draft past the first level one too, `FusedDecoder.draft`) and a
second copy of it that runs the phases named by `--steps` as their Python steps (`extend`:
`accept.extend_rows`; `draft`: `draft.draft_levels`, which
only trees of two or more steps run), through `bench.run_modes` (conversations, the order rotated
per question, greedy answers compared with plain decoding). Both forms give the same bits, so
tau is equal and every answer identical; only the speed differs. Prints `bench`'s figures per
system as JSON. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_engine.bench import Run, load_rows, parse_sweep, run_modes
from eagle_engine.config import EngineConfig, SamplingParams, parse_dtype
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine, load_heads
from eagle_engine.models.cpu_lowbit import quantize_head

STEPS = DEFAULT_HEAD + " steps"  # the copy whose `--steps` phases run their Python steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per row")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tree", default="k=2,s=1,n=3,cut=0.05", help="a tree, TreeParams.parse")
    ap.add_argument("--steps", default="extend",
                    help="comma-separated phases the copy runs as Python steps: extend, draft")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    steps = set(args.steps.split(","))
    if steps - {"extend", "draft"}:
        raise SystemExit(f"--steps takes extend and/or draft, got {args.steps!r}")
    engine = EagleEngine.load(EngineConfig(weights="q4"))
    if not engine.heads[DEFAULT_HEAD].fused.extends:
        raise SystemExit("the default head does not extend in one call on this machine")
    config = engine.config
    copy = load_heads(config, engine.target, parse_dtype(config.dtype))[DEFAULT_HEAD]
    quantize_head(copy)
    copy.fused.extends = "extend" not in steps
    copy.fused.drafts = "draft" not in steps
    engine.heads[STEPS] = copy
    tree, = parse_sweep(args.tree)
    runs = [Run("plain", engine, None, tree), Run("one call", engine, DEFAULT_HEAD, tree),
            Run("steps", engine, STEPS, tree)]
    engine.generate(engine.encode("Hello"), SamplingParams(max_new_tokens=8), tree, DEFAULT_HEAD)
    totals = run_modes(load_rows(args.prompts, args.limit), runs,
                       SamplingParams(max_new_tokens=args.max_new_tokens), False)
    modes = {label: t.summary() for label, t in totals.items()}
    for m in modes.values():
        m["speedup_vs_plain"] = round(m["tokens_per_s"] / modes["plain"]["tokens_per_s"], 3)
    print(json.dumps({"tree": args.tree, "steps": sorted(steps), "modes": modes}, indent=2))


if __name__ == "__main__":
    main()
