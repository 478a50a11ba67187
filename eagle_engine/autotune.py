"""What `auto` means on this machine: a short measurement, taken once and cached, of which
target weights and which draft tree decode fastest here.

`tune(engines, head)` decodes a few built-in prompts greedily (EOS ignored, the same number of
tokens each), rounds alternating, in two stages:
1. every loaded engine (one per target weight format) alone and with its static default tree
   (`EngineConfig.default_tree`): the weight format whose better figure is the higher is the
   fastest;
2. on that engine, each candidate tree of its format (`CANDIDATES`); a tree whose output
   differs from plain decoding is not correct and never chosen.
Speed follows the CPU class (an AVX2 EPYC and an AVX-512 Xeon price a tree row differently),
so the result is cached as JSON under the user cache, keyed by the torch version, the CPU model
and flags, the kernel source, the target, the head (its files' bytes, so retrained weights under
the same name are measured anew) and the candidates; later starts read it.
`apply` gives each engine its measured tree (`EagleEngine.default_tree`) and orders the
engines fastest first. The app tunes at its first start; `python -m eagle_engine tune` does it
from the command line, and `generate` and `bench` read the cached result. Not here: the static
defaults used when nothing was measured (`config.py`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .config import (CONTEXT_DRAFTS, Q4_TREE_AVX2, Q4_TREE_VNNI, SamplingParams, TreeParams,
                     cache_root, cpu_flags, cpu_model)
from .engine import head_source
from .kernels.cpu_lowbit import source_digest

log = logging.getLogger(__name__)

VERSION = 2  # 2: trees carry their min_score
PROMPTS = ("Write a short Python function that reverses a string, and explain it.",
           "Give me three tips for sleeping better.",
           "Explain what a hash table is to a new programmer.")
NEW_TOKENS = 48
ROUNDS = 2


def astuple(tree: TreeParams) -> tuple[int, int, int, float]:
    """(topk, steps, tokens, min_score): a tree as `CANDIDATES` and the cache hold it."""
    return tree.topk, tree.num_steps, tree.num_draft_tokens, tree.min_score


CANDIDATES = {  # per weights label, (topk, steps, tokens, min_score); the static defaults first
    "q4": (astuple(Q4_TREE_VNNI), astuple(Q4_TREE_AVX2), (1, 1, 2, 0.0), (1, 2, 3, 0.05),
           (2, 2, 4, 0.1), (3, 2, 6, 0.1)),
    "dense": (astuple(TreeParams()), (4, 3, 6, 0.0), (2, 3, 4, 0.0)),
}


def tree_label(tree: TreeParams) -> str:
    """'k2 s2 n3', with ' min0.1' for a min_score and ' +ctx' when the tree takes drafts from
    the context."""
    ctx = " +ctx" if tree.context_drafts else ""
    cut = f" min{tree.min_score:g}" if tree.min_score else ""
    return f"k{tree.topk} s{tree.num_steps} n{tree.num_draft_tokens}{cut}{ctx}"


@dataclass
class Measured:
    """One engine's figures: tokens/s of plain decoding and of each tree tried (label ->)."""

    weights: str
    plain_tok_s: float
    tree_tok_s: dict[str, float] = field(default_factory=dict)
    trees: dict[str, tuple[int, int, int, float]] = field(default_factory=dict)
    incorrect: list[str] = field(default_factory=list)

    def best_tree(self) -> TreeParams | None:
        """The fastest correct tree measured, or None when none was."""
        if not self.tree_tok_s:
            return None
        k, s, n, cut = self.trees[max(self.tree_tok_s, key=self.tree_tok_s.__getitem__)]
        return TreeParams(k, s, n, min_score=cut)

    def best_tok_s(self) -> float:
        return max([self.plain_tok_s, *self.tree_tok_s.values()])


@dataclass
class Tuned:
    """The measurement: per weights label, fastest first (`order`), and what it cost."""

    head: str | None
    measured: dict[str, Measured]
    order: list[str]
    seconds: float
    cpu: str

    def summary(self, weights: str) -> str:
        """One line for the status bar: why this weight format and tree."""
        m = self.measured[weights]
        what = "plain "
        if m.tree_tok_s:
            label = max(m.tree_tok_s, key=m.tree_tok_s.__getitem__)  # best_tree's, as measured
            what = f"tree {label} {m.tree_tok_s[label]:.0f} tok/s vs plain "
        others = ", ".join(f"{w} {self.measured[w].best_tok_s():.0f}" for w in self.order
                           if w != weights)
        return (f"{what}{m.plain_tok_s:.0f} tok/s"
                + (f"; other weights: {others} tok/s" if others else "")
                + f" (measured here at first start, {self.seconds:.0f} s)")

    def weights_info(self) -> str:
        """The measured speed of each weight format, fastest first (the sidebar's note)."""
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
                      CANDIDATES,
                      PROMPTS, NEW_TOKENS, CONTEXT_DRAFTS])
    return cache_root() / "autotune" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached(engines: list, head: str | None) -> Tuned | None:
    """The cached measurement for this target and head on this machine, if one covers the
    weights of every engine."""
    path = cache_path(engines, head)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    measured = {k: Measured(**{**v, "trees": {t: tuple(s) for t, s in v["trees"].items()}})
                for k, v in raw["measured"].items()}
    if any(e.config.weights_label not in measured for e in engines):
        return None
    return Tuned(raw["head"], measured, raw["order"], raw["seconds"], raw["cpu"])


def _speeds(engine, head: str | None, trees: list[TreeParams],  # noqa: ANN001 - EagleEngine
            texts: tuple[str, ...], rounds: int) -> tuple[float, dict[str, float], list[str]]:
    """Plain and per-tree tokens/s over `texts` x `rounds`, the systems alternating; the
    trees whose greedy output differs from plain decoding."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [engine.encode(p) for p in texts]
    systems: list[TreeParams | None] = [None, *trees]
    tokens = {i: 0 for i in range(len(systems))}
    seconds = {i: 0.0 for i in range(len(systems))}
    plain_out: dict[int, list[int]] = {}
    wrong: set[int] = set()
    engine.generate(prompts[0], params, trees[0] if trees else None, head)  # warm-up
    for r in range(rounds):
        order = list(range(len(systems)))[::1 if r % 2 == 0 else -1]
        for p, ids in enumerate(prompts):
            for i in order:
                t0 = time.perf_counter()
                out = engine.generate(ids, params, systems[i], head if systems[i] else None)
                seconds[i] += time.perf_counter() - t0
                tokens[i] += len(out.token_ids)
                if systems[i] is None:
                    plain_out[p] = out.token_ids
                elif p in plain_out and out.token_ids != plain_out[p]:
                    wrong.add(i)
    rate = {i: tokens[i] / seconds[i] for i in tokens}
    return (rate[0], {tree_label(t): rate[i + 1] for i, t in enumerate(trees)},
            [tree_label(trees[i - 1]) for i in sorted(wrong)])


def tune(engines: list, head: str | None, refresh: bool = False) -> Tuned:
    """Measure (or read from the cache) the fastest weights and tree for `engines` with
    `head` (None: plain decoding only, nothing to choose but the weights)."""
    if not refresh and (hit := cached(engines, head)) is not None:
        return hit
    t0 = time.perf_counter()
    log.info("measuring which weights and tree decode fastest on this machine (first start "
             "only, cached afterwards)…")
    measured: dict[str, Measured] = {}
    for engine in engines:  # stage 1: each weight format, plain and its static default tree
        label = engine.config.weights_label
        default = engine.config.default_tree if head else None
        plain, trees, wrong = _speeds(engine, head, [default] if default else [], PROMPTS[:1], 1)
        measured[label] = Measured(label, plain, trees if not wrong else {},
                                   {tree_label(default): astuple(default)} if default else {},
                                   wrong)
        log.info("  %s: plain %.1f tok/s, %s", label, plain, trees)
    order = sorted(measured, key=lambda w: -measured[w].best_tok_s())
    if head:  # stage 2: the candidate trees of the fastest format
        engine = next(e for e in engines if e.config.weights_label == order[0])
        family = "q4" if engine.config.weights == "q4" else "dense"
        trees = [TreeParams(k, s, n, min_score=cut) for k, s, n, cut in CANDIDATES[family]]
        plain, speeds, wrong = _speeds(engine, head, trees, PROMPTS, ROUNDS)
        log.info("  %s trees: %s (plain %.1f tok/s)", order[0], speeds, plain)
        measured[order[0]] = Measured(order[0], plain,
                                      {k: v for k, v in speeds.items() if k not in wrong},
                                      {tree_label(t): astuple(t) for t in trees}, wrong)
    tuned = Tuned(head, measured, order, round(time.perf_counter() - t0, 1), cpu_model())
    path = cache_path(engines, head)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(tuned), indent=1))
    log.info("measured in %.1f s; cached in %s", tuned.seconds, path)
    return tuned


def use_cached(engine, head: str | None) -> None:  # noqa: ANN001 - EagleEngine
    """Give `engine` the tree measured fastest here for `head`, when a measurement is cached
    (`generate`, `bench` and `peers.py` measure nothing themselves)."""
    if head and (tuned := cached([engine], head)) is not None:
        apply([engine], tuned)


def apply(engines: list, tuned: Tuned) -> list:
    """Give each engine its fastest measured tree; return the engines fastest first."""
    for engine in engines:
        m = tuned.measured.get(engine.config.weights_label)
        if m is not None and (tree := m.best_tree()) is not None:
            engine.default_tree = tree
        engine.tuned = tuned
    rank = {w: i for i, w in enumerate(tuned.order)}
    return sorted(engines, key=lambda e: rank.get(e.config.weights_label, len(rank)))
