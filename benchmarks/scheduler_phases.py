"""Does the app's scheduler decode faster with a head's solo phases than with its batched steps
of another commit, when a head serves one request?

    PYTHONPATH=. python benchmarks/scheduler_phases.py \
        --prompts ../shared/data/prompts/mtbench.jsonl --compare-commit eb4fe2c \
        [--limit 40] [--tree 2,2,5,0.05] [--max-new-tokens 128]

One process, the bundled q4 target and the default head. Each prompt's first turn is answered
through a one-request `Scheduler` stepped on the calling thread, with the trace on (as the app
asks), twice: with today's `batch_phases` (a head with one request runs `draft.draft` and
`accept.extend`, one C++ call each for a q8 head on a CPU) and with `draft_many` / `extend_many`
from `batch_phases.py` of `--compare-commit` (the batched Python steps over the fused layers),
the order alternating per prompt. Greedy answers must be identical. Prints tokens/s of each
(decoding and prefill, whole answers) as JSON. Not a test: timings depend on the machine and
its load; runs in two processes differ by more than the gains measured here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

import eagle_engine.scheduler as scheduler_mod
from eagle_engine import batch_phases
from eagle_engine.bench import load_rows, parse_sweep
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine

ROOT = Path(__file__).resolve().parents[1]


def commit_phases(rev: str) -> ModuleType:
    """`eagle_engine/batch_phases.py` of commit `rev`, imported inside today's package (its
    relative imports resolve to today's modules)."""
    source = subprocess.run(["git", "show", f"{rev}:eagle_engine/batch_phases.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "batch_phases.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"eagle_engine.batch_phases_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(engine: EagleEngine, phases: ModuleType, ids: list[int], params: SamplingParams,
           tree) -> tuple[str, int, float]:
    """One answer through a one-request scheduler whose head phases come from `phases`."""
    scheduler_mod.draft_many, scheduler_mod.extend_many = phases.draft_many, phases.extend_many
    scheduler = scheduler_mod.Scheduler(engine, max_batch=1)
    t0 = time.perf_counter()
    handle = scheduler.submit(ids, params, tree=tree, head=DEFAULT_HEAD)
    scheduler.run_until_idle()
    seconds = time.perf_counter() - t0
    events = list(handle.events())
    return "".join(e.text for e in events), events[-1].stats["num_tokens"], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per row")
    ap.add_argument("--compare-commit", required=True, help="git revision of the batched steps")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--tree", default="2,2,5,0.05", help="topk,steps,tokens[,min_score]")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(weights="q4"))
    tree, = parse_sweep(args.tree)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    variants = {"solo phases": batch_phases, f"batched steps of {args.compare_commit}":
                commit_phases(args.compare_commit)}
    totals = {label: [0, 0.0] for label in variants}
    texts: dict[str, list[str]] = {label: [] for label in variants}
    rows = load_rows(args.prompts, args.limit)
    for i, row in enumerate(rows):
        ids = engine.encode([{"role": "user", "content": row["turns"][0]}])
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for label in order:
            text, tokens, seconds = answer(engine, variants[label], ids, params, tree)
            texts[label].append(text)
            totals[label][0] += tokens
            totals[label][1] += seconds
        print(f"[{i + 1}/{len(rows)}]", {k: round(n / s, 2) for k, (n, s) in totals.items()},
              flush=True)
    a, b = texts.values()
    print(json.dumps({"tree": args.tree, "prompts": len(rows),
                      "same_answers": f"{sum(x == y for x, y in zip(a, b))}/{len(rows)}",
                      "tokens_per_s": {k: round(n / s, 2) for k, (n, s) in totals.items()}},
                     indent=2))


if __name__ == "__main__":
    main()
