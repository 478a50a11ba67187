"""How long until a visitor sees the first token: EAGLE-3 against plain decoding, alone and
through the scheduler (the app's path)?

    PYTHONPATH=. python benchmarks/first_token.py --prompts data/prompts/mtbench.jsonl \
        --prompts benchmarks/long_conversations.jsonl [--limit 4] [--rounds 4]

One process, the bundled q4 target and the default head. Each row's first turn is one chat
prompt. Per prompt and round, in an order rotated per round: plain decoding (`engine.stream`),
EAGLE-3 (`engine.stream`) and EAGLE-3 through a `Scheduler` stepped on its own thread, as the
app runs it. Each time is from the call to the first event in the caller's hands; the rest of
the answer (`--max-new-tokens`, default 1) is drained untimed. The prefix cache is off, so every
prompt is prefilled in full. Prints per prompt its length, the median time of each system,
EAGLE-3's ratio to plain decoding and every round's time, as JSON. Not a test: timings depend
on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.hardware import cpu_flags

SYSTEMS = ("plain", "EAGLE-3", "EAGLE-3, scheduler")


def first_event_s(events: Callable[[], Iterator]) -> float:
    """Seconds from the call to the first event; the remaining events are drained untimed."""
    t0 = time.perf_counter()
    it = events()
    next(it)
    took = time.perf_counter() - t0
    for _ in it:
        pass
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, action="append", required=True,
                    help="JSONL with a 'turns' list per row (repeatable)")
    ap.add_argument("--limit", type=int, default=4, help="rows taken from each --prompts file")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1)
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(drafts=(DEFAULT_HEAD,), weights="q4"))
    tree = engine.default_tree
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    prompts = [engine.encode(json.loads(line)["turns"][0])
               for f in args.prompts
               for line in f.read_text().splitlines()[:args.limit] if line.strip()]
    with ThreadPoolExecutor(max_workers=1) as worker:
        scheduler = engine.new_scheduler(1, worker)
        calls = {"plain": lambda ids: engine.stream(ids, params, tree, None),
                 "EAGLE-3": lambda ids: engine.stream(ids, params, tree, DEFAULT_HEAD),
                 "EAGLE-3, scheduler": lambda ids: scheduler.submit(
                     ids, params, tree, DEFAULT_HEAD).events()}
        for ids in prompts[:2]:  # warm-up: kernels, allocator, caches
            for name in SYSTEMS:
                first_event_s(lambda: calls[name](ids))
        times = [{name: [] for name in SYSTEMS} for _ in prompts]
        for r in range(args.rounds):
            order = SYSTEMS[r % 3:] + SYSTEMS[:r % 3]
            for ids, got in zip(prompts, times):
                for name in order:
                    got[name].append(first_event_s(lambda: calls[name](ids)))
    result = {"cpu_flags": cpu_flags(), "tree": str(tree), "rounds": args.rounds, "prompts": []}
    for ids, got in zip(prompts, times):
        ms = {name: round(1000 * statistics.median(v), 1) for name, v in got.items()}
        result["prompts"].append({"tokens": len(ids), "median_ms": ms, "vs_plain": {
            name: round(ms[name] / ms["plain"], 3) for name in SYSTEMS[1:]}, "rounds_ms": {
            name: [round(1000 * t, 1) for t in v] for name, v in got.items()}})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
