"""What `auto` means on this machine: a short measurement, taken once and cached, of which
target weights and which draft tree decode fastest here.

`tune(engines, head)` decodes built-in prompts greedily (EOS ignored, the same number of tokens
each) and times the decoding (each request's time less its prefill, which every system shares),
in two stages:
1. every loaded engine (one per target weight format) alone and with its static default tree
   (`EngineConfig.default_tree`), on one first turn: the weight format whose better figure is
   the higher is the fastest;
2. on that engine, each candidate tree of its format (`CANDIDATES`) on six conversations in
   MT-bench's categories, both turns (the second on the engine's own plain first answer, as in
   MT-bench, where drafts from the context carry much of the gain). A tree whose output differs
   from plain decoding is not correct and never chosen. The static default stays unless
   another tree is faster by more than the measurement's noise (`choose`): the default comes
   from the full MT-bench on this CPU class, and a minute of 48-token requests on a shared
   2-core machine cannot rank trees that lie within a few percent of each other.
Speed follows the CPU class (an AVX2 EPYC and an AVX-512 Xeon price a tree row differently),
so the result is cached as JSON under the user cache, keyed by the torch version, the CPU model
and flags, the kernel source, the target, the head (its files' bytes, so retrained weights under
the same name are measured anew) and the candidates; later starts read it.
`apply` gives each engine its chosen tree (`EagleEngine.default_tree`) and orders the engines
fastest first. The app tunes at its first start; `python -m eagle_engine tune` does it from the
command line, and `generate` and `bench` read the cached result. Not here: the static defaults
used when nothing was measured (`config.py`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import CHAIN_SURE, CONTEXT_DRAFTS, Q4_TREE, SamplingParams, TreeParams
from ..cpu_share import STARVED_BELOW, CpuClock
from ..engine import head_source
from ..hardware import cache_root, cpu_flags, cpu_model
from ..kernels.cpu_lowbit import source_digest

log = logging.getLogger(__name__)

VERSION = 7  # 2: trees carry their min_score; 3: second turns, decoding time, `choose`;
# 4: trees carry their context_extra; 5: and their step_cut; 6: trees as named fields;
# 7: the CPU share measured under
MIN_CORE_S = 1.0  # core-seconds measured before the CPU share is judged
CONVERSATIONS = (  # (first turn, second turn), in MT-bench's categories
    ("Write a short Python function that reverses a string, and explain it.",
     "Now add a docstring and one test for it."),
    ("Write a short blog post about a trip to a city you like, with its sights and food.",
     "Rewrite your post for a travel magazine, in a more formal tone."),
    ("Alice is taller than Bob and Bob is taller than Carol. Who is the shortest? Explain.",
     "Now add Dave, who is shorter than Bob but taller than Carol. Order all four."),
    ("What is the sum of the integers from 1 to 100? Show the steps.",
     "Now do the same for the even integers from 1 to 100."),
    ("Explain what a hash table is to a new programmer.",
     "Summarize your explanation in two sentences."),
    ("Give me three tips for sleeping better.",
     "Rewrite your answer as one short paragraph."))
FIRST_ANSWER = 128  # tokens of the plain first answer that a second turn follows
NEW_TOKENS = 48  # tokens decoded per timed request
ROUNDS = 1
NOISE_Z = 3.0  # a tree replaces the static default when its mean gain exceeds this many
# standard errors of the paired samples. Five candidates face the default, each on 12 samples
# whose standard error is itself estimated: at 2.0 a tie passes ~15% of the time, often enough
# to replace the default with a tree the full MT-bench puts a few percent behind; at 3.0 a tie
# passes ~3% of the time, and with a standard error of 2-5% a gain of ~6-15%.


CANDIDATES = {  # per weights label; the static defaults first
    "q4": (Q4_TREE, *(TreeParams.parse(t) for t in (
        "k=3,s=1,n=4,cut=0.05,extra=8", "k=2,s=1,n=3,cut=0.05,extra=8", "k=1,s=1,n=2,extra=8",
        "k=2,s=2,n=5,cut=0.1,extra=8,step=0.5", "k=3,s=3,n=5,cut=0.1,extra=8,step=0.4"))),
    "dense": (TreeParams(), TreeParams.parse("k=4,s=3,n=6"), TreeParams.parse("k=2,s=3,n=4")),
}


def tree_label(tree: TreeParams) -> str:
    """'k2 s2 n3', with ' min0.1' for a min_score, ' step0.5' for a step_cut and ' +ctx' when
    the tree takes drafts from the context (' +ctx+8' with a context_extra of 8)."""
    extra = f"+{tree.context_extra}" if tree.context_extra else ""
    ctx = f" +ctx{extra}" if tree.context_drafts else ""
    cut = f" min{tree.min_score:g}" if tree.min_score else ""
    step = f" step{tree.step_cut:g}" if tree.step_cut else ""
    return f"k{tree.topk} s{tree.num_steps} n{tree.num_draft_tokens}{cut}{step}{ctx}"


@dataclass
class Measured:
    """One engine's figures: decoding tokens/s of plain decoding and of each correct tree tried
    (label ->), and the tree chosen among them (`choose`; None when none was correct)."""

    weights: str
    plain_tok_s: float
    tree_tok_s: dict[str, float] = field(default_factory=dict)
    trees: dict[str, str] = field(default_factory=dict)  # label -> `TreeParams.spec`
    incorrect: list[str] = field(default_factory=list)
    chosen: str | None = None

    def best_tree(self) -> TreeParams | None:
        """The chosen tree, or None when no tree was correct."""
        if self.chosen is None:
            return None
        return TreeParams.parse(self.trees[self.chosen])

    def best_tok_s(self) -> float:
        """The speed of this weight format: plain decoding's or the chosen tree's."""
        return max(self.plain_tok_s, self.tree_tok_s.get(self.chosen, 0.0))


@dataclass
class Tuned:
    """The measurement: per weights label, fastest first (`order`), and what it cost."""

    head: str | None
    measured: dict[str, Measured]
    order: list[str]
    seconds: float
    cpu: str
    cpu_share: float = 1.0  # the process's share of its cores while measuring (`Meter`)
    loaded: bool = False  # other work took the cores: the figures are not used nor cached

    def summary(self, weights: str, name: Callable[[TreeParams], str] | None = None) -> str:
        """One line for the status bar: why this weight format and tree; `name` names a tree
        (default: its label, `tree_label`)."""
        if self.loaded:
            why = (f"this process got {100 * self.cpu_share:.0f}% of its cores"
                   if self.cpu_share < STARVED_BELOW else "other processes took the cores")
            return (f"not measured: the machine was busy ({why}), so the default tree for this "
                    "CPU class stays; a later quiet start measures again")
        m = self.measured[weights]
        what = "plain decoding: "
        if m.chosen is not None:
            tree = (f"tree {m.chosen}" if name is None
                    else name(TreeParams.parse(m.trees[m.chosen])))
            what = (f"EAGLE-3 with {tree}: {m.tree_tok_s[m.chosen]:.0f} tok/s; "
                    "plain decoding: ")
        others = ", ".join(f"{w} {self.measured[w].best_tok_s():.0f}" for w in self.order
                           if w != weights)
        return (f"{what}{m.plain_tok_s:.0f} tok/s"
                + (f"; other weights: {others} tok/s" if others else "")
                + f" ({NEW_TOKENS}-token answers, measured in {self.seconds:.0f} s)")

    def weights_info(self) -> str | None:
        """The measured speed of each weight format, fastest first (the sidebar's note)."""
        if self.loaded:
            return None
        return "measured here (fastest first): " + ", ".join(
            f"{w} {self.measured[w].best_tok_s():.0f} tok/s" for w in self.order)


def head_digest(head: str | None) -> str | None:
    """A head by the bytes of its files when it is a directory here, else by its name."""
    source = head_source(head) if head else None
    if not isinstance(source, Path):
        return head
    digest = hashlib.sha256()
    for f in sorted(source.glob("*.safetensors")) + [source / "config.json"]:
        digest.update(f.read_bytes())
    return digest.hexdigest()


def cache_path(engines: list, head: str | None) -> Path:  # engines: list[EagleEngine]
    """Keyed by what decides the speeds, not by which weight formats were loaded."""
    config = engines[0].config
    key = json.dumps([VERSION, torch.__version__, cpu_model(),
                      cpu_flags(), source_digest(),
                      config.target, config.device, head_digest(head), torch.get_num_threads(),
                      {w: [t.spec() for t in c] for w, c in CANDIDATES.items()},
                      CONVERSATIONS, FIRST_ANSWER, NEW_TOKENS, ROUNDS, NOISE_Z, CONTEXT_DRAFTS,
                      CHAIN_SURE])
    return cache_root() / "autotune" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached(engines: list, head: str | None) -> Tuned | None:
    """The cached measurement for this target and head on this machine, if one covers the
    weights of every engine."""
    path = cache_path(engines, head)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    measured = {k: Measured(**v)
                for k, v in raw["measured"].items()}
    if any(e.config.weights_label not in measured for e in engines):
        return None
    return Tuned(raw["head"], measured, raw["order"], raw["seconds"], raw["cpu"])


class Loaded(Exception):
    """The process did not get its cores while measuring: the figures would rank the load, not
    the trees."""

    def __init__(self, share: float, thinned: bool = False) -> None:
        super().__init__("the engine stepped on fewer threads: other processes took the cores"
                         if thinned else
                         f"this process got {100 * share:.0f}% of its cores while measuring")
        self.share = share


@dataclass
class Meter:
    """Runs each measured `generate` as one unit of work through `call` (default: here and now;
    the app passes its engine thread, which runs a unit only while no visitor is answered) and
    watches the process's share of its cores over the units (`cpu_share.CpuClock`): once
    `MIN_CORE_S` are measured, a share below `STARVED_BELOW`, or an engine that dropped threads
    because the machine is busy, raises `Loaded`."""

    call: Callable[[Callable[[], Any]], Any] = field(default=lambda unit: unit())
    cpu_s: float = 0.0
    core_s: float = 0.0

    @property
    def share(self) -> float:
        return self.cpu_s / self.core_s if self.core_s > 0 else 1.0

    def generate(self, engine, *args: Any, **kw: Any) -> Any:  # noqa: ANN001 - EagleEngine
        def unit() -> tuple[Any, Any, bool]:
            with CpuClock() as clock:
                out = engine.generate(*args, **kw)
            governor = engine.scheduler.governor
            return out, clock.reading, governor is not None and governor.thinned
        out, reading, thinned = self.call(unit)
        self.cpu_s += reading.cpu_s
        self.core_s += reading.wall_s * reading.threads
        if thinned or (self.core_s >= MIN_CORE_S and self.share < STARVED_BELOW):
            raise Loaded(self.share, thinned)
        return out


def conversation_prompts(engine, meter: Meter) -> list[list[int]]:  # noqa: ANN001 - EagleEngine
    """Both turns of each of `CONVERSATIONS`, as token ids: the first turn, then the second on
    top of the engine's plain greedy first answer (`FIRST_ANSWER` tokens at most)."""
    prompts = []
    for first, second in CONVERSATIONS:
        messages = [{"role": "user", "content": first}]
        prompts.append(engine.encode(messages))
        answer = meter.generate(engine, prompts[-1],
                                SamplingParams(max_new_tokens=FIRST_ANSWER)).text
        prompts.append(engine.encode([*messages, {"role": "assistant", "content": answer},
                                      {"role": "user", "content": second}]))
    return prompts


def speeds(engine, head: str | None, trees: list[TreeParams],  # noqa: ANN001 - EagleEngine
           prompts: list[list[int]], rounds: int, meter: Meter
           ) -> tuple[list[float], dict[str, list[float]], list[str]]:
    """Decoding tokens/s of plain decoding and of each tree, one sample per prompt and round
    (the systems back to back, their order rotated by one from prompt to prompt, so that each
    takes each place in turn and the samples of one prompt and round are paired); the trees
    whose greedy output differs from plain decoding."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    systems: list[TreeParams | None] = [None, *trees]
    rates: list[list[float]] = [[] for _ in systems]
    outputs: list[dict[int, list[int]]] = [{} for _ in systems]  # per system, prompt ->
    meter.generate(engine, prompts[0], params, trees[0] if trees else None, head)  # warm-up
    for r in range(rounds):
        for p, ids in enumerate(prompts):
            shift = (r * len(prompts) + p) % len(systems)
            for i in [*range(shift, len(systems)), *range(shift)]:
                out = meter.generate(engine, ids, params, systems[i],
                                     head if systems[i] else None)
                # the tokens after the first (which the prefill gives) over the time after it
                rates[i].append((len(out.token_ids) - 1)
                                / (out.stats.elapsed_s - out.stats.prefill_s))
                outputs[i][p] = out.token_ids
    wrong = [tree_label(t) for i, t in enumerate(trees, 1) if outputs[i] != outputs[0]]
    return rates[0], {tree_label(t): rates[i] for i, t in enumerate(trees, 1)}, wrong


def mean_rate(samples: list[float]) -> float:
    """Tokens/s over all samples (each decodes the same number of tokens: their harmonic
    mean)."""
    return len(samples) / sum(1 / r for r in samples)


def paired_gain(rates: list[float], base: list[float]) -> tuple[float, float]:
    """The mean log speed ratio of paired samples (`rates` against `base`) and its standard
    error (infinite from one pair)."""
    logs = [math.log(a / b) for a, b in zip(rates, base, strict=True)]
    noise = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return statistics.fmean(logs), noise


def choose(default: str, samples: dict[str, list[float]]) -> str:
    """The tree to use among the correct trees measured (label -> paired samples): `default`,
    unless another tree's mean log speed ratio to it exceeds `NOISE_Z` standard errors of those
    ratios, and then the one with the largest such gain. Without `default` among them (its
    output was wrong, or it is not a candidate), the fastest."""
    if default not in samples:
        return max(samples, key=lambda t: mean_rate(samples[t]))
    chosen, best = default, 0.0
    for label, rates in samples.items():
        gain, noise = paired_gain(rates, samples[default])
        if gain > NOISE_Z * noise and gain > best:
            chosen, best = label, gain
    return chosen


def measure(engine, head: str | None, trees: list[TreeParams],  # noqa: ANN001 - EagleEngine
            prompts: list[list[int]], rounds: int, meter: Meter | None = None) -> Measured:
    """One engine's `Measured`: plain decoding and `trees` on `prompts`, the tree chosen."""
    plain, samples, wrong = speeds(engine, head, trees, prompts, rounds, meter or Meter())
    correct = {t: v for t, v in samples.items() if t not in wrong}
    chosen = choose(tree_label(engine.config.default_tree), correct) if correct else None
    return Measured(engine.config.weights_label, mean_rate(plain),
                    {t: mean_rate(v) for t, v in correct.items()},
                    {tree_label(t): t.spec() for t in trees}, wrong, chosen)


def tune(engines: list, head: str | None, refresh: bool = False,
         call: Callable[[Callable[[], Any]], Any] | None = None) -> Tuned:
    """Measure (or read from the cache) the fastest weights and tree for `engines` with
    `head` (None: plain decoding only, nothing to choose but the weights). `call` runs each
    decoding (`Meter`). When the process does not get its cores, the measurement stops and
    its `Tuned` says so (`loaded`): nothing is cached, `apply` keeps the static defaults."""
    if not refresh and (hit := cached(engines, head)) is not None:
        return hit
    t0 = time.perf_counter()
    log.info("measuring which weights and tree decode fastest on this machine (first start "
             "only, cached afterwards)…")
    meter = Meter(call) if call is not None else Meter()
    measured: dict[str, Measured] = {}
    try:
        for engine in engines:  # stage 1: each weight format, plain and its static default tree
            label = engine.config.weights_label
            trees = [engine.config.default_tree] if head else []
            first_turn = [engine.encode(CONVERSATIONS[0][0])]
            measured[label] = measure(engine, head, trees, first_turn, 1, meter)
            log.info("  %s: plain %.1f tok/s, %s", label, measured[label].plain_tok_s,
                     measured[label].tree_tok_s)
        order = sorted(measured, key=lambda w: -measured[w].best_tok_s())
        if head:  # stage 2: the candidate trees of the fastest format
            engine = next(e for e in engines if e.config.weights_label == order[0])
            family = "q4" if engine.config.weights == "q4" else "dense"
            trees = list(CANDIDATES[family])
            m = measure(engine, head, trees, conversation_prompts(engine, meter), ROUNDS, meter)
            measured[order[0]] = m
            log.info("  %s trees: %s (plain %.1f tok/s); chosen: %s", order[0], m.tree_tok_s,
                     m.plain_tok_s, m.chosen)
    except Loaded as e:
        log.warning("stopped measuring after %.0f s: %s; the static defaults stay and nothing "
                    "is cached (a later quiet start measures again)",
                    time.perf_counter() - t0, e)
        return Tuned(head, measured, [e.config.weights_label for e in engines],
                     round(time.perf_counter() - t0, 1), cpu_model(), round(e.share, 3), True)
    tuned = Tuned(head, measured, order, round(time.perf_counter() - t0, 1), cpu_model(),
                  round(meter.share, 3))
    path = cache_path(engines, head)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(tuned), indent=1))
    log.info("measured in %.1f s; cached in %s", tuned.seconds, path)
    return tuned


def use_cached(engine, head: str | None) -> None:  # noqa: ANN001 - EagleEngine
    """Give `engine` the tree `tune` chose here for `head`, when a measurement is cached
    (`generate`, `bench` and `peers.py` measure nothing themselves)."""
    if head and (tuned := cached([engine], head)) is not None:
        apply([engine], tuned)


def apply(engines: list, tuned: Tuned) -> list:
    """Give each engine its chosen tree; return the engines fastest first. A measurement taken
    under load (`Tuned.loaded`) changes nothing but `engine.tuned`, which says why."""
    if tuned.loaded:
        for engine in engines:
            engine.tuned = tuned
        return list(engines)
    for engine in engines:
        m = tuned.measured.get(engine.config.weights_label)
        if m is not None and (tree := m.best_tree()) is not None:
            engine.default_tree = tree
        engine.tuned = tuned
    rank = {w: i for i, w in enumerate(tuned.order)}
    return sorted(engines, key=lambda e: rank.get(e.config.weights_label, len(rank)))
