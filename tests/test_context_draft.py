"""Issue 24, part 3: draft candidates from the context in the same tree.

* The suffix index (`context_draft.ContextIndex`): built incrementally it equals one built at
  once; it finds the longest earlier suffix (its latest occurrence), none when the last token is
  new; a chain that reaches the end of the context repeats itself; scores are products of the
  calibrated hit rates, which count what the index proposed before each generated token.
* The merge (`tree.merge_context` then `build_tree`): the budget holds, siblings carry distinct
  tokens, a node both sources proposed is one node scored above either (source BOTH),
  the chain may reach deeper than num_steps, the top-scored nodes of both sources are selected,
  and nothing is read back from the device.
* A sure chain past the budget (`context_extra`): only the chain's nodes scoring at least
  CHAIN_SURE (and min_score), best first, at most context_extra of them.
* Losslessness with context drafts on: greedy speculative output equals greedy plain decoding
  (fp32 and q4, several tree shapes and heads), on a repetitive prompt where context drafts are
  accepted (asserted), caches exact after every commit; sampling with top_k=1 is greedy.
  The chi-square test of sampling with context drafts is in `test_sampling.py`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle_engine.config import CHAIN_SURE, ConfigError, SamplingParams, TreeParams
from eagle_engine.context_draft import MAX_MATCH, PRIOR_HIT_RATE, ContextIndex
from eagle_engine.engine import EagleEngine, GenerationResult
from eagle_engine.io_struct import ContextDraft, DraftTree, EagleVerifyInput, NodeSource
from eagle_engine.tools.sync_count import HostSyncs
from eagle_engine.tree import build_tree, merge_context
from tests.helpers import tiny_engine
from tests.test_loop import GREEDY, HEADS, NEW, PROMPTS, Oracle, step_lengths
from tests.test_tree import random_draft_tree, root_path

pytestmark = pytest.mark.usefixtures("torch_single_thread")

REPEAT = [1] + [10, 11, 12, 13, 14, 15, 16, 17] * 4  # a prompt with obvious repetition
ROOT, SEQ = 7, 30


# ------------------------------------------------------------------------------ suffix index

def test_incremental_index_equals_one_built_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (200,), generator=g).tolist()
    whole = ContextIndex(tokens)
    grown = ContextIndex(tokens[:1])
    for i in range(1, 200, 7):
        grown.extend(tokens[i:i + 7], calibrate=False)
    assert grown.tokens == whole.tokens and grown.after == whole.after
    assert grown.match() == whole.match()
    assert grown.propose(5) == whole.propose(5)


def test_longest_suffix_wins_over_a_later_shorter_one() -> None:
    # "1 2 3" then 40 (longest, older); "... 3" then 50 (length 1, latest); context ends "1 2 3"
    index = ContextIndex([1, 2, 3, 40, 9, 3, 50, 8, 1, 2, 3])
    assert index.match() == (3, 3)
    chain = index.propose(4)
    assert chain is not None and chain.match_len == 3 and chain.tokens == [40, 9, 3, 50]


def test_latest_occurrence_of_the_longest_suffix() -> None:
    index = ContextIndex([5, 6, 1, 5, 6, 2, 5, 6])
    assert index.match() == (2, 5) and index.propose(1).tokens == [2]


def test_no_match_proposes_nothing() -> None:
    index = ContextIndex([1, 2, 3, 4])
    assert index.match() == (0, -1) and index.propose(3) is None
    assert ContextIndex([7]).propose(2) is None  # nothing before the root
    index.extend([2])  # now "2" occurred before: followed by 3
    assert index.propose(2).tokens == [3, 4]


def test_chain_past_the_end_repeats_itself() -> None:
    index = ContextIndex([9, 1, 2, 1, 2])  # "1 2" occurred at 1..2, followed by "1 2"
    assert index.propose(6).tokens == [1, 2, 1, 2, 1, 2]
    assert ContextIndex([4, 4]).propose(3).tokens == [4, 4, 4]


def test_match_length_is_capped_and_scores_are_calibrated_products() -> None:
    index = ContextIndex(list(range(3, 30)) * 2)
    m, _ = index.match()
    assert m == MAX_MATCH
    chain = index.propose(4)
    rate = PRIOR_HIT_RATE[MAX_MATCH - 1]  # no counts yet: the prior
    assert chain.scores == pytest.approx([rate ** k for k in range(1, 5)])
    assert all(a >= b for a, b in zip(chain.scores, chain.scores[1:]))


def test_calibration_counts_what_the_index_would_have_proposed() -> None:
    index = ContextIndex([1, 2, 3, 1, 2])  # proposes 3 after "1 2" (match length 2)
    index.extend([3])  # right
    index.extend([9])  # after "1 2 3" (length 3) it proposes 1: wrong
    index.extend([8])  # "9" is new: no proposal, nothing counted
    assert index.hit_rates()[1] == (1, 1) and index.hit_rates()[2] == (0, 1)
    assert sum(t for _, t in index.hit_rates()) == 2
    assert index.hit_rate(2) > PRIOR_HIT_RATE[1] and index.hit_rate(3) < PRIOR_HIT_RATE[2]


def test_propose_needs_room() -> None:
    with pytest.raises(ConfigError, match="max_len=0"):
        ContextIndex([1, 1]).propose(0)


def test_tree_params_context_flag_and_depth() -> None:
    assert TreeParams(2, 2, 6, context_drafts=True).max_depth == 5
    assert TreeParams(2, 2, 6, context_drafts=False).max_depth == 2
    assert TreeParams(1, 6, 4, context_drafts=True).max_depth == 6
    with pytest.raises(ConfigError, match="context_drafts must be true or false, got 'yes'"):
        TreeParams(context_drafts="yes")


def test_tree_params_context_extra() -> None:
    """A chain past the budget: more rows and depth with context drafts, none without."""
    on = TreeParams(3, 1, 4, context_drafts=True, context_extra=8)
    assert (on.chain_len, on.max_rows, on.max_depth) == (11, 12, 11)
    off = replace(on, context_drafts=False)
    assert (off.chain_len, off.max_rows, off.max_depth) == (0, 4, 1)
    for bad in (-1, 65, 1.5, True, "8"):
        with pytest.raises(ConfigError, match=f"context_extra must be an integer in \\[0, 64\\], "
                           f"got {bad!r}"):
            TreeParams(context_extra=bad)


# ------------------------------------------------------------------------------------ merge

def head_tree() -> DraftTree:
    """K=2, S=2: a (0.6) b (0.3) | aa (0.5) ab (0.05) ba (0.2) bb (0.05)."""
    return DraftTree(torch.tensor([0.6, 0.3, 0.5, 0.05, 0.2, 0.05]),
                     torch.tensor([10, 11, 12, 13, 14, 15]),
                     torch.tensor([-1, -1, 0, 0, 1, 1]))


def test_chain_along_head_nodes_merges_and_goes_deeper() -> None:
    tree = TreeParams(2, 2, 6, context_drafts=True)
    merged = merge_context(head_tree(), ContextDraft([10, 13, 20, 21], [0.9, 0.8, 0.7, 0.1], 3),
                           tree)
    # a and ab are shared: 1 - (1 - head) * (1 - chain), its own copies are out (-1); below
    # ab the chain's own rates times ab's score: 0.7 * 0.81 / 0.8, 0.1 * 0.81 / 0.8
    assert merged.scores.tolist() == pytest.approx([0.96, 0.3, 0.5, 0.81, 0.2, 0.05,
                                                    -1, -1, 0.70875, 0.10125])
    assert merged.parents.tolist() == [-1, -1, 0, 0, 1, 1, -1, 0, 3, 8]
    assert merged.sources.tolist() == [2, 0, 0, 2, 0, 0, 1, 1, 1, 1]
    vin = build_tree(merged, ROOT, SEQ, tree)
    # the 5 best: a .9, ab .8, c .7, aa .5, b .3 -> root, a, b, aa, ab, ab->20
    assert vin.tokens.tolist() == [ROOT, 10, 11, 12, 13, 20]
    assert vin.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert vin.depth.tolist() == [0, 1, 1, 2, 2, 3]  # deeper than num_steps
    assert vin.sources.tolist() == [0, 2, 0, 0, 2, 1]
    assert vin.retrieve_indices.shape == (6, 6) and vin.retrieve_indices[5].tolist() == [
        0, 1, 4, 5, -1, -1]


def test_chain_off_the_head_tree_hangs_from_the_root() -> None:
    tree = TreeParams(2, 2, 4, context_drafts=True)
    merged = merge_context(head_tree(), ContextDraft([30, 31], [0.55, 0.52], 2), tree)
    vin = build_tree(merged, ROOT, SEQ, tree)
    assert vin.tokens.tolist() == [ROOT, 10, 30, 31]  # a .6 beats 30 .55 > 31 .52 > aa .5
    assert vin.parents.tolist() == [-1, 0, 0, 2]
    assert [NodeSource(s) for s in vin.sources.tolist()] == [
        NodeSource.HEAD, NodeSource.HEAD, NodeSource.CONTEXT, NodeSource.CONTEXT]
    low = build_tree(merge_context(head_tree(), ContextDraft([30], [0.01], 1), tree), ROOT,
                     SEQ, tree)
    assert low.tokens.tolist() == [ROOT, 10, 11, 12]  # a weak chain loses to the head


def test_sure_chain_goes_past_the_budget() -> None:
    """context_extra: past the budget's best candidates, up to that many more nodes of the chain
    that score at least CHAIN_SURE (and min_score), best first, so parents come first; a node
    of the head alone never goes past the budget."""
    chain = ContextDraft([30, 31, 32, 33, 34, 35], [0.95, 0.9, 0.8, 0.7, 0.6, 0.25], 8)

    def tokens(n: int, extra: int, cut: float = 0.0) -> list[int]:
        tree = TreeParams(2, 2, n, context_drafts=True, min_score=cut, context_extra=extra)
        vin = build_tree(merge_context(head_tree(), chain, tree), ROOT, SEQ, tree)
        assert vin.tokens.numel() <= tree.max_rows
        assert vin.depth.tolist() == list(range(vin.tokens.numel()))  # one chain
        return vin.tokens.tolist()[1:]

    assert CHAIN_SURE == 0.3
    assert tokens(3, 0) == [30, 31]
    assert tokens(3, 3) == [30, 31, 32, 33, 34]  # a (0.6, the head's) stays out; 35 is unsure
    assert tokens(3, 2) == [30, 31, 32, 33]
    assert tokens(3, 8, cut=0.75) == [30, 31, 32]  # past the budget the cut holds too
    # a chain along the head's a -> aa: both shared (BOTH), the rest hangs below aa
    tree = TreeParams(2, 2, 3, context_drafts=True, context_extra=4)
    merged = merge_context(head_tree(), ContextDraft([10, 12, 40, 41, 42], [0.9, 0.8, 0.7, 0.65,
                                                                           0.25], 8), tree)
    vin = build_tree(merged, ROOT, SEQ, tree)
    assert vin.tokens.tolist() == [ROOT, 10, 12, 40, 41]
    assert vin.parents.tolist() == [-1, 0, 1, 2, 3]
    assert vin.sources.tolist() == [0, 2, 2, 1, 1]


def test_a_node_both_propose_scores_above_either() -> None:
    tree = TreeParams(2, 2, 3, context_drafts=True)
    merged = merge_context(head_tree(), ContextDraft([10, 12], [0.2, 0.1], 2), tree)
    # a: 1 - 0.4 * 0.8, aa: 1 - 0.5 * 0.9; b keeps the head's
    assert merged.scores[:3].tolist() == pytest.approx([0.68, 0.3, 0.55])
    assert merged.sources[:3].tolist() == [2, 0, 2]


def test_the_chain_below_a_shared_node_starts_from_its_score() -> None:
    """A chain that agrees with the head's a -> aa goes on from aa's combined score: its next
    node (the chain's own 0.25, under CHAIN_SURE) scores 0.7 * 0.25 / 0.4 and goes past the
    budget; without a shared node the same chain hangs from the root at its own scores."""
    tree = TreeParams(2, 2, 3, context_drafts=True, context_extra=4)
    merged = merge_context(head_tree(), ContextDraft([10, 12, 40], [0.5, 0.4, 0.25], 3), tree)
    assert merged.scores.tolist() == pytest.approx([0.8, 0.3, 0.7, 0.05, 0.2, 0.05,
                                                    -1, -1, 0.4375])
    vin = build_tree(merged, ROOT, SEQ, tree)
    assert vin.tokens.tolist() == [ROOT, 10, 12, 40]
    assert vin.sources.tolist() == [0, 2, 2, 1]
    alone = merge_context(head_tree(), ContextDraft([30, 31, 40], [0.5, 0.4, 0.25], 3), tree)
    assert alone.scores[6:].tolist() == pytest.approx([0.5, 0.4, 0.25])
    # chain scores that underflowed to 0 past a shared node stay 0, not 0 * inf
    zero = merge_context(head_tree(), ContextDraft([10, 12, 40], [0.5, 0.0, 0.0], 3), tree)
    assert zero.scores.tolist() == pytest.approx([0.8, 0.3, 0.5, 0.05, 0.2, 0.05, -1, -1, 0.0])


@pytest.mark.parametrize("K, S, N", [(1, 1, 2), (2, 3, 11), (3, 2, 9), (4, 4, 16), (1, 5, 6)])
def test_random_merges_keep_the_tree_invariants(K: int, S: int, N: int) -> None:
    """Chains built from the drafted paths themselves (so they share a prefix with the head's
    tree) or random, of random lengths and probabilities: N nodes, parents first, distinct
    siblings, the N-1 best candidates of both sources selected, within max_depth."""
    g = torch.Generator().manual_seed(K * 100 + S * 10 + N)
    tree = TreeParams(K, S, N, context_drafts=True)
    shared = 0
    for trial in range(12):
        drafted = random_draft_tree(K, S, g)
        L = int(torch.randint(1, N, (), generator=g))
        if trial % 2:  # along a drafted path, then off it
            leaf = int(torch.randint(0, drafted.tokens.numel(), (), generator=g))
            path = root_path(drafted.parents.tolist(), leaf)
            chain = [int(drafted.tokens[c]) for c in path][:L]
        else:
            chain = []
        chain += torch.randint(50, 60, (L - len(chain),), generator=g).tolist()
        p = torch.rand(L, generator=g).cumprod(0).tolist()
        merged = merge_context(drafted, ContextDraft(chain, p, 1), tree)
        vin = build_tree(merged, ROOT, SEQ, tree)
        parents, tokens = vin.parents.tolist(), vin.tokens.tolist()
        assert len(tokens) == N and parents[0] == -1
        for i in range(1, N):
            assert 0 <= parents[i] < i
            assert vin.depth[i] == vin.depth[parents[i]] + 1 <= tree.max_depth
            sib = [j for j in range(N) if parents[j] == parents[i]]
            assert len({tokens[j] for j in sib}) == len(sib)
        assert float(vin.scores[1:].min()) >= 0  # no dropped copy was selected
        assert_best_candidates(merged, vin)
        shared += int((vin.sources == NodeSource.BOTH).sum())
        for i in range(1, N):  # a context node's root path is a prefix of the chain
            if int(vin.sources[i]) != NodeSource.HEAD:
                assert [tokens[j] for j in root_path(parents, i)[1:]] == chain[:int(
                    vin.depth[i])]
    assert shared > 0


def assert_best_candidates(merged: DraftTree, vin: EagleVerifyInput) -> None:
    """The nodes are the N-1 best-scored candidates (closed under parents) in candidate order
    with their tokens, parents, scores and sources."""
    N = vin.tokens.numel()
    order = torch.sort(merged.scores, descending=True, stable=True).indices
    cand = [-1] + sorted(order[:N - 1].tolist())
    assert all(int(merged.parents[c]) in cand for c in cand[1:])
    for i in range(1, N):
        c = cand[i]
        assert int(merged.tokens[c]) == int(vin.tokens[i])
        assert int(merged.parents[c]) == cand[int(vin.parents[i])]
        assert float(vin.scores[i]) == float(merged.scores[c])
        assert int(vin.sources[i]) == int(merged.sources[c])


@pytest.mark.parametrize("extra", [0, 3])
def test_merge_and_build_read_nothing_back(extra: int) -> None:
    """Nothing, except that a chain past the budget sizes the tree by what it holds: one
    data-dependent shape (as a min_score cut is)."""
    tree = TreeParams(2, 2, 6, context_drafts=True, context_extra=extra)
    drafted, root = head_tree(), torch.tensor([ROOT])
    with torch.inference_mode(), HostSyncs() as syncs:
        build_tree(merge_context(drafted, ContextDraft([10, 13, 20, 21, 22], [0.9, 0.8, 0.7, 0.6,
                                                                              0.5], 3), tree),
                   root, SEQ, tree)
    assert dict(syncs.kinds) == ({"data-dependent shape": 1} if extra else {}), syncs.kinds


# --------------------------------------------------------------------- the loop, lossless

@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EagleEngine:
    return tiny_engine(tmp_path_factory.mktemp("ctx"), HEADS, weight_scale=1.0)


@pytest.fixture(scope="module")
def baseline(engine: EagleEngine) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): engine.generate(p, GREEDY).token_ids for p in (*PROMPTS, REPEAT)}


def context_tokens(result: GenerationResult) -> int:
    return sum(t.kind == "context" for ev in result.events for t in ev.tokens)


PARITY = [((1, 1, 2), "aux", 0), ((2, 3, 6), "noaux", 1), ((4, 2, 9), "deep_small_vocab", 2),
          ((1, 4, 5), "fcnorm_aux4", 0), ((3, 3, 12), "aux", 1), ((8, 3, 32), "noaux", 2)]


@pytest.mark.parametrize("shape, head, prompt", PARITY,
                         ids=[f"k{s[0]}-s{s[1]}-n{s[2]}-{h}" for s, h, _ in PARITY])
def test_greedy_parity_with_context_drafts(engine: EagleEngine, baseline: dict,
                                           shape: tuple[int, int, int], head: str,
                                           prompt: int) -> None:
    for ids in (PROMPTS[prompt], REPEAT):
        result = engine.generate(ids, GREEDY, TreeParams(*shape, context_drafts=True), head,
                                 keep_events=True)
        assert result.token_ids == baseline[tuple(ids)]
        assert result.finished == "length" and result.stats.num_tokens == NEW


def test_repetition_is_drafted_from_the_context_and_accepted(engine: EagleEngine,
                                                             baseline: dict) -> None:
    """On a repetitive prompt the context's chains are accepted (tokens of kind "context",
    nodes from the context on accepted paths, deeper than num_steps) and tau rises; with the
    flag off no node comes from the context."""
    shape = (2, 2, 6)
    on = engine.generate(REPEAT, GREEDY, TreeParams(*shape, context_drafts=True), "aux",
                         keep_events=True)
    off = engine.generate(REPEAT, GREEDY, TreeParams(*shape, context_drafts=False), "aux",
                          keep_events=True)
    assert on.token_ids == off.token_ids == baseline[tuple(REPEAT)]
    assert context_tokens(on) >= 5 and on.stats.tau > off.stats.tau + 0.3
    spans = [t for ev in on.events for t in ev.tokens]
    assert all(t.source == "context" for t in spans if t.kind == "context")
    assert {t.source for t in spans if t.kind == "accepted"} <= {"head", "both"}
    nodes = [n for ev in on.events for n in ev.tree]
    assert any(n.accepted and n.source == "context" and n.depth > shape[1] for n in nodes)
    assert context_tokens(off) == 0 and all(n.source == "head" for ev in off.events
                                            for n in ev.tree)
    assert len(on.stats.accepted_per_depth) > shape[1]  # grown past num_steps


def test_sure_chains_past_the_budget_are_accepted_losslessly(engine: EagleEngine) -> None:
    """With context_extra, a sure chain on the repetitive prompt is verified past the tree's
    num_draft_tokens and accepted there (an iteration emits more tokens than the budget holds),
    tau rises, and the answer stays plain decoding's. (Long enough for the hit rates to learn
    that the chain is right: their priors keep a chain's deeper nodes below CHAIN_SURE.)"""
    tree, params = TreeParams(2, 1, 3, context_drafts=True), replace(GREEDY, max_new_tokens=96)
    within = engine.generate(REPEAT, params, tree, "aux", keep_events=True)
    past = engine.generate(REPEAT, params, replace(tree, context_extra=8), "aux",
                           keep_events=True)
    assert past.token_ids == within.token_ids == engine.generate(REPEAT, params).token_ids
    assert max(step_lengths(within)) <= tree.num_draft_tokens
    assert max(step_lengths(past)) > tree.num_draft_tokens
    assert past.stats.tau > within.stats.tau + 0.5
    assert max(len(ev.tree) for ev in past.events) > tree.num_draft_tokens


@pytest.mark.parametrize("extra", [0, 6])
def test_caches_stay_exact_with_context_drafts(engine: EagleEngine,
                                               monkeypatch: pytest.MonkeyPatch,
                                               extra: int) -> None:
    """An oracle head (right at each level with probability 0.6) with context chains merged in,
    also past the budget: accepted paths mix both sources and reach past num_steps; after every
    commit both caches equal a fresh prefill. (Long enough for a chain to be sure.)"""
    params = replace(GREEDY, max_new_tokens=64)
    plain = engine.generate(REPEAT, params).token_ids
    oracle = Oracle(engine, REPEAT, accuracy=0.6, seed=2).install(monkeypatch)
    tree = TreeParams(2, 2, 7, context_drafts=True, context_extra=extra)
    result = engine.generate(REPEAT, params, tree, "aux", keep_events=True)
    assert result.token_ids == plain
    assert oracle.checks == len(step_lengths(result)) and max(step_lengths(result)) > 3
    assert context_tokens(result) > 0
    assert (max(len(ev.tree) for ev in result.events) > tree.num_draft_tokens) == (extra > 0)


def test_sampling_with_top_k_1_is_greedy_with_context_drafts(engine: EagleEngine,
                                                             baseline: dict) -> None:
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1, seed=5)
    for ids in (PROMPTS[1], REPEAT):
        result = engine.generate(ids, params, TreeParams(2, 3, 8, context_drafts=True), "aux",
                                 keep_events=True)
        assert result.token_ids == baseline[tuple(ids)]
    assert context_tokens(result) > 0


def test_q4_greedy_parity_with_context_drafts(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64}}, weights="q4",
                         weight_scale=1.0, hidden_size=64, intermediate_size=96)
    assert engine.config.weights == "q4" and engine.target.fused is not None
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    used = 0
    for ids in (PROMPTS[0], REPEAT):
        base = engine.generate(ids, params).token_ids
        for tree in (TreeParams(1, 1, 2, True), TreeParams(2, 2, 3, True),
                     TreeParams(4, 3, 8, True), TreeParams(1, 3, 4, True),
                     TreeParams(3, 1, 4, True, min_score=0.05, context_extra=8)):
            result = engine.generate(ids, params, tree, "head", keep_events=True)
            assert result.token_ids == base, (ids, tree)
            used += context_tokens(result)
            off = engine.generate(ids, params, replace(tree, context_drafts=False), "head")
            assert off.token_ids == base
    assert used > 0
