"""Issue 4: speculative sampling is lossless.

A synthetic target over a 5-token vocabulary (logits a fixed pseudo-random function of the
prefix) and a fixed draft tree per prefix (depth 3, up to 3 siblings). Speculative rounds
(`tests.helpers.accept_sampled` on the tree's logits, then a new tree after the emitted tokens)
produce the first 3 tokens; their empirical joint distribution over 125 cells must match the
target's exact autoregressive distribution (chi-square), plain and with top-k / top-p, with the
torch sampler and acceptance and with the C++ ones a CPU runs once the q4 weights have built them
(`kernels/cpu_step.cpp`: the distribution, the draw and the whole acceptance). The same holds
with drafts from the context: the head's tree merged with the chain a suffix index over the
context proposes (`tree.merge_context`), under a budget that drops nodes of both sources. A
context node is a deterministic proposal like the head's top-k nodes (q = point mass), so the
same acceptance rule applies to it unchanged. Two deliberately broken acceptance rules must FAIL
the same statistic, and a synthetic 5% bias must be detected at the sample size used. Also the
sampler primitives (`target_probs`, `sample_from`).
"""
from __future__ import annotations

import functools
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import product

import pytest
import torch
from scipy.stats import chisquare

from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.context_draft import ContextIndex
from eagle_engine.io_struct import DraftTree, EagleVerifyInput, NodeSource
from eagle_engine.kernels import TORCH, cpp_ops, cpu_lowbit
from eagle_engine.kernels.reference import build_tree_from_parents
from eagle_engine.sampling import next_token, sample_from, target_probs
from eagle_engine.tree import build_tree, merge_context
from tests.helpers import accept_sampled

pytestmark = pytest.mark.usefixtures("torch_single_thread")

V, ROOT, LENGTH, SAMPLES = 5, 3, 3, 12000
# root: 3 children; node 1: 2 children; node 2: 1 child; node 4: 1 child (depth 3)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
CONFIGS = {"T1": SamplingParams(temperature=1.0),
           "T0.7_topk3": SamplingParams(temperature=0.7, top_k=3),
           "T1.3_topp0.8": SamplingParams(temperature=1.3, top_p=0.8)}
Rule = Callable[[EagleVerifyInput, torch.Tensor, SamplingParams, torch.Generator],
                tuple[torch.Tensor, int]]


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(bytes(prefix)))
    return 1.5 * torch.randn(V, generator=g)


class SyntheticTarget:
    """Trees and their verify logits per context (cached: contexts repeat across samples)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], tuple[EagleVerifyInput, torch.Tensor]] = {}
        parents = torch.tensor(TREE_PARENTS)
        self.depth, self.ancestors, self.retrieve = build_tree_from_parents(parents, 3)
        self.parents = parents

    def tree(self, ctx: tuple[int, ...]) -> tuple[EagleVerifyInput, torch.Tensor]:
        if ctx not in self.cache:
            g = torch.Generator().manual_seed(zlib.crc32(bytes(ctx)) + 1)
            tokens = [ctx[-1]]
            for node, parent in enumerate(TREE_PARENTS[1:], start=1):
                siblings = [i for i in range(1, node) if TREE_PARENTS[i] == parent]
                if not siblings:  # a draft guess per parent: a random order of the vocabulary
                    order = torch.randperm(V, generator=g).tolist()
                tokens.append(order[len(siblings)])
            rows = []
            for node in range(len(tokens)):
                path = [int(i) for i in self.retrieve[node] if i > 0]
                rows.append(target_logits(ctx + tuple(tokens[i] for i in path)))
            vin = EagleVerifyInput(torch.tensor(tokens), self.parents, self.depth,
                                   self.ancestors, self.retrieve, len(ctx),
                                   torch.ones(len(tokens)), torch.zeros_like(self.parents))
            self.cache[ctx] = (vin, torch.stack(rows))
        return self.cache[ctx]

    def sample(self, rule: Rule, params: SamplingParams, g: torch.Generator) -> tuple[int, ...]:
        ctx, out = (ROOT,), []
        while len(out) < LENGTH:
            vin, logits = self.tree(ctx)
            path, bonus = rule(vin, logits, params, g)
            emitted = vin.tokens[path[1:]].tolist() + [int(bonus)]
            out += emitted
            ctx += tuple(emitted)
        return tuple(out[:LENGTH])


CONTEXT_TREE = TreeParams(3, 3, 6, context_drafts=True)  # 5 of the head's 7 nodes + a chain


class ContextSyntheticTarget(SyntheticTarget):
    """The synthetic target's head trees as candidates (path probability 0.25 / (rank + 1) per
    level: low enough that chains from the context often take part of the budget), merged with
    the chain a `ContextIndex` over the context proposes, the best
    `CONTEXT_TREE.num_draft_tokens - 1` of both selected; verify logits per selected node."""

    def __init__(self, tree: TreeParams = CONTEXT_TREE) -> None:
        super().__init__()
        self.head = SyntheticTarget()
        self.params = tree

    def tree(self, ctx: tuple[int, ...]) -> tuple[EagleVerifyInput, torch.Tensor]:
        if ctx not in self.cache:
            head, _ = self.head.tree(ctx)
            parents = [p - 1 for p in TREE_PARENTS[1:]]  # node i -> candidate i - 1
            scores: list[float] = []
            for c, p in enumerate(parents):
                rank = sum(1 for j in range(c) if parents[j] == p)
                scores.append((scores[p] if p >= 0 else 1.0) * 0.25 / (rank + 1))
            drafted = DraftTree(torch.tensor(scores), head.tokens[1:], torch.tensor(parents))
            chain = ContextIndex(list(ctx)).propose(self.params.num_draft_tokens - 1)
            if chain:
                drafted = merge_context(drafted, chain, self.params)
            vin = build_tree(drafted, ctx[-1], len(ctx), self.params)
            tokens = vin.tokens.tolist()
            rows = [target_logits(ctx + tuple(tokens[i] for i in path.tolist() if i > 0))
                    for path in vin.retrieve_indices]
            self.cache[ctx] = (vin, torch.stack(rows))
        return self.cache[ctx]


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    dist = {}
    for seq in product(range(V), repeat=LENGTH):
        p, ctx = 1.0, (ROOT,)
        for tok in seq:
            p *= float(target_probs(target_logits(ctx), params)[tok])
            ctx += (tok,)
        dist[seq] = p
    return dist


def chi_square(counts: Counter, dist: dict[tuple[int, ...], float]) -> tuple[float, float, float]:
    """-> (statistic, p-value, total variation). Cells expected < 5 are pooled; cells with
    probability 0 must never occur."""
    n = sum(counts.values())
    impossible = [c for c in counts if dist.get(c, 0.0) == 0.0]
    assert not impossible, f"sampled zero-probability sequences {impossible[:3]}"
    big = [c for c in dist if dist[c] * n >= 5]
    small = [c for c in dist if 0 < dist[c] * n < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [dist[c] * n for c in big] + [sum(dist[c] for c in small) * n]
    if expected[-1] < 5:  # pool the remainder into the last regular cell
        rest_observed, rest_expected = observed.pop(), expected.pop()
        observed[-1] += rest_observed
        expected[-1] += rest_expected
    total = sum(expected)
    expected = [e * n / total for e in expected]
    stat, p = chisquare(observed, expected)
    tv = 0.5 * sum(abs(counts[c] / n - dist[c]) for c in dist)
    return float(stat), float(p), tv


def tree_walk(vin: EagleVerifyInput, logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator, lenient: float = 1.0, one_coin: bool = False
              ) -> tuple[torch.Tensor, int]:
    """The acceptance walk with knobs to break it. Defaults: the correct rule (one fresh coin
    per level, child k accepted iff cdf(k-1) <= u < cdf(k), residual without the children).
    BROKEN `lenient` < 1: also accept any child whose probability exceeds it.
    BROKEN `one_coin`: reuse the first level's coin at every level."""
    probs = target_probs(logits, params)
    parents, tokens = vin.parents.tolist(), vin.tokens.tolist()
    node, path, u = 0, [0], None
    while True:
        p = probs[node]
        children = [c for c in range(len(parents)) if parents[c] == node]
        if not children:
            return torch.tensor(path), int(sample_from(p, generator))
        if u is None or not one_coin:
            u = float(torch.rand((), generator=generator))
        cumulative, accepted = 0.0, None
        for c in children:
            cumulative += float(p[tokens[c]])
            if u < cumulative or float(p[tokens[c]]) > lenient:
                accepted = c
                break
        if accepted is None:
            residual = p.clone()
            residual[[tokens[c] for c in children]] = 0
            return torch.tensor(path), int(sample_from(residual / residual.sum(), generator))
        node = accepted
        path.append(node)


@pytest.fixture(scope="module")
def synthetic() -> SyntheticTarget:
    return SyntheticTarget()


def run(synthetic: SyntheticTarget, rule: Rule, params: SamplingParams, seed: int = 0
        ) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(seed)
    counts = Counter(synthetic.sample(rule, params, g) for _ in range(SAMPLES))
    return chi_square(counts, exact_distribution(params))


def test_trees_are_valid_and_draft_something(synthetic: SyntheticTarget) -> None:
    vin, logits = synthetic.tree((ROOT, 1, 2))
    assert vin.tokens[0] == 2 and logits.shape == (8, V)
    for parent in set(TREE_PARENTS[1:]):
        sib = [int(vin.tokens[i]) for i, p in enumerate(TREE_PARENTS) if p == parent]
        assert len(set(sib)) == len(sib)
    g = torch.Generator().manual_seed(0)
    lengths = Counter(len(accept_sampled(vin, logits, CONFIGS["T1"], g)[0]) for _ in range(500))
    assert lengths[1] and lengths[2] and lengths[3] + lengths[4] > 0  # every depth happens


@pytest.fixture(params=["torch", "kernels"])
def sampler(request: pytest.FixtureRequest) -> Rule:
    """What the engine samples and accepts with: the torch definitions, or the C++ kernels (the
    step backend of a q4 engine)."""
    ops = cpp_ops(cpu_lowbit.load()) if request.param == "kernels" else TORCH
    return functools.partial(accept_sampled, ops=ops)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_rule_is_lossless(synthetic: SyntheticTarget, sampler: Rule, name: str) -> None:
    stat, p, tv = run(synthetic, sampler, CONFIGS[name])
    assert p > 1e-3, f"chi2={stat:.1f} p={p:.2e} tv={tv:.4f}"
    assert tv < 0.05


@pytest.fixture(scope="module")
def with_context() -> ContextSyntheticTarget:
    return ContextSyntheticTarget()


def test_context_trees_mix_both_sources(with_context: ContextSyntheticTarget) -> None:
    """The merged trees hold context nodes (some deeper than the head's), shared ones, and
    both kinds get accepted."""
    g = torch.Generator().manual_seed(0)
    accepted: Counter = Counter()
    for _ in range(400):
        ctx = (ROOT,) + tuple(torch.randint(0, V, (3,), generator=g).tolist())
        vin, logits = with_context.tree(ctx)
        assert vin.tokens.numel() == CONTEXT_TREE.num_draft_tokens
        path, _ = accept_sampled(vin, logits, CONFIGS["T1"], g)
        accepted.update(NodeSource(int(vin.sources[i])) for i in path[1:])
    assert min(accepted[s] for s in NodeSource) >= 10, accepted


@pytest.mark.parametrize("name", ["T1", "T1.3_topp0.8"])
def test_engine_rule_is_lossless_with_context_drafts(with_context: ContextSyntheticTarget,
                                                     sampler: Rule, name: str) -> None:
    stat, p, tv = run(with_context, sampler, CONFIGS[name], seed=2)
    assert p > 1e-3, f"chi2={stat:.1f} p={p:.2e} tv={tv:.4f}"
    assert tv < 0.05


def test_engine_rule_is_lossless_with_a_min_score() -> None:
    """A `min_score` drops the candidates below it (head level 2 at 0.0625, the third sibling
    at 0.083, weak chain nodes), so trees vary in size; sampling stays exact."""
    cut = ContextSyntheticTarget(replace(CONTEXT_TREE, min_score=0.1))
    stat, p, tv = run(cut, accept_sampled, CONFIGS["T1"], seed=3)
    assert p > 1e-3, f"chi2={stat:.1f} p={p:.2e} tv={tv:.4f}"
    assert tv < 0.05
    sizes = Counter(vin.tokens.numel() for vin, _ in cut.cache.values())
    assert len(sizes) >= 2 and min(sizes) < CONTEXT_TREE.num_draft_tokens, sizes
    assert all(bool((vin.scores[1:] >= 0.1).all()) for vin, _ in cut.cache.values())


def test_reference_walk_is_lossless(synthetic: SyntheticTarget) -> None:
    stat, p, tv = run(synthetic, tree_walk, CONFIGS["T0.7_topk3"], seed=1)
    assert p > 1e-3, f"chi2={stat:.1f} p={p:.2e} tv={tv:.4f}"


@pytest.mark.parametrize("rule, name", [
    (partial(tree_walk, lenient=0.1), "accept any child with p > 0.1"),
    (partial(tree_walk, one_coin=True), "one coin for all levels"),
])
def test_broken_rules_fail(synthetic: SyntheticTarget, rule: Rule, name: str) -> None:
    stat, p, tv = run(synthetic, rule, CONFIGS["T1"])
    assert p < 1e-6, f"{name}: chi2={stat:.1f} p={p:.2e} tv={tv:.4f} was not detected"


def test_statistic_detects_a_5_percent_bias() -> None:
    """Power at SAMPLES: 5% of the mass moved onto one likely cell is rejected."""
    params = CONFIGS["T1"]
    dist = exact_distribution(params)
    cells = list(dist)
    probs = torch.tensor([dist[c] for c in cells])
    biased = 0.95 * probs
    biased[int(probs.argmax())] += 0.05
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(biased, SAMPLES, replacement=True, generator=g)
    _, p, tv = chi_square(Counter(cells[i] for i in draws.tolist()), dist)
    assert p < 1e-3 and tv > 0.03
    fair = torch.multinomial(probs, SAMPLES, replacement=True, generator=g)
    assert chi_square(Counter(cells[i] for i in fair.tolist()), dist)[1] > 1e-3


# ------------------------------------------------------------------- sampler primitives


def test_target_probs_temperature_top_k_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    plain = target_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(plain, torch.softmax(logits / 0.5, -1))
    topk = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    torch.testing.assert_close(topk[0, :2], expected)
    assert topk[0, 2:].eq(0).all()
    p = torch.softmax(logits, -1)[0]  # 0.563, 0.207, 0.126, 0.028, 0.076
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    kept = nucleus[0] > 0
    assert kept.tolist() == [True, True, False, False, False]  # 0.563 + 0.207 >= 0.75
    wider = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.78))
    assert (wider[0] > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(nucleus[0, kept], p[kept] / p[kept].sum())
    assert float(nucleus.sum()) == pytest.approx(1.0)


def test_sample_from_matches_probs_and_skips_zeros() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sample_from(probs.expand(20000, -1), g)
    counts = torch.bincount(draws, minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    _, p = chisquare(counts[[0, 2, 3]].tolist(), (probs[[0, 2, 3]] * 20000).tolist())
    assert p > 1e-3


def test_greedy_ties_take_the_first_index() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert next_token(logits, SamplingParams(), None).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax_on_vocabulary_rows(dtype: torch.dtype) -> None:
    """`greedy` (max) picks what `argmax` picks on full-vocabulary rows full of ties, where a
    vectorized reduction could return a later tied index."""
    from eagle_engine.sampling import greedy

    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 16):
        logits = torch.randint(0, 4, (rows, 49152), generator=g).to(dtype)
        assert torch.equal(greedy(logits), logits.argmax(-1))


def test_top_p_filter_equals_full_sort() -> None:
    """The partial-sort nucleus equals a full descending sort, peaked or flat (fallback path),
    one row or many, including rows that need different candidate counts."""
    from eagle_engine.kernels.reference import top_p_filter

    def full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        p, order = torch.sort(probs, dim=-1, descending=True)
        p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, p)

    torch.manual_seed(0)
    for scale in (0.3, 2.0, 8.0):
        for rows in (1, 5):
            probs = (torch.randn(rows, 3000) * scale).softmax(-1)
            for top_p in (0.5, 0.9, 0.99):
                torch.testing.assert_close(top_p_filter(probs, top_p, first=8),
                                           full_sort(probs, top_p), rtol=0, atol=0)
    mixed = torch.stack([(torch.randn(3000) * s).softmax(-1) for s in (0.1, 10.0)])
    torch.testing.assert_close(top_p_filter(mixed, 0.9, first=4), full_sort(mixed, 0.9),
                               rtol=0, atol=0)
