"""Where an EAGLE-3 iteration's time goes, timed in place on real answers, one process.

    PYTHONPATH=. python benchmarks/iteration_steps.py --prompts data/prompts/mtbench.jsonl \
        [--limit 4] [--tree 2,1,3[,min_score]] [--weights q4] [--temperature 0.7 --top-p 0.95]

Answers the first turns of `--limit` prompts with plain decoding, then with EAGLE-3 (the default
head, `--tree`), and times every call of the engine's steps while they run: the whole iteration,
the draft, the tree (with the context's chain), the target's forward, acceptance and commit, the
packed read, the stop rules, the head's extend (one C++ call, or its forward and top-k), its
later draft decode steps (one C++ call each, or its forward), and the kernels under them (the
fused layers, the low-bit products); sampled (`--temperature`), also the sampling
distribution, the draw and the sampled tree acceptance. Each step is wrapped in a
timer for this process only, so a figure includes its wrapper's ~1 us and its callees. Prints
microseconds per call, calls and microseconds per iteration (per token for plain decoding) as a
table, then as JSON. Not a test: timings depend on the machine and its load; compare steps
within one run.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable

import eagle_engine.accept as accept_mod
import eagle_engine.sampling as sampling_mod
import eagle_engine.scheduler as sched_mod
from eagle_engine.batch_phases import EagerPhases
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.models.cpu_lowbit import FusedDecoder, LowBitLinear
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.target import TargetModel
from eagle_engine.run import Run
from eagle_engine.scheduler import Scheduler
from eagle_engine.tools.bench import parse_sweep

TOTAL: Counter[str] = Counter()  # seconds per step, this process only
CALLS: Counter[str] = Counter()


def timed(fn: Callable, label: Callable[..., str]) -> Callable:
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        name = label(*args)
        TOTAL[name] += time.perf_counter() - t0
        CALLS[name] += 1
        return out
    return wrapper


def install() -> None:
    """Wrap the steps (class attributes, module functions as the engine imported them, the
    eager phases)."""
    for owner, name, label in [
            (Scheduler, "_iterate", "iteration"),
            (Scheduler, "_tree_input", "tree (+ the context's chain)"),
            (Scheduler, "_accept", "acceptance + KV commit"), (Run, "after_readback", "stop rules"),
            (Run, "iteration_event", "event"),
            (EagerPhases, "draft", "draft"), (EagerPhases, "verify", "verify forward"),
            (EagerPhases, "extend", "extend"), (sched_mod, "extend", "extend over the prompt"),
            (accept_mod, "top_children", "head top-k after the extend"),
            (FusedDecoder, "extend", "head extend, one C++ call"),
            (FusedDecoder, "draft", "head draft step, one C++ call"),
            (sched_mod, "sampled_acceptance", "sampled acceptance"),
            (sampling_mod, "target_probs", "sampling distribution"),
            (sampling_mod, "sample_from", "sampling draw")]:
        setattr(owner, name, timed(getattr(owner, name), lambda *a, lab=label: lab))
    TargetModel.forward = timed(TargetModel.forward,
                                lambda self, ids, *a: f"target forward, {ids.shape[1]} rows")
    Eagle3Draft.forward = timed(Eagle3Draft.forward, lambda self, *a: "head forward")
    FusedDecoder.many = timed(FusedDecoder.many, lambda self, h, *a: (
        f"fused {'head' if self.q8 else 'target'} layers, {h.shape[0]} rows"))
    LowBitLinear.forward = timed(LowBitLinear.forward, lambda self, x: (
        f"{self.kind} product {self.in_features}->{self.out_features}, "
        f"{x.numel() // self.in_features} rows"))


def run(engine: EagleEngine, ids: list[list[int]], params: SamplingParams,
        tree: TreeParams | None, head: str | None) -> dict:
    TOTAL.clear()
    CALLS.clear()
    t0 = time.perf_counter()
    tokens = sum(len(engine.generate(i, params, tree, head).token_ids) for i in ids)
    seconds = time.perf_counter() - t0
    per = CALLS["iteration"] or tokens  # iterations, or tokens for plain decoding
    steps = {name: {"us_per_call": round(TOTAL[name] / CALLS[name] * 1e6, 1),
                    "calls": CALLS[name], "us_per_iteration": round(TOTAL[name] / per * 1e6, 1)}
             for name in sorted(TOTAL, key=lambda n: -TOTAL[n]) if CALLS[name] >= len(ids) * 4}
    return {"tokens": tokens, "tok_s": round(tokens / seconds, 2),
            "iterations": CALLS["iteration"], "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, help="JSONL with a 'turns' list per row")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--tree", default="k=2,s=1,n=3", help="a tree, TreeParams.parse")
    p.add_argument("--weights", default="q4")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args()
    engine = EagleEngine.load(EngineConfig(weights=args.weights))
    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f][:args.limit]
    ids = [engine.encode(r["turns"][0]) for r in rows]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=0)
    tree, = parse_sweep(args.tree)
    engine.generate(ids[0], params, tree, DEFAULT_HEAD)  # warm-up, before the timers
    install()
    report = {"tree": args.tree, "weights": args.weights, "temperature": args.temperature,
              "top_p": args.top_p,
              "plain": run(engine, ids, params, None, None),
              "eagle": run(engine, ids, params, tree, DEFAULT_HEAD)}
    for mode in ("plain", "eagle"):
        r = report[mode]
        print(f"\n{mode}: {r['tokens']} tokens, {r['tok_s']} tok/s, {r['iterations']} iterations")
        print(f"  {'step':52s} {'us/call':>9s} {'calls':>6s} {'us/iteration':>13s}")
        for name, s in r["steps"].items():
            print(f"  {name:52s} {s['us_per_call']:9.1f} {s['calls']:6d} "
                  f"{s['us_per_iteration']:13.1f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
