"""`selfcheck --app-path`: the app's own serving path, checked in one command.

It runs what the app runs: the engine's one scheduler with its graphs captured at warm-up
(`EagleEngine.warm_up`), stepped on an engine thread of its own (`Scheduler.step_on`), trace on
and the prefix cache on. Plain and EAGLE-3 requests of mixed trees (the default, a min score,
drafts from the context, a step cut) are stepped together, in two rounds in opposite orders
(the second reuses the first's rows from the prefix cache), and every greedy answer must equal
the answer of an eager engine (no graphs, no batching, no prefix cache) to the same request
alone. Then tokens/s of plain decoding and of EAGLE-3 for one visitor and for `VISITORS`
together. On CUDA the graphs are captured and every runner must hold its graph; on a CPU the
same path runs in GraphMode.STATIC (the graphed phases over the pools, not captured), which
`make test` runs on tiny models (tests/test_app_path.py).
Not here: the phase checks against their references (`selfcheck.py`), the app itself.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..config import SamplingParams, TreeParams
from ..cuda_graph import GraphMode, GraphPhases
from ..engine import EagleEngine

VISITORS = 4  # requests timed together, as the app's default --max-batch


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    tree: TreeParams
    head: str | None

    @property
    def label(self) -> str:
        return "plain" if self.head is None else f"{self.head} {self.tree.spec()}"


def mixed_requests(prompts: list[list[int]], head: str, default: TreeParams) -> list[Request]:
    """Plain and EAGLE-3 requests over `prompts` in turn, EAGLE-3 under the default tree and
    under it with its min score, its drafts from the context and its step cut each switched
    (on where the default has none, off where it has one)."""
    trees = [default, replace(default, min_score=0.0 if default.min_score else 0.1),
             replace(default, context_drafts=not default.context_drafts),
             replace(default, step_cut=0.0 if default.step_cut else 0.5)]
    kinds = [(t, head) for t in trees] + [(default, None)]
    return [Request(prompts[i % len(prompts)], *kinds[i % len(kinds)])
            for i in range(max(len(kinds), len(prompts)))]


def answers_of(engine: EagleEngine, requests: list[Request], params: SamplingParams
               ) -> tuple[list[list[int]], int]:
    """Submit every request at once to the engine's scheduler (stepping on its executor), then
    read each one's tokens -> (the answers, prompt tokens restored from the prefix cache)."""
    handles = [engine.scheduler.submit(r.prompt, params, r.tree, r.head, trace=True)
               for r in requests]
    events = [list(h.events()) for h in handles]
    return ([[t.token_id for ev in evs for t in ev.tokens] for evs in events],
            sum(evs[-1].stats["reused_tokens"] for evs in events))


def tokens_per_s(engine: EagleEngine, requests: list[Request], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    handles = [engine.scheduler.submit(r.prompt, params, r.tree, r.head, trace=True)
               for r in requests]
    tokens = sum(list(h.events())[-1].stats["num_tokens"] for h in handles)
    return round(tokens / (time.perf_counter() - t0), 2)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_app_path(graphed: EagleEngine, eager: EagleEngine, head: str,
                   prompts: list[list[int]], max_new_tokens: int) -> dict:
    """See the module docstring. `graphed`: the engine as the app builds it (graphs or
    STATIC, max_batch >= VISITORS, a prefix cache); `eager`: the reference over the same
    weights. Answers must be equal in fp32; in bf16, fp16 or q4 (whose graphed path runs the
    attention in torch, not in the fused C++ layers) rounding may flip a near-tie, so a
    different answer is reported with the tokens it shares, not failed."""
    phases = graphed.scheduler.phases
    if not isinstance(phases, GraphPhases):
        raise ValueError("the app-path check needs an engine on the graphed path "
                         f"(GRAPHS or STATIC), got {graphed.graph_mode.value}")
    t0 = time.perf_counter()
    graphed.warm_up(prompts[0])
    warm = {"graphs": len(phases.runners), "seconds": round(time.perf_counter() - t0, 2),
            "mib": round(sum(r.bytes for r in phases.runners.values()) / 2 ** 20, 2)}
    pinned = set(phases.runners)
    executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
    graphed.scheduler.step_on(executor)
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        requests = mixed_requests(prompts, head, graphed.default_tree)
        want = [eager.generate(r.prompt, params, r.tree, r.head).token_ids for r in requests]
        strict = graphed.config.dtype == "fp32" and graphed.config.weights != "q4"
        rounds, reused, failures, differ = [], [], [], []
        for order in (requests, requests[::-1]):
            answers, restored = answers_of(graphed, order, params)
            got = dict(zip(map(id, order), answers))
            same = [got[id(r)] == w for r, w in zip(requests, want)]
            rounds.append(f"{sum(same)}/{len(same)}")
            reused.append(restored)
            differ += [f"{r.label}: the first {common_prefix(got[id(r)], w)} of {len(w)} "
                       f"tokens equal" for r, w, ok in zip(requests, want, same) if not ok]
        if strict:
            failures += differ
        later = sorted(str(k) for k in set(phases.runners) - pinned)
        uncaptured = [str(k) for k, r in phases.runners.items() if r.graph is None]
        if phases.mode is GraphMode.GRAPHS and uncaptured:
            failures.append(f"runners not captured: {uncaptured[:3]}")
        default = graphed.default_tree
        speeds = {}
        for mode, name in (("plain", None), ("eagle", head)):
            one = [Request(prompts[0], default, name)]
            many = [Request(prompts[i % len(prompts)], default, name) for i in range(VISITORS)]
            speeds[mode] = {"1 visitor": tokens_per_s(graphed, one, params),
                            f"{VISITORS} visitors": tokens_per_s(graphed, many, params)}
    finally:
        executor.shutdown()
    return {"check": "app path: greedy answers == eager alone, every runner captured",
            "ok": not failures, "mode": phases.mode.value, "requests": len(requests),
            "rounds_equal": rounds, "strict": strict, "differs": differ[:10],
            "prefix_cache_tokens": reused, "failures": failures[:5],
            "warm_up": warm,
            "captured_in_answers": later, "tokens_per_s": speeds,
            "seconds": round(time.perf_counter() - t0, 1)}
