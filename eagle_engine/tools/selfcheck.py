"""`python -m eagle_engine selfcheck`: the GPU path's checks and the engine's measurements.

On CUDA it runs the logic of the GPU-only tests (each Triton kernel against its torch reference
on the device, every phase through captured graphs against the eager phase, no host sync in an
iteration but the read-back, engine output with graphs against without) and then measures, on the
chosen target and prompts (--prompts, or 10 built-in ones): tokens/s of plain decoding and of
EAGLE-3, eager and graphed, the speedups between them, host syncs per iteration
(`sync_count.per_step`) and milliseconds per phase. `--report OUT.json` writes all of it as JSON
and also runs on CPU, where the GPU checks and the graphed rows are marked skipped; without
`--report` a machine without CUDA lists what it skips and exits 0. `--app-path` checks the
app's own serving path instead (`app_path.py`). The parity harness is shared with the tests
(`parity.py`; tests/test_cuda_graph.py runs it on the CPU), the kernel cases too
(`kernels/checks.py`, tests/test_kernels.py). Not here: the runners themselves
(`cuda_graph.py`), the kernels (`kernels/`) or the sync counter (`sync_count.py`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import kernels
from ..accept import commit, extend_input, parse_readback, readback_parts
from ..batch_phases import EagerPhases
from ..config import (
    ConfigError,
    EngineConfig,
    SamplingParams,
    TreeParams,
)
from ..cuda_graph import GraphMode, buckets
from ..engine import EagleEngine
from ..hardware import cpu_model
from ..kernels.checks import kernel_mismatches, triton_kernels
from ..models.draft_model import Eagle3Draft
from ..models.target import TargetModel
from ..tree import build_tree
from ..verify import greedy_acceptance
from .parity import (
    EAGLE31,
    TINY_TREE,
    IdTokenizer,
    Row,
    engine_pair,
    engine_parity,
    graph_backend,
    phase_parity,
    tiny_models,
    verdict,
)
from .sync_count import per_step

LLAMA_COMMAND = ("python -m eagle_engine selfcheck --target meta-llama/Llama-3.1-8B-Instruct "
                 "--draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --dtype bf16 "
                 "--report selfcheck.json [--prompts mtbench.jsonl]")


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_no_sync(target: TargetModel, head: Eagle3Draft, tree: TreeParams) -> Row:
    """An EAGLE iteration of two requests through the captured graphs (a first, unguarded
    iteration captures them) under set_sync_debug_mode('error'): draft, build_tree, verify,
    greedy acceptance and commit (with the tree_build, verify_greedy and kv_compact kernels),
    then, after the read-back (the iteration's one sync), the extend."""
    backend, pairs = graph_backend(target, head, tree, GraphMode.GRAPHS, 2, seed=1)
    seats = [p.graph for p in pairs]
    ops = kernels.step_ops(target.device, cpp=False)  # the engine's on CUDA: Triton
    for guarded in (False, True):
        torch.cuda.synchronize()
        mode = "error" if guarded else "default"
        try:
            with sync_debug(mode):
                drafted = backend.draft(head, seats, [p.state for p in pairs])
                vins = [build_tree(t, p.state.root, p.state.seq_len, tree, ops)
                        for t, p in zip(drafted, pairs)]
                verified = backend.verify(target, seats, vins, [], [], [])
                vouts = [greedy_acceptance(vin, v.logits, ops) for vin, v in zip(vins, verified)]
                for vin, vout, seat in zip(vins, vouts, seats):
                    commit(vin, vout, seat.cache, ops)
            got = [parse_readback(torch.cat(readback_parts(vin, vout, True)).tolist(), vin,
                                  vout, True) for vin, vout in zip(vins, vouts)]
            with sync_debug(mode):
                states = backend.extend(head, seats, [
                    extend_input(vin, vout, g.num_accepted, v.features)
                    for vin, vout, g, v in zip(vins, vouts, got, verified)])
        except RuntimeError as e:
            return Row("no host sync in an iteration but the read-back", "FAIL", str(e)[:120],
                       False)
        for p, state in zip(pairs, states):
            p.state = state
    return Row("no host sync in an iteration but the read-back", "PASS",
               "graphed draft, verify, extend of 2 requests; build_tree, acceptance, commit", True)


def gpu_checks() -> list[Row]:
    """The CUDA-only checks on the tiny models: kernels, graphed phases, syncs, engine."""
    dev = torch.device("cuda")
    rows = [verdict(f"kernel {name} == reference (cuda)", failures, f"{count} cases")
            for name, (count, failures) in kernel_mismatches(triton_kernels(), dev).items()]
    with torch.inference_mode():
        target, head = tiny_models(dev)
        rows += phase_parity(target, head, TINY_TREE, GraphMode.GRAPHS)
        rows += [replace(r, check=f"3 requests in a bucket of 4: {r.check}") for r in phase_parity(
            target, head, TINY_TREE, GraphMode.GRAPHS, batch=3, max_batch=4)]
        rows += [replace(r, check=f"EAGLE-3.1 head: {r.check}") for r in phase_parity(
            *tiny_models(dev, recipe=EAGLE31), TINY_TREE, GraphMode.GRAPHS)]
        rows.append(check_no_sync(target, head, TINY_TREE))
        engines = engine_pair(target, IdTokenizer(), {"tiny": head},
                              EngineConfig(dtype="fp32", device="cuda", max_len=192))
        rows += engine_parity(engines, "tiny", list(range(3, 40)), TINY_TREE, 48,
                              label="tiny fp32")
    return rows


GPU_CHECKS = ("Triton kernels on the device == their torch references",
              "every phase replayed as a CUDA graph == the eager phase (all extend paddings), "
              "for 1 request and for 3 in a bucket of 4",
              "no host sync in an iteration but the read-back (set_sync_debug_mode('error'))",
              "engine output with graphs == without (tiny model and --target)")


# ---------------------------------------------------------------- measurements and the report

BUILTIN_PROMPTS = (  # the fallback of --prompts: short questions in MT-bench's categories
    "Write a short blog post about a trip to a city you like, with its sights and food.",
    "You are a ship's captain in a storm. Tell your crew what to do, in character.",
    "Alice is taller than Bob and Bob is taller than Carol. Who is the shortest? Explain.",
    "What is the sum of the integers from 1 to 100? Show the steps.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Extract the names and dates from: 'Marie Curie won the Nobel Prize in 1903 and 1911.'",
    "Explain how a refrigerator moves heat out of its inside.",
    "Why did the printing press change Europe? Give three reasons.",
    "Suggest five names for a coffee shop run by cats, and say why each fits.",
    "Summarize the rules of chess in a paragraph for a child.",
)


def load_prompts(path: Path | None, limit: int) -> tuple[str, list[str]]:
    """The first turn of each row of an MT-bench-style jsonl file (or the built-in prompts),
    at most `limit`; -> (where they came from, prompts)."""
    from ..chat import load_rows

    if path is None:
        return "built-in", list(BUILTIN_PROMPTS[:limit])
    rows = load_rows(path, limit)
    bad = [i for i, r in enumerate(rows) if not r.get("turns")]
    if bad:
        raise ConfigError(f"prompt file {path}: rows {bad[:5]} have no 'turns'")
    return str(path), [r["turns"][0] for r in rows]


class Budget:
    """The report's time limit: measurements that would start after it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def spent(self) -> bool:
        return time.perf_counter() - self.start > self.seconds

    def skip(self, what: dict) -> dict:
        return {**what, "status": "skipped",
                "reason": f"time budget spent (--time-budget-s {self.seconds:g})"}


def synchronize_phases(phases: EagerPhases) -> None:
    """Makes the backend `phases` synchronize the device after each phase call (CUDA)."""
    for name in ("draft", "verify", "extend"):
        def call(*args: Any, fn: Callable = getattr(phases, name)) -> Any:
            out = fn(*args)
            torch.cuda.synchronize()
            return out
        setattr(phases, name, call)


class PhaseTimedEngine(EagleEngine):
    """Synchronizes the device after every phase, so that the engine's clock times each phase's
    own device work on CUDA (for milliseconds per phase only: the syncs slow it down)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        synchronize_phases(self.scheduler.phases)


def time_prompts(engine: EagleEngine, head: str | None, tree: TreeParams,
                 prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy answers to every prompt (after one warm-up, which also captures graphs): decode
    tokens/s (the prefill's token and time excluded), tau, milliseconds per phase per step
    (prefill: per prompt) and the answers' token ids."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.generate(prompts[0], replace(params, max_new_tokens=min(8, max_new_tokens)), tree,
                    head)
    tokens, seconds, steps, step_tokens = 0, 0.0, 0, 0
    phase_s: Counter[str] = Counter()
    answers = []
    for ids in prompts:
        result = engine.generate(ids, params, tree, head)
        s = result.stats
        tokens += s.num_tokens - 1
        seconds += s.elapsed_s - s.prefill_s
        steps, step_tokens = steps + s.num_steps, step_tokens + s.step_tokens
        phase_s.update(s.phase_s)
        phase_s["prefill"] += s.prefill_s
        answers.append(result.token_ids)
    phase_ms = {k: round(v * 1000 / (len(prompts) if k == "prefill" else max(steps, 1)), 3)
                for k, v in phase_s.items()}
    return {"status": "ran", "prompts": len(prompts), "tokens": tokens,
            "decode_s": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "tau": round(step_tokens / steps, 3) if head and steps else None,
            "phase_ms": phase_ms, "answers": answers}


VISITORS = 4  # requests the report steps together, as the app's default --max-batch


def time_together(engine: EagleEngine, head: str | None, tree: TreeParams,
                  prompts: list[list[int]], max_new_tokens: int) -> dict:
    """`VISITORS` greedy requests at a time (the prompts in turn) stepped together by the
    engine's scheduler, as the app's visitors are: tokens/s of all of them together, wall
    time from their submission to the last event (prefills included)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for n in buckets(VISITORS):  # captures the graphs of every batch-size bucket
        for _ in range(n):
            engine.scheduler.submit(prompts[0], replace(params, max_new_tokens=8), tree, head,
                                    trace=False)
        engine.scheduler.run_until_idle()
    batches = [[prompts[(i + j) % len(prompts)] for j in range(VISITORS)]
               for i in range(0, len(prompts), VISITORS)]
    tokens, seconds = 0, 0.0
    for batch in batches:
        t0 = time.perf_counter()
        handles = [engine.scheduler.submit(p, params, tree, head, trace=False) for p in batch]
        engine.scheduler.run_until_idle()
        seconds += time.perf_counter() - t0
        tokens += sum(list(h.events())[-1].stats["num_tokens"] for h in handles)
    return {"status": "ran", "requests": sum(map(len, batches)), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0}


def count_syncs(engine: EagleEngine, head: str | None, tree: TreeParams, prompt: list[int],
                params: SamplingParams) -> dict:
    """Host syncs of each iteration of one request (the prefill's event apart), counted with
    `sync_count.per_step` (HostSyncs on CPU, set_sync_debug_mode on CUDA)."""
    engine.generate(prompt, replace(params, max_new_tokens=4), tree, head)  # captures graphs
    steps = list(per_step(engine.stream(prompt, params, tree, head),
                          engine.target.device))
    counts = [s.total for _, s in steps[1:]]
    where: Counter[str] = Counter()
    for _, s in steps[1:]:
        where.update(s.where)
    return {"status": "ran", "counter": type(steps[0][1]).__name__, "iterations": len(counts),
            "per_iteration_max": max(counts, default=0),
            "per_iteration_mean": round(statistics.fmean(counts), 3) if counts else 0.0,
            "prefill": steps[0][1].total, "where": dict(where)}


def measure(args: argparse.Namespace, cuda: bool, budget: Budget) -> dict:
    """Plain decoding and EAGLE-3 on --target, eager and graphed: tokens/s on the prompts,
    speedups, host syncs per iteration and milliseconds per phase. Graphed rows are skipped
    without CUDA (on CPU the engine always runs eagerly)."""
    from . import autotune
    from .cli_args import pick_head, tree_params

    config = EngineConfig(target=args.target, drafts=(args.draft,), dtype=args.dtype,
                          device="cuda" if cuda else "cpu", max_len=args.max_len)
    loaded = EagleEngine.load(config)
    head = pick_head(loaded, args.draft)
    autotune.use_cached(loaded, head)
    tree = tree_params(args, loaded.default_tree)
    source, texts = load_prompts(args.prompts, args.limit)
    prompts = [loaded.encode(t) for t in texts]
    engines = {"eager": EagleEngine(loaded.target, loaded.tokenizer, loaded.heads,
                                    dataclasses.replace(config, cuda_graphs=False)),
               "graphs": loaded}  # graphs on (the default): CUDA graphs on CUDA
    no_cuda = {"status": "skipped", "reason": "no CUDA device (the CPU engine runs eagerly)"}
    runs = [(mode, graphs, head if mode == "eagle" else None)
            for mode in ("plain", "eagle") for graphs in ("eager", "graphs")]
    timings, syncs = [], []
    for mode, graphs, name in runs:
        row = {"mode": mode, "graphs": graphs == "graphs"}
        if graphs == "graphs" and not cuda:
            timings.append({**row, **no_cuda})
            continue
        timings.append(budget.skip(row) if budget.spent() else
                       {**row, **time_prompts(engines[graphs], name, tree, prompts,
                                              args.max_new_tokens)})
    by_key = {(t["mode"], t["graphs"]): t for t in timings}
    for key, other, field in ((("eagle", False), ("plain", False), "greedy_same_as_plain"),
                              (("eagle", True), ("plain", True), "greedy_same_as_plain"),
                              (("plain", True), ("plain", False), "greedy_same_as_eager"),
                              (("eagle", True), ("eagle", False), "greedy_same_as_eager")):
        if by_key[key]["status"] == by_key[other]["status"] == "ran":
            same = sum(a == b for a, b in zip(by_key[key]["answers"], by_key[other]["answers"]))
            by_key[key][field] = f"{same}/{len(prompts)}"
    sampled = SamplingParams(max_new_tokens=min(32, args.max_new_tokens), temperature=0.7,
                             top_p=0.9, seed=0)
    for mode, graphs, name in runs:
        for label, params in (("greedy", SamplingParams(max_new_tokens=sampled.max_new_tokens)),
                              ("sampled T=0.7 top_p=0.9", sampled)):
            row = {"mode": mode, "graphs": graphs == "graphs", "sampling": label}
            if graphs == "graphs" and not cuda:
                syncs.append({**row, **no_cuda})
                continue
            syncs.append(budget.skip(row) if budget.spent() else
                         {**row, **count_syncs(engines[graphs], name, tree, prompts[0], params)})
    together = []  # the app's path with several visitors: the scheduler steps them together
    for mode, graphs, name in runs:
        row = {"mode": mode, "graphs": graphs == "graphs", "visitors": VISITORS}
        if graphs == "graphs" and not cuda:
            together.append({**row, **no_cuda})
            continue
        together.append(budget.skip(row) if budget.spent() else
                        {**row, **time_together(engines[graphs], name, tree, prompts,
                                                args.max_new_tokens)})
    phases = phase_rows(timings, loaded, head, tree, prompts, args, cuda, budget)
    for t in timings:
        t.pop("answers", None)
        t.pop("phase_ms", None)
    return {"engine": {"target": args.target, "head": head, "weights": config.weights,
                       "dtype": config.dtype, "tree": dataclasses.asdict(tree)},
            "prompts": {"source": source, "count": len(prompts),
                        "max_new_tokens": args.max_new_tokens},
            "timings": timings, "visitors_together": together, "speedups": speedups(by_key),
            "syncs_per_iteration": syncs,
            "phase_ms": phases}


def speedups(by_key: dict[tuple[str, bool], dict]) -> list[dict]:
    """EAGLE-3 against plain decoding: eager/eager, graphs/graphs, graphs/graphed plain."""
    pairs = (("eagle eager vs plain eager", ("eagle", False), ("plain", False)),
             ("eagle graphs vs plain graphs", ("eagle", True), ("plain", True)),
             ("plain graphs vs plain eager", ("plain", True), ("plain", False)),
             ("eagle graphs vs eagle eager", ("eagle", True), ("eagle", False)))
    rows = []
    for name, a, b in pairs:
        ta, tb = by_key[a], by_key[b]
        skipped = next((t for t in (ta, tb) if t["status"] != "ran"), None)
        if skipped is not None:
            rows.append({"name": name, "status": "skipped", "reason": skipped["reason"]})
        else:
            rows.append({"name": name, "status": "ran",
                         "value": round(ta["tokens_per_s"] / tb["tokens_per_s"], 3)})
    return rows


def phase_rows(timings: list[dict], loaded: EagleEngine, head: str, tree: TreeParams,
               prompts: list[list[int]], args: argparse.Namespace, cuda: bool,
               budget: Budget) -> list[dict]:
    """Milliseconds per phase per step. On CPU every phase is synchronous: the timed runs'
    own clock. On CUDA the phases run asynchronously (one sync per iteration), so the graphed
    engine runs the prompts again with a sync after each phase (`PhaseTimedEngine`)."""
    rows = []
    for t in timings:
        row = {"mode": t["mode"], "graphs": t["graphs"]}
        if t["status"] != "ran":
            rows.append({**row, "status": "skipped", "reason": t["reason"]})
        elif not cuda:
            rows.append({**row, "status": "ran", "clock": "engine (CPU: synchronous)",
                         "ms": t["phase_ms"]})
        elif not t["graphs"]:
            rows.append({**row, "status": "skipped", "reason": "on CUDA only the graphed "
                         "engine is profiled (eager phases time their launches)"})
        elif budget.spent():
            rows.append(budget.skip(row))
        else:
            synced = PhaseTimedEngine(loaded.target, loaded.tokenizer, loaded.heads,
                                      loaded.config)
            timed = time_prompts(synced, head if t["mode"] == "eagle" else None, tree,
                                 prompts[:2], args.max_new_tokens)
            rows.append({**row, "status": "ran", "clock": "engine, synchronized after each "
                         "phase", "ms": timed["phase_ms"]})
    return rows


def report(args: argparse.Namespace) -> dict:
    """The checks (GPU ones skipped without CUDA) and the measurements, as JSON-ready data."""
    cuda = torch.cuda.is_available()
    budget = Budget(args.time_budget_s)
    if cuda:
        checks = [dataclasses.asdict(r) for r in gpu_checks()]
        device = f"cuda ({torch.cuda.get_device_name()})"
    else:
        checks = [{"check": c, "result": "skipped", "detail": "no CUDA device", "ok": None}
                  for c in GPU_CHECKS]
        device = f"cpu ({cpu_model()})"
    out = {"device": device, "cuda": cuda, "torch": torch.__version__, "checks": checks}
    if args.skip_model:
        return {**out, "measurements": {"status": "skipped", "reason": "--skip-model"}}
    out.update(measure(args, cuda, budget))
    greedy = [r for r in out["syncs_per_iteration"]
              if r["status"] == "ran" and r["sampling"] == "greedy"]
    check = {"check": "at most one host sync per greedy iteration (--target)", "ok": None,
             "result": "skipped", "detail": "no greedy request was counted"}
    if greedy:
        ok = all(r["per_iteration_max"] <= 1 for r in greedy)
        check.update(ok=ok, result="PASS" if ok else "FAIL",
                     detail=", ".join(f"{r['mode']} {'graphs' if r['graphs'] else 'eager'}: "
                                      f"max {r['per_iteration_max']}" for r in greedy))
    out["checks"].append(check)
    for t in out["timings"]:
        if "greedy_same_as_eager" in t:  # bf16 near-ties may flip: reported, not failed
            same = t["greedy_same_as_eager"].split("/")
            strict = out["engine"]["dtype"] == "fp32"
            ok = same[0] == same[1]
            out["checks"].append({"check": f"engine {t['mode']} graphs == eager (--target)",
                                  "result": "PASS" if ok else "FAIL" if strict else "differs",
                                  "detail": f"greedy answers {t['greedy_same_as_eager']}",
                                  "ok": ok if strict or ok else None})
    out["elapsed_s"] = round(time.perf_counter() - budget.start, 1)
    return out


def table_rows(rep: dict) -> list[Row]:
    rows = [Row(c["check"], c["result"], c["detail"], c["ok"]) for c in rep["checks"]]
    for t in rep.get("timings", []):
        name = f"tokens/s {t['mode']} {'graphs' if t['graphs'] else 'eager'}"
        if t["status"] != "ran":
            rows.append(Row(name, "skipped", t["reason"]))
            continue
        detail = f"{t['tokens']} tokens over {t['prompts']} prompts"
        if t["tau"] is not None:
            detail += f", tau {t['tau']:.2f}, greedy same as plain {t['greedy_same_as_plain']}"
        rows.append(Row(name, f"{t['tokens_per_s']:.1f}", detail))
    for t in rep.get("visitors_together", []):
        name = f"tokens/s {t['mode']} {'graphs' if t['graphs'] else 'eager'}, " \
               f"{t['visitors']} visitors at once"
        rows.append(Row(name, f"{t['tokens_per_s']:.1f}" if t["status"] == "ran" else "skipped",
                        f"{t['tokens']} tokens over {t['requests']} requests"
                        if t["status"] == "ran" else t["reason"]))
    for sp in rep.get("speedups", []):
        rows.append(Row(sp["name"], f"{sp['value']:.2f}x" if sp["status"] == "ran"
                        else "skipped", sp.get("reason", "")))
    for r in rep.get("syncs_per_iteration", []):
        name = (f"host syncs/iteration {r['mode']} {'graphs' if r['graphs'] else 'eager'} "
                f"{r['sampling']}")
        if r["status"] != "ran":
            rows.append(Row(name, "skipped", r["reason"]))
            continue
        where = ", ".join(r["where"])
        rows.append(Row(name, f"{r['per_iteration_mean']:.2f}",
                        f"max {r['per_iteration_max']} over {r['iterations']}: {where}"))
    for p in rep.get("phase_ms", []):
        name = f"ms/step {p['mode']} {'graphs' if p['graphs'] else 'eager'}"
        rows.append(Row(name, "ran" if p["status"] == "ran" else "skipped",
                        ", ".join(f"{k} {v:.2f}" for k, v in p["ms"].items())
                        if p["status"] == "ran" else p["reason"]))
    return rows


def format_table(rows: list[Row]) -> str:
    header = Row("check", "result", "detail")
    widths = [max(len(getattr(r, f)) for r in [header, *rows]) for f in ("check", "result")]
    return "\n".join(f"{r.check:<{widths[0]}}  {r.result:<{widths[1]}}  {r.detail}".rstrip()
                     for r in [header, *rows])


SKIPPED = """selfcheck: no CUDA device here, so nothing ran on a GPU. Skipped:
  - Triton kernels on the device against their torch references
  - every phase replayed as a CUDA graph against the eager phase (all extend paddings)
  - no host sync but the read-back in an iteration, under torch.cuda.set_sync_debug_mode('error')
  - engine output with graphs against without (tiny model and --target)
  - tokens/s eager vs graphs for plain decoding and EAGLE-3
The CPU side of these checks runs in CI: pytest tests/test_kernels.py tests/test_cuda_graph.py
`--report OUT.json` measures what runs here (CPU tokens/s, host syncs, ms per phase).
On a CUDA machine: """


def app_path_report(args: argparse.Namespace) -> dict:
    """`--app-path`: the app's serving path on --target (`app_path.check_app_path`): captured
    graphs on CUDA, GraphMode.STATIC on a CPU."""
    from .app_path import VISITORS, check_app_path
    from .cli_args import pick_head

    cuda = torch.cuda.is_available()
    config = EngineConfig(target=args.target, drafts=(args.draft,), dtype=args.dtype,
                          device="cuda" if cuda else "cpu", max_len=args.max_len,
                          max_batch=VISITORS, prefix_cache_mb=64)
    loaded = EagleEngine.load(config)
    head = pick_head(loaded, args.draft)
    graphed = EagleEngine(loaded.target, loaded.tokenizer, loaded.heads, config,
                          None if cuda else GraphMode.STATIC)
    eager = EagleEngine(loaded.target, loaded.tokenizer, loaded.heads,
                        replace(config, cuda_graphs=False, max_batch=1, prefix_cache_mb=0))
    _, texts = load_prompts(args.prompts, args.limit)
    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else f"cpu ({cpu_model()})"
    result = check_app_path(graphed, eager, head, [loaded.encode(t) for t in texts],
                            args.max_new_tokens)
    return {"device": device, "torch": torch.__version__, "target": args.target,
            "head": head, "dtype": config.dtype, "weights": config.weights,
            "checks": [{"check": result["check"], "result": "PASS" if result["ok"] else "FAIL",
                        "detail": "; ".join(result["failures"]) or
                        f"rounds {', '.join(result['rounds_equal'])}", "ok": result["ok"]}],
            "app_path": result}


def cmd_selfcheck(args: argparse.Namespace) -> None:
    if args.app_path:
        rep = app_path_report(args)
        print(json.dumps(rep["app_path"], indent=1))
        if args.report is not None:
            args.report.write_text(json.dumps(rep, indent=1) + "\n")
            print(f"report written to {args.report}")
        if not rep["app_path"]["ok"]:
            raise SystemExit(1)
        return
    if not torch.cuda.is_available() and args.report is None:
        print(SKIPPED + LLAMA_COMMAND)
        return
    rep = report(args)
    print(format_table(table_rows(rep)))
    if args.report is not None:
        args.report.write_text(json.dumps(rep, indent=1) + "\n")
        print(f"report written to {args.report}")
    if any(c["ok"] is False for c in rep["checks"]):
        raise SystemExit(1)


def add_selfcheck_parser(sub: argparse._SubParsersAction) -> None:
    from .cli_args import add_tree_args

    p = sub.add_parser("selfcheck", help="GPU path checks; eager-vs-graphs tokens/s, host "
                       "syncs and ms per phase (--report: JSON, also on CPU)",
                       description=f"The checks need CUDA (without it they are listed as "
                                   f"skipped). Documented run: {LLAMA_COMMAND}")
    p.add_argument("--target", default="bundled", help="bundled | HF directory | hub id")
    p.add_argument("--draft", default="bundled", help="bundled | directory | hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on CUDA; on CPU fp32 or the GGUF's q4 weights")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt")
    p.add_argument("--prompts", type=Path, default=None,
                   help="MT-bench-style jsonl (first turns); default: 10 built-in prompts")
    p.add_argument("--limit", type=int, default=10, help="prompts to time")
    p.add_argument("--report", type=Path, default=None,
                   help="write the checks and measurements here as JSON (runs on CPU too)")
    p.add_argument("--time-budget-s", type=float, default=540.0,
                   help="measurements that would start later are skipped")
    p.add_argument("--skip-model", action="store_true", help="only the tiny-model checks")
    p.add_argument("--app-path", action="store_true",
                   help="check the app's own serving path on --target (graphs captured at "
                        "warm-up, one scheduler on an engine thread, mixed trees, trace and "
                        "prefix cache on; on a CPU without capture) against the eager engine")
    add_tree_args(p)
    p.set_defaults(func=cmd_selfcheck)
