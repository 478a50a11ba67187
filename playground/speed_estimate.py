"""The speedup estimate the playground shows on every speculative answer: how long plain decoding
(the target alone) would have taken for the same tokens, under the load this answer ran under.

Load (a browser drawing the page on the same cores, other programs) slows every target forward,
so a plain speed measured at start-up, on a quiet machine, would make the estimate read low
under load. The estimate takes ratios instead, which load scales alike: at start-up (`measure`) a
verify forward over a tree of N rows costs `VerifyCost.ratio(N, context)` plain-decoding steps
(a table over N at a short and at a long context). An answer's own verify forwards, each
divided by its ratio, give the plain step under the answer's load, at the answer's context
lengths; `estimate` compares the answer's engine time with its prefill plus one such step per
further token. `measured_speedup` is the figure a compare run measures, on the same terms.
Not here: running answers (`engine.py`) or drawing the tile (`ui_render.py`).
"""
from __future__ import annotations

import functools
import itertools
import statistics
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.events import StepEvent

WARMUP_TOKENS = 24  # tokens of each warm-up run
WARMUP_ROWS = (1, 2, 4, 8, 16, 32, 64)  # tree rows measured (1: the root alone)
WARMUP_LONG_CONTEXT = 480
WARMUP_TEXT = ("Speculative decoding lets a small draft model propose tokens that a large "
               "target model verifies in one forward pass. ")


@dataclass(frozen=True, slots=True)
class Verify:
    """One EAGLE-3 iteration's verify forward, as its event reports it."""

    ms: float  # the verify phase (`StepEvent.timings_ms["verify"]`)
    rows: int  # tree rows verified, the root included
    answered: int  # tokens of the answer before this iteration
    batch: int  # requests that shared the engine step


def verify_of(ev: StepEvent, answered: int) -> Verify | None:
    """The verify forward of an EAGLE-3 iteration's event (one with its tree: events traced for
    the UI); None for other events. `answered`: the answer's tokens before the event."""
    if ev.mode != "eagle" or not ev.tree or "verify" not in ev.timings_ms:
        return None
    return Verify(ev.timings_ms["verify"], len(ev.tree), answered, ev.batch)


@dataclass(frozen=True)
class CostTable:
    """A verify forward's cost in plain-decoding steps against its rows, at one context."""

    context: float  # mean context length of the runs measured
    rows: tuple[int, ...]  # increasing
    ratios: tuple[float, ...]  # verify ms of that many rows / ms of one plain step

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.ratios):
            raise ValueError(f"a cost table needs as many ratios as rows, got {self.rows} and "
                             f"{self.ratios}")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])) or self.rows[0] < 1:
            raise ValueError(f"a cost table's rows must increase from 1 or more: {self.rows}")
        if any(not r > 0 for r in self.ratios):
            raise ValueError(f"a cost table's ratios must be positive: {self.ratios}")

    def at(self, rows: float) -> float:
        """Linear between measured rows; past the largest, the last segment's slope goes on
        (a verify forward grows about linearly in its rows); below the smallest, flat."""
        xs, ys = self.rows, self.ratios
        if len(xs) == 1 or rows <= xs[0]:
            return ys[0]
        i = min(bisect_right(xs, rows), len(xs) - 1)  # the segment xs[i-1]..xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])


@dataclass(frozen=True)
class VerifyCost:
    """One target's (one weights format's) verify cost in plain steps, measured at start-up."""

    tables: tuple[CostTable, ...]  # by increasing context

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("a verify cost needs at least one table")
        contexts = [t.context for t in self.tables]
        if contexts != sorted(set(contexts)):
            raise ValueError(f"tables must have increasing contexts, got {contexts}")

    def ratio(self, rows: float, context: float) -> float:
        """The table's ratio at `rows`, linear in the context between the tables (flat outside
        the measured contexts)."""
        ts = self.tables
        if len(ts) == 1 or context <= ts[0].context:
            return ts[0].at(rows)
        if context >= ts[-1].context:
            return ts[-1].at(rows)
        i = bisect_right([t.context for t in ts], context)
        lo, hi = ts[i - 1], ts[i]
        w = (context - lo.context) / (hi.context - lo.context)
        return (1 - w) * lo.at(rows) + w * hi.at(rows)


def cost_table(context: float, plain_step_ms: float, verifies: Sequence[tuple[int, float]]
               ) -> CostTable:
    """The table of (rows, verify ms) observations: the median ms per row count over the plain
    step, made non-decreasing in the rows (a larger tree never verifies faster; a lower value
    is noise, such as a first call that paid for a new shape)."""
    if plain_step_ms <= 0 or not verifies:
        raise ValueError(f"a cost table needs a positive plain step and verify timings, got "
                         f"{plain_step_ms} ms and {len(verifies)} timings")
    by_rows: dict[int, list[float]] = {}
    for rows, ms in verifies:
        by_rows.setdefault(rows, []).append(ms)
    rows = tuple(sorted(by_rows))
    ratios, top = [], 0.0
    for r in rows:
        top = max(top, statistics.median(by_rows[r]) / plain_step_ms)
        ratios.append(top)
    return CostTable(context, rows, tuple(ratios))


@dataclass(frozen=True)
class Estimate:
    speedup: float  # estimated plain time / this answer's engine time
    plain_s: float
    prefill_s: float
    ms_per_token: float  # estimated plain step under this answer's load
    verify_ms: float  # this answer's mean verify forward
    rows: float  # its mean tree rows
    ratio: float  # the mean cost of its verify forwards, in plain steps (measured at start-up)

    def explain(self, num_tokens: int, elapsed_s: float) -> str:
        return (f"Estimated, not measured: this answer's verify forwards took {self.verify_ms:.1f}"
                f" ms on average over {self.rows:.1f} tree rows, and at start-up such a forward "
                f"cost {self.ratio:.2f} plain-decoding steps, so a plain step took "
                f"{self.ms_per_token:.1f} ms under this answer's load. Plain decoding of these "
                f"{num_tokens} token{'s' * (num_tokens != 1)}: this answer's prefill "
                f"{self.prefill_s:.2f} s + {max(num_tokens - 1, 0)} "
                f"step{'s' * (num_tokens != 2)} × {self.ms_per_token:.1f} ms = "
                f"{self.plain_s:.2f} s, against {elapsed_s:.2f} s taken. Press 'Race plain "
                "decoding' to measure it.")


def estimate(cost: VerifyCost | None, prompt_len: int, verifies: Sequence[Verify],
             stats: dict[str, Any]) -> Estimate | None:
    """Estimated speedup of a speculative answer over plain decoding from its verify forwards
    and its stats (`RunStats.to_dict()`): the plain step is the verify time over what those
    forwards cost in plain steps (each at its rows and context). None without a measured cost,
    a verify forward or engine time, and when another request shared a step: the shared
    forwards verified its rows too, and the answer's time waited for them."""
    n, elapsed = int(stats.get("num_tokens", 0)), float(stats.get("elapsed_s", 0.0))
    if cost is None or not verifies or elapsed <= 0 or n < 1:
        return None
    if any(v.batch > 1 for v in verifies):
        return None
    steps = sum(cost.ratio(v.rows, prompt_len + v.answered) for v in verifies)
    verify_ms = sum(v.ms for v in verifies)
    plain_ms = verify_ms / steps
    prefill = float(stats.get("prefill_s", 0.0))
    plain_s = prefill + max(n - 1, 0) * plain_ms / 1000
    k = len(verifies)
    return Estimate(plain_s / elapsed, plain_s, prefill, plain_ms, verify_ms / k,
                    sum(v.rows for v in verifies) / k, steps / k)


def decode_steps(stats: dict[str, Any]) -> tuple[int, float]:
    """A plain run's decode steps after its prefill (one per token after the first) and their
    seconds."""
    return (int(stats.get("num_tokens", 0)) - 1,
            float(stats.get("elapsed_s", 0.0)) - float(stats.get("prefill_s", 0.0)))


def measured_speedup(stats: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The speedup a compare run measured: the baseline's decoding time per token (its steps
    after prefill) over this answer's tokens, plus this answer's own prefill, against this
    answer's engine time; None when the baseline decoded no step. The baseline runs second and
    finds the prompt in the prefix cache, so its own prefill is left out: both sides then count
    the same prompt work, as `estimate` does."""
    steps, decode = decode_steps(base)
    elapsed = float(stats.get("elapsed_s", 0.0))
    if steps < 1 or decode <= 0 or elapsed <= 0:
        return None
    n = int(stats.get("num_tokens", 0))
    return (float(stats.get("prefill_s", 0.0)) + max(n - 1, 0) * decode / steps) / elapsed


def plain_step_ms(events: Sequence[StepEvent]) -> float:
    """A plain run's step: the median time between its events after the first decode step
    (engine time, so with every cost of a step, not only its forward)."""
    times = [1000 * float(ev.stats["elapsed_s"]) for ev in events]
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    if not gaps:
        raise ValueError(f"a plain run of {len(events)} events has no step to time")
    return statistics.median(gaps)


def warmup_tree(rows: int) -> TreeParams:
    """A tree that verifies `rows` rows every iteration: the full budget (no cut, no drafts
    from the context); 1 row is the root alone (no draft reaches a 0.99 path probability)."""
    if rows == 1:
        return TreeParams(topk=8, num_steps=2, num_draft_tokens=2, context_drafts=False,
                          min_score=0.99)
    return TreeParams(topk=8, num_steps=2, num_draft_tokens=rows, context_drafts=False)


def measure(engine: Any, head: str | None, tokens: int = WARMUP_TOKENS,
            run: Callable[[Callable[[], Any]], Any] = lambda unit: unit()) -> VerifyCost | None:
    """Warm-up: after a short prompt and after a long one (at most half the context window),
    a plain run and one EAGLE-3 run with `head` per tree of `WARMUP_ROWS` (those that fit the
    window), EOS ignored -> the verify cost table; None without a head. `run` runs each of
    those runs (the app's: on the engine thread, while no visitor is answered)."""
    if head is None:
        return None

    def events(ids: list[int], tree: TreeParams | None) -> list[StepEvent]:
        return run(functools.partial(engine.generate, ids, params, tree,
                                     head if tree else None, keep_events=True)).events
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    window = engine.config.max_len
    long_len = min(WARMUP_LONG_CONTEXT, window // 2)
    text_ids = engine.encode(WARMUP_TEXT)
    long = (text_ids * (long_len // len(text_ids) + 1))[:long_len]
    tables = []
    for ids in (engine.encode("Hi"), long):
        trees = [warmup_tree(n) for n in WARMUP_ROWS if len(ids) + tokens + n < window]
        if not trees or (tables and tables[-1].context >= len(ids) + tokens / 2):
            continue
        plain = events(ids, None)
        verifies = [(v.rows, v.ms) for tree in trees for ev in events(ids, tree)
                    if (v := verify_of(ev, 0)) is not None]
        tables.append(cost_table(len(ids) + tokens / 2, plain_step_ms(plain), verifies))
    return VerifyCost(tuple(tables)) if tables else None


BUSY_BELOW = 0.6  # an answer's CPU share (`RunStats.cpu_share`) under which load sets its times


def starved(stats: dict[str, Any]) -> bool:
    """Whether a CPU answer's process got much less CPU time than its threads asked for
    (`RunStats.cpu_share`), or stepped on fewer threads because other work took the cores
    (`cpu_share.ThreadGovernor`): its times then measure the load."""
    return bool(stats.get("thinned")) or float(stats.get("cpu_share", 1.0)) < BUSY_BELOW


def slower_note(ratio: float, tree: TreeParams, cost: VerifyCost | None, measured: str) -> str:
    """The sentence shown where EAGLE-3 runs slower than plain decoding here (`ratio` < 1, its
    speed over plain decoding's, `measured`: where that figure comes from): why, from what a
    verify row costs on this machine (`cost`, at a short context)."""
    rows = max(tree.num_draft_tokens, 2)
    why = ""
    if cost is not None:
        steps = cost.ratio(rows, 0.0)
        why = (f" verifying a tree of {rows} tokens costs {steps:.1f} one-token steps here "
               f"(each draft token {(steps - 1) / (rows - 1):.2f} of a step), more than its "
               "accepted drafts save, so")
    return (f"On this CPU{why} EAGLE-3 runs at {ratio:.2f}× plain decoding ({measured}). It "
            "stays on: it is what this playground shows; plain decoding is one switch away.")
