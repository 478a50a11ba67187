"""`python -m eagle_engine bench`: baseline vs EAGLE-3 on a prompt file, in one process.

Runs every prompt (multi-turn rows as conversations, feeding the first mode's own answers back)
through each requested mode and head, interleaved per prompt so both modes see the same machine
load, and reports tokens/s, mean accepted length tau, acceptance per depth, greedy agreement with
the baseline and the speedup measured in this run. `--sweep` compares tree shapes, each with or
without drafts from the context; `--costs` measures the verify cost of N tree tokens and the
draft step cost relative to one target step; `--other-weights-trees` loads the target a second
time with the other weight format (q4 <-> dense) and runs its baseline and EAGLE-3 with those
trees in the same rounds.
Not here: the decoding itself (`scheduler.py`, `run.py`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .. import hardware
from ..chat import load_rows
from ..config import (
    CONTEXT_DRAFTS,
    TREE_FORMAT,
    ConfigError,
    SamplingParams,
    TreeParams,
)
from ..kv_cache import causal_mask
from . import autotune
from .cli_args import (
    add_engine_args,
    add_sampling_args,
    add_tree_args,
    engine_config,
    tree_params,
)


def command_line() -> str:
    """This process's command as one runs it from the repository root: `python -m PACKAGE ...`
    or `PYTHONPATH=. python SCRIPT ...`."""
    script, args = Path(sys.argv[0]).resolve(), shlex.join(sys.argv[1:])
    if script.name == "__main__.py":
        return f"python -m {script.parent.name} {args}"
    root = Path(__file__).resolve().parents[2]  # the repository
    name = script.relative_to(root) if script.is_relative_to(root) else script
    return f"PYTHONPATH=. python {name} {args}"


def provenance() -> dict[str, str]:
    """Where a figure comes from, for `benchmarks/report.py`: the CPU class, model and flags, the
    torch build, the commit ("+changes" when the work tree differs from it), the date and the
    command that reproduces it."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"class": hardware.cpu_class(), "cpu": hardware.cpu_model(),
            "cpu_flags": " ".join(hardware.cpu_flags()), "torch": torch.__version__,
            "commit": commit + ("+changes" if changed else ""),
            "date": datetime.date.today().isoformat(), "command": command_line()}


def write_report(path: Path, report: dict) -> Path:
    """Writes `report` as JSON to `path`, or, when `path` is a folder, to
    `{kind}-{class}.json` in it (e.g. `bench-avx-512-epyc.json`), the name by which
    `benchmarks/report.py` takes a re-run's figure in place of the last one."""
    if path.is_dir():
        name = f"{report['kind']} {report['provenance']['class']}"
        path = path / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


@dataclass
class ModeTotals:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    same_as_baseline: int = 0
    compared: int = 0  # answers compared with a baseline answer (none for the baseline itself)

    def add(self, result, seconds: float) -> None:  # noqa: ANN001 - GenerationResult
        s = result.stats
        self.tokens += len(result.token_ids)
        self.seconds += seconds
        self.steps += s.num_steps
        self.step_tokens += s.step_tokens
        if len(self.accepted_per_depth) < len(s.accepted_per_depth):
            self.accepted_per_depth += [0] * (len(s.accepted_per_depth) -
                                              len(self.accepted_per_depth))
        for d, a in enumerate(s.accepted_per_depth):
            self.accepted_per_depth[d] += a

    def summary(self) -> dict:
        return {"tokens": self.tokens, "seconds": round(self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
                "tau": round(self.step_tokens / self.steps, 3) if self.steps else 0.0,
                "acceptance_per_depth": [round(a / self.steps, 3) for a in
                                         self.accepted_per_depth] if self.steps else [],
                **({"greedy_same_as_baseline": f"{self.same_as_baseline}/{self.compared}"}
                   if self.compared else {})}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="baseline vs EAGLE-3 speed and acceptance on prompts")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--modes", default="ar,eagle")
    p.add_argument("--heads", default=None, help="comma-separated heads to compare: bundled "
                   "head names or head directories (default: --draft)")
    p.add_argument("--sweep", default=None, help=f"tree shapes {SWEEP_FORMAT}")
    p.add_argument("--costs", action="store_true", help="measure verify/draft cost ratios")
    p.add_argument("--other-weights-trees", default=None,
                   help="also run the target with the other weights (q4 <-> dense in --dtype): "
                   f"its baseline and EAGLE-3 with these tree shapes {SWEEP_FORMAT}")
    p.add_argument("--first-turn-only", action="store_true")
    p.add_argument("--json", type=Path, default=None,
                   help="write the report here (a folder: as {kind}-{class}.json in it)")
    add_engine_args(p)
    add_tree_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_bench)


SWEEP_FORMAT = TREE_FORMAT[:-1] + ";...'"


def parse_sweep(text: str, context_drafts: bool = CONTEXT_DRAFTS) -> list[TreeParams]:
    """'k=4,s=3,n=8;k=2,s=1,n=3,cut=0.1,ctx=off' -> trees (`TreeParams.parse`; a tree that
    does not name `ctx` takes `context_drafts`), so one run can compare trees."""
    base = TreeParams(context_drafts=context_drafts)
    return [TreeParams.parse(part, base) for part in text.split(";") if part.strip()]


@dataclass(frozen=True)
class Run:
    label: str
    engine: Any  # EagleEngine (imported lazily)
    head: str | None  # None: the baseline
    tree: TreeParams


def run_modes(rows: list[dict], runs: list[Run], params: SamplingParams,
              first_turn_only: bool) -> dict[str, ModeTotals]:
    """Every run on every turn, the order rotated by one run per prompt row, so that each run
    takes each place in turn (the order alone can turn a 3-4% difference between two heads on
    the same tree around). The first run's answers build the
    conversations; an EAGLE-3 answer is compared with the baseline answer of its own engine."""
    totals = {r.label: ModeTotals() for r in runs}
    for i, row in enumerate(rows):
        messages: list[dict[str, str]] = []
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        for turn in row["turns"][:1] if first_turn_only else row["turns"]:
            messages.append({"role": "user", "content": turn})
            prompt = runs[0].engine.encode(messages)
            results = {}
            for run in order:
                t0 = time.perf_counter()
                results[run.label] = run.engine.generate(prompt, params, run.tree, run.head)
                totals[run.label].add(results[run.label], time.perf_counter() - t0)
            baseline_ids = {id(r.engine): results[r.label].token_ids for r in runs
                            if r.head is None}
            for run in runs:
                if run.head is not None and id(run.engine) in baseline_ids:
                    same = results[run.label].token_ids == baseline_ids[id(run.engine)]
                    totals[run.label].same_as_baseline += same
                    totals[run.label].compared += 1
            messages.append({"role": "assistant", "content": results[runs[0].label].text})
        print(f"[{i + 1}/{len(rows)}] " + "  ".join(
            f"{k}: {v.summary()['tokens_per_s']} tok/s tau {v.summary()['tau']}"
            for k, v in totals.items()), flush=True)
    return totals


def target_forward(engine, n: int, context: int,  # noqa: ANN001 - EagleEngine
                   aux_layer_ids: tuple[int, ...] = ()) -> Callable[[], None]:
    """A target forward of `n` tokens after `context` tokens, causal (a chain-shaped tree), as a
    callable for `interleaved_medians`."""
    target, dev = engine.target, engine.target.device
    cache = target.new_cache(max_len=context + n)

    def forward() -> None:
        ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        pos = torch.arange(context, context + n, device=dev)[None]
        target(ids, pos, cache, context, causal_mask(n, context, dev) if n > 1 else None,
               aux_layer_ids)
    return forward


@torch.inference_mode()
def interleaved_medians(fns: dict[Any, Callable[[], None]], repeats: int,
                        warmup: int) -> dict[Any, float]:
    """Median seconds of each callable over `repeats` rounds after `warmup` rounds; each round
    calls every callable once, in turn, so a slow spell of the machine hits all alike."""
    times: dict[Any, list[float]] = {key: [] for key in fns}
    for r in range(warmup + repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[key].append(time.perf_counter() - t0)
    return {key: sorted(v)[len(v) // 2] for key, v in times.items()}


VERIFY_SIZES = (4, 8, 16, 32, 48, 64)  # tree tokens priced by `measure_costs`


def measure_costs(engine, head: str | None, context: int = 300, repeats: int = 21,  # noqa: ANN001
                  warmup: int = 3) -> dict:
    """Median time (`interleaved_medians`, in inference mode like the engine) of a target
    forward of N tokens after `context` tokens relative to N=1, and of one draft decode step
    with K tokens relative to one target token."""
    dev = engine.target.device
    shapes = {("target", n): target_forward(engine, n, context) for n in (1, *VERIFY_SIZES)}
    if head is not None:
        model = engine.heads[head]
        dcache = model.new_cache(context + 128)

        def draft_fwd(k: int) -> None:
            ids = torch.zeros(1, k, dtype=torch.long, device=dev)
            hid = torch.zeros(1, k, model.cfg.hidden_size, dtype=model.norm.weight.dtype,
                              device=dev)
            pos = torch.full((1, k), context, device=dev)
            model(ids, hid, pos, dcache, context, None, from_target=False)
        shapes |= {("draft", k): lambda k=k: draft_fwd(k) for k in (1, 4, 8)}
    median = interleaved_medians(shapes, repeats, warmup)
    base = median[("target", 1)]
    out = {"target_1_token_ms": round(base * 1000, 2),
           "verify_cost_vs_1_token": {n: round(median[("target", n)] / base, 2)
                                      for n in VERIFY_SIZES}}
    if head is not None:
        out["draft_step_cost_vs_target_token"] = {k: round(median[("draft", k)] / base, 3)
                                                  for k in (1, 4, 8)}
    return out


def mode_runs(engine, suffix: str, modes: list[str], heads: list[str],  # noqa: ANN001
              trees: list[TreeParams]) -> list[Run]:
    """The baseline (if asked) then each head with each tree, labelled `ar{suffix}` and
    `eagle{suffix}[head kK sS nN]`."""
    runs = [Run(f"ar{suffix}", engine, None, trees[0])] if "ar" in modes else []
    for h in heads if "eagle" in modes else []:
        runs += [Run(f"eagle{suffix}[{h} {autotune.tree_label(t)}]", engine, h, t)
                 for t in trees]
    return runs


def cmd_bench(args: argparse.Namespace) -> None:
    from ..engine import EagleEngine, head_name
    from .cli_args import pick_head

    rows = load_rows(args.prompts, args.limit)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ar", "eagle")]
    if bad:
        raise ConfigError(f"unknown modes {bad}; use ar and/or eagle")
    config = engine_config(args, need_draft="eagle" in modes)
    specs = [h for h in args.heads.split(",") if h] if args.heads and "eagle" in modes else []
    names = [head_name(h) for h in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--heads {args.heads!r} names two heads alike ({names}); "
                          "give heads with different directory names")
    engine = EagleEngine.load(replace(config, drafts=tuple(specs)) if specs else config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    heads = names or ([pick_head(engine, args.draft)] if "eagle" in modes else [])
    autotune.use_cached(engine, heads[0] if heads else None)
    tree = tree_params(args, engine.default_tree)
    sweep = parse_sweep(args.sweep, tree.context_drafts) if args.sweep else [tree]
    runs = mode_runs(engine, "", modes, heads, sweep)
    if args.other_weights_trees:
        other = EagleEngine.load(replace(engine.config, dtype=args.dtype, weights=(
            "dense" if engine.config.weights == "q4" else "q4")))
        runs += mode_runs(other, " " + other.config.weights_label, modes, heads,
                          parse_sweep(args.other_weights_trees))
    for warm in {id(r.engine): r.engine for r in runs}.values():
        warm.generate(warm.encode("Hello"), SamplingParams(max_new_tokens=8))
    report: dict = {"kind": "bench", "prompts": str(args.prompts), "rows": len(rows),
                    "dtype": engine.config.dtype,
                    "weights": engine.config.weights_label,
                    "max_new_tokens": args.max_new_tokens, "sampling": {
                        "temperature": args.temperature, "top_p": args.top_p,
                        "top_k": args.top_k, "seed": args.seed},
                    "torch_threads": torch.get_num_threads(),
                    "provenance": provenance()}
    if args.costs:
        report["costs"] = measure_costs(engine, heads[0] if heads else None)
        print(json.dumps(report["costs"]), flush=True)
    totals = run_modes(rows, runs, params, args.first_turn_only)
    report["modes"] = {k: v.summary() for k, v in totals.items()}
    if "ar" in totals:
        ar = totals["ar"].summary()["tokens_per_s"]
        for k, v in report["modes"].items():
            v["speedup_vs_ar"] = round(v["tokens_per_s"] / ar, 3) if ar else None
    for suffix in {r.label[2:] for r in runs if r.head is None and r.label != "ar"}:
        other_ar = totals["ar" + suffix].summary()["tokens_per_s"]
        for k, v in report["modes"].items():
            if k.startswith(f"eagle{suffix}["):
                v["speedup_vs_own_ar"] = (round(v["tokens_per_s"] / other_ar, 3) if other_ar
                                          else None)
    print(json.dumps(report, indent=2))
    if args.json:
        print(f"wrote {write_report(args.json, report)}")
