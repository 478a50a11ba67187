"""How much time does the host spend per iteration, apart from the model's own compute?

    PYTHONPATH=. python benchmarks/host_time.py [--tokens 256] [--repeats 3] [--profile 20] \
        [--json out.json]

A tiny random Llama target (8 layers, hidden 32, vocab 96) and a random one-layer head, made in
a temporary folder, on the CPU, one thread. Decodes `--tokens` tokens (EOS ignored) with plain
decoding and with EAGLE-3 (a k2 s2 n4 tree without drafts from the context, the shape a GPU
runs), through `EagleEngine.stream` (the scheduler, as the app), `--repeats` times, two ways:

- `graphs`: the app's path on a GPU, with every replay free. The engine runs in graph mode:
  each request leases a slot of the scheduler's cache pools, its phases are runners on static
  buffers per batch-size bucket, and each runner's "capture" runs its phase once and
  keeps the output, as a CUDA graph keeps its output buffers; a replay then copies the inputs
  into the buffers and returns that output without computing. What is left is the host's own work per iteration, the part that sits on
  a GPU's critical path between replays: tree building, acceptance, the commit, the read-back,
  stop rules, detokenization and events. (The tokens are not the model's, as the outputs are
  stale; the work per iteration is the same.)
- `eager`: the CPU path; each forward's eager per-op cost is in the phases.

Reports per iteration: the wall time between events as the caller sees them, the phases the
events time (EAGLE-3: draft, verify with acceptance and the read-back, extend with the stop
rules; plain: decode), and the rest (the scheduler's loop, events, delivery). `--profile N`
adds the N functions with the most own time under cProfile (which slows every call: read it
as a split, not as times).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.cuda_graph import GraphMode, GraphPhases, GraphRunner
from eagle_engine.engine import EagleEngine
from eagle_engine.tools.bench import provenance, write_report
from tests.helpers import tiny_engine

TREE = TreeParams.parse("k=2,s=2,n=4,ctx=off")


def decode(engine: EagleEngine, head: str | None, tokens: int) -> dict:
    """One answer: per iteration, the caller's wall time and each timed phase, in us."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompt = list(range(3, 35))
    gaps, phases = [], {}
    last = None
    for ev in engine.stream(prompt, params, TREE if head else None, head):
        now = time.perf_counter()
        if last is not None and ev.tokens:  # the first event is the prefill's token
            gaps.append((now - last) * 1e6)
            for k, v in ev.timings_ms.items():
                phases.setdefault(k, []).append(v * 1000)
        last = now
    return {"wall_us": gaps, "phases_us": phases}


def summary(runs: list[dict]) -> dict:
    wall = statistics.median(x for r in runs for x in r["wall_us"])
    phases = {k: statistics.median(x for r in runs for x in r["phases_us"][k])
              for k in runs[0]["phases_us"]}
    iterations = statistics.mean(len(r["wall_us"]) for r in runs)
    return {"iterations": round(iterations, 1), "wall_us": round(wall, 1),
            "phases_us": {k: round(v, 1) for k, v in phases.items()},
            "rest_us": round(wall - sum(phases.values()), 1)}


def profile(engine, head: str | None, tokens: int, top: int) -> list[str]:  # noqa: ANN001
    prof = cProfile.Profile()
    prof.enable()
    decode(engine, head, tokens)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top:]


class FreeReplay:
    """A captured graph whose replay costs nothing: the runner's output stays as captured."""

    @staticmethod
    def replay() -> None:
        pass


def capture_free(phases: GraphPhases, key: tuple, runner: GraphRunner) -> None:
    """`GraphPhases.capture` without CUDA: the runner runs its phase once on its buffers as
    allocated and keeps that output, as a graph keeps its output buffers."""
    runner.captured = runner.forward()
    runner.graph = FreeReplay()


@contextlib.contextmanager
def free_replays(engine: EagleEngine):
    """`engine` runs in graph mode on the CPU, its replays free (`capture_free`): a scheduler
    made under the patch holds `GraphPhases`."""
    saved = engine.graph_mode, GraphPhases.capture, engine.scheduler
    engine.graph_mode = GraphMode.GRAPHS
    GraphPhases.capture = capture_free
    engine.scheduler = engine.new_scheduler()
    assert isinstance(engine.scheduler.phases, GraphPhases)
    try:
        yield
    finally:
        engine.graph_mode, GraphPhases.capture, engine.scheduler = saved


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="top N functions by own time")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = tiny_engine(Path(tmp), {"head": {}}, max_len=args.tokens + 128)
        report = {"kind": "host_time", "tree": TREE.spec(), "tokens": args.tokens,
                  "provenance": provenance()}
        for path, patch in (("graphs", free_replays), ("eager", contextlib.nullcontext)):
            with patch(engine):
                for name, head in (("plain", None), ("eagle", "head")):
                    row = f"{name}, {path}"
                    decode(engine, head, 16)  # warm-up (in graph mode: slots and captures)
                    report[row] = summary([decode(engine, head, args.tokens)
                                           for _ in range(args.repeats)])
                    if args.profile:
                        report[row]["profile"] = profile(engine, head, args.tokens,
                                                         args.profile)
    print(json.dumps(report, indent=1))
    if args.json:
        print(f"wrote {write_report(args.json, report)}")


if __name__ == "__main__":
    main()
