"""Issue 4: the speculative loop end to end on a tiny random target (fp32).

* Greedy parity: speculative output == baseline output token for token, for many tree shapes
  and heads (aux on/off, two layers with a reduced vocabulary, fc_norm with four aux states).
* An ORACLE draft (the real drafted tree with the target's own greedy continuation planted along
  one random root-to-leaf chain, at random sibling ranks, each level right with probability
  `accuracy`) makes acceptance high and varied; parity must still hold, a perfect oracle must
  reach the full accept length, and after EVERY commit the target and draft caches must equal a
  fresh prefill of the committed tokens (any accept pattern, greedy and sampled).
* Stops inside an accepted run: EOS, max_new_tokens and stop strings truncate exactly there;
  the context limit ends with finished == "context".
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine, GenerationResult
from eagle_engine.io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput
from eagle_engine.kv_cache import KVCache, causal_mask
from eagle_engine.models.draft_model import Eagle3Draft
from tests.helpers import ByteTokenizer, tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# prompts whose greedy continuations on this target are varied (>= 12 distinct of 24 tokens)
PROMPTS = ([1, 28, 82, 80, 60, 38, 28, 32, 69, 20, 60, 52], [1, 57, 63, 27, 66, 30, 40],
           [1, 66, 67, 77, 82, 47, 39])
HEADS = {"aux": {}, "noaux": {"use_aux": False, "seed": 1},
         "deep_small_vocab": {"num_layers": 2, "draft_vocab": 40, "seed": 2},
         "fcnorm_aux4": {"fc_norm": True, "num_aux": 4, "seed": 3}}
NEW = 24
GREEDY = SamplingParams(max_new_tokens=NEW)
# (topk, num_steps, num_draft_tokens), head, prompt
PARITY = [
    ((1, 1, 2), "aux", 0), ((1, 3, 4), "noaux", 1), ((1, 8, 9), "deep_small_vocab", 2),
    ((2, 1, 3), "fcnorm_aux4", 0), ((2, 2, 4), "aux", 1), ((2, 3, 6), "noaux", 2),
    ((2, 5, 12), "deep_small_vocab", 0), ((3, 2, 9), "fcnorm_aux4", 1), ((3, 4, 12), "aux", 2),
    ((3, 8, 24), "noaux", 0), ((4, 1, 5), "deep_small_vocab", 1), ((4, 4, 16), "fcnorm_aux4", 2),
    ((4, 6, 32), "aux", 0), ((5, 3, 20), "noaux", 1), ((5, 2, 30), "deep_small_vocab", 2),
    ((6, 2, 20), "fcnorm_aux4", 0), ((6, 5, 48), "aux", 1), ((7, 3, 64), "noaux", 2),
    ((8, 1, 9), "deep_small_vocab", 0), ((8, 3, 32), "fcnorm_aux4", 1), ((8, 8, 64), "aux", 2),
    ((8, 2, 64), "deep_small_vocab", 1),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EagleEngine:
    return tiny_engine(tmp_path_factory.mktemp("loop"), HEADS, weight_scale=1.0)


@pytest.fixture(scope="module")
def baseline(engine: EagleEngine) -> list[list[int]]:
    return [engine.generate(p, GREEDY).token_ids for p in PROMPTS]


def test_baseline_is_varied(baseline: list[list[int]]) -> None:
    for tokens in baseline:
        assert len(tokens) == NEW and len(set(tokens)) >= 12


@pytest.mark.parametrize("shape, head, prompt", PARITY,
                         ids=[f"k{s[0]}-s{s[1]}-n{s[2]}-{h}" for s, h, _ in PARITY])
def test_greedy_parity_random_drafts(engine: EagleEngine, baseline: list[list[int]],
                                     shape: tuple[int, int, int], head: str, prompt: int) -> None:
    result = engine.generate(PROMPTS[prompt], GREEDY, TreeParams(*shape), head)
    assert result.token_ids == baseline[prompt]
    assert result.finished == "length" and result.stats.num_tokens == NEW
    assert result.stats.step_tokens >= NEW - 1  # the prefill produced the first token


def test_event_trees_carry_draft_path_probabilities(engine: EagleEngine) -> None:
    """Each traced node's score is the draft's probability of its path: 1 at the root, in
    (0, 1], never above its parent's (which nodes are selected: `test_tree`)."""
    result = engine.generate(PROMPTS[0], GREEDY, TreeParams(3, 3, 8), "aux", keep_events=True)
    trees = [ev.tree for ev in result.events if ev.tree]
    assert trees
    for tree in trees:
        assert tree[0].score == 1.0
        for node in tree[1:]:
            assert 0.0 < node.score <= tree[node.parent].score + 1e-6
    assert len({round(n.score, 6) for t in trees for n in t[1:]}) > 10  # real, varied scores


def test_stats_time_is_the_engines_not_the_callers(engine: EagleEngine) -> None:
    """A consumer that holds every event (a UI drawing a frame) does not slow the reported
    speed: elapsed_s counts the engine's time only, in EAGLE and baseline mode."""
    hold_s = 0.02
    for head in ("aux", None):
        t0, last = time.perf_counter(), None
        for last in engine.stream(PROMPTS[0], GREEDY, TreeParams(2, 2, 4), head):
            time.sleep(hold_s)
        wall = time.perf_counter() - t0
        held = hold_s * (last.step + 1)
        assert wall >= held and last.stats["elapsed_s"] < wall - 0.9 * held, (head, wall, held)


def test_first_token_goes_out_before_the_head_reads_the_prompt(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's event reaches the caller before the context's suffix index is built and
    the draft extend over the prompt runs; a one-token answer still runs both after its event
    (the prefix cache keeps the head's rows for the next turn)."""
    import eagle_engine.scheduler as sched_mod

    tree = TreeParams(2, 2, 4)
    assert tree.context_drafts
    phases = engine.scheduler.phases
    events: list = []
    seen_at: list[int] = []  # events out when each extend began
    indexed_at: list[int] = []  # events out when the context's index was built

    def extend(*args, real: Callable):  # noqa: ANN002, ANN202
        seen_at.append(len(events))
        return real(*args)

    def index(tokens: list[int]) -> sched_mod.ContextIndex:
        indexed_at.append(len(events))
        return real_index(tokens)
    real_index = sched_mod.ContextIndex
    monkeypatch.setattr(sched_mod, "extend",
                        lambda *a, real=sched_mod.extend: extend(*a, real=real))
    monkeypatch.setattr(phases, "extend", lambda *a, real=phases.extend: extend(*a, real=real))
    monkeypatch.setattr(sched_mod, "ContextIndex", index)
    for n in (1, 6):
        events.clear()
        seen_at.clear()
        indexed_at.clear()
        for ev in engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=n, ignore_eos=True),
                                tree, "aux"):
            events.append(ev)
        assert seen_at[0] == 1 and indexed_at == [1], (seen_at, indexed_at)  # after event 1
        assert len(seen_at) == len(events) - (n > 1), (n, seen_at)  # one a step but the last


class Oracle:
    """Wraps the phases of one request (see the module docstring); `tokens` is the committed
    sequence followed by the current root, rebuilt from what the engine feeds `extend`."""

    def __init__(self, engine: EagleEngine, prompt: list[int], accuracy: float = 1.0,
                 seed: int = 0, check_caches: bool = True) -> None:
        self.engine, self.accuracy, self.check = engine, accuracy, check_caches
        self.prompt, self.seed = prompt, seed
        self.checks = 0
        self.restart()

    def restart(self) -> None:
        """Forget the request: the next run plants exactly what the first one did."""
        self.rng = random.Random(self.seed)
        self.tokens = list(self.prompt[:1])

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Oracle:
        """Wraps the engine's scheduler's draft and extend (one request a step) and the
        extend over the prompt (`scheduler.extend`); notes the request's target cache at
        prefill."""
        import eagle_engine.scheduler as sched_mod

        phases = self.engine.scheduler.phases
        draft, extend = self.wrap_draft(phases.draft), self.wrap_extend(sched_mod.extend)
        step_extend = phases.extend
        prefill = sched_mod.Scheduler._prefill

        def noted(scheduler: sched_mod.Scheduler, run):  # noqa: ANN001, ANN202
            self.cache = run.cache  # the request's target cache
            return prefill(scheduler, run)

        def draft_step(model: Eagle3Draft, runs: list, states: list) -> list[DraftTree]:
            (run,), (state,) = runs, states
            return [draft(model, state, run, run.tree)]

        def extend_step(model: Eagle3Draft, runs: list, exts: list) -> list[EagleDraftInput]:
            (run,), (ext,) = runs, exts
            return [extend(model, ext, run.draft_cache, run.tree.topk,
                           inner=lambda *a: step_extend(model, runs, exts)[0])]
        monkeypatch.setattr(sched_mod.Scheduler, "_prefill", noted)
        monkeypatch.setattr(sched_mod, "extend", extend)
        monkeypatch.setattr(phases, "draft", draft_step)
        monkeypatch.setattr(phases, "extend", extend_step)
        return self

    def continuation(self, n: int) -> list[int]:
        """The target's greedy continuation of `tokens` (root included), n tokens."""
        target, ctx = self.engine.target, self.tokens
        cache = target.new_cache(max_len=len(ctx) + n)
        out = target(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache, 0,
                     causal_mask(len(ctx), 0, "cpu"), last_only=True)
        result: list[int] = []
        for i in range(n):
            result.append(int(out.logits[0, -1].argmax()))
            pos = len(ctx) + i
            out = target(torch.tensor([[result[-1]]]), torch.tensor([[pos]]), cache, pos, None)
        return result

    def wrap_draft(self, inner: Callable) -> Callable:
        """The scheduler's batched draft of one request -> one planted draft."""
        def run(model: Eagle3Draft, inp: EagleDraftInput, request: object,
                tree: TreeParams) -> DraftTree:
            drafted = inner(model, [request], [inp])[0]
            assert len(self.tokens) == inp.seq_len + 1 and [self.tokens[-1]] == inp.root.tolist()
            return self.plant(drafted, self.continuation(tree.num_steps), tree)
        return run

    def plant(self, drafted: DraftTree, future: list[int], tree: TreeParams) -> DraftTree:
        K, S = tree.topk, tree.num_steps
        tokens, scores = drafted.tokens.clone(), drafted.scores.clone()
        parents = drafted.parents.tolist()
        node = self.rng.randrange(0 if S == 1 else K + (S - 2) * K * K, len(parents))
        chain = []
        while node >= 0:
            chain.append(node)
            node = parents[node]
        for depth, (node, want) in enumerate(zip(chain[::-1], future), start=1):
            scores[node] = 2.0 - 0.01 * depth  # the chain is selected into the tree first
            if self.rng.random() >= self.accuracy:
                continue
            siblings = [j for j, p in enumerate(parents) if p == parents[node]]
            holder = next((j for j in siblings if int(tokens[j]) == want), None)
            if holder is not None:  # keep siblings distinct: swap instead of duplicating
                tokens[holder] = tokens[node]
            tokens[node] = want
        return DraftTree(scores=scores, tokens=tokens, parents=drafted.parents)

    def wrap_extend(self, inner: Callable) -> Callable:
        """An extend (`accept.extend`'s signature; `inner` replaces it for one call) followed by
        the cache checks."""
        def run(model: Eagle3Draft, ext: EagleDraftExtendInput, cache: KVCache,
                topk: int, inner: Callable = inner) -> EagleDraftInput:
            state = inner(model, ext, cache, topk)
            self.tokens = (self.tokens[:1] if ext.seq_len == 0 else self.tokens)
            self.tokens = self.tokens + ext.tokens.tolist()
            if self.check:
                self.check_caches(model, cache, state)
            return state
        return run

    def check_caches(self, model: Eagle3Draft, draft_cache: KVCache,
                     state: EagleDraftInput) -> None:
        """Rows [0, seq_len) of both caches == a fresh prefill of the committed tokens."""
        n, target = state.seq_len, self.engine.target
        assert len(self.tokens) == n + 1 and [self.tokens[n]] == state.root.tolist()
        aux_ids = model.cfg.resolve_aux_layer_ids(target.cfg)
        fresh = target.new_cache(max_len=n)
        positions, mask = torch.arange(n)[None], causal_mask(n, 0, "cpu")
        out = target(torch.tensor([self.tokens[:n]]), positions, fresh, 0, mask, aux_ids)
        assert_rows_equal(self.cache, fresh, n)
        feats = out.aux_hidden if aux_ids else out.final_hidden
        fresh_draft = model.new_cache(n)
        logits, hidden = model(torch.tensor([self.tokens[1:]]), feats, positions, fresh_draft,
                               0, mask, from_target=True)
        assert_rows_equal(draft_cache, fresh_draft, n)
        torch.testing.assert_close(state.hidden, hidden[0, -1], atol=1e-4, rtol=1e-4)
        top = torch.softmax(logits[0, -1], -1).topk(state.topk_ids.numel())
        assert state.topk_ids.tolist() == model.hot_ids[top.indices].tolist()
        self.checks += 1


class Watcher(Oracle):
    """The oracle's cache checks after every commit, over the head's own drafts."""

    def plant(self, drafted: DraftTree, future: list[int], tree: TreeParams) -> DraftTree:
        return drafted


@pytest.mark.parametrize("where", ["median", "above every score"])
def test_min_score_trees_keep_parity_and_exact_caches(engine: EagleEngine,
                                                      baseline: list[list[int]],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      where: str) -> None:
    """A tree with a `min_score` holds only the nodes scoring at least it: sizes vary, down to
    the root alone when the cut is above every score. Greedy output equals the baseline, every
    commit leaves both caches equal to a fresh prefill, and sampling with top_k=1 (a point
    mass) equals greedy on such trees too."""
    full = engine.generate(PROMPTS[0], GREEDY, TreeParams(3, 3, 8), "aux", keep_events=True)
    scores = sorted(n.score for ev in full.events if ev.tree for n in ev.tree[1:])
    cut = scores[len(scores) // 2] if where == "median" else 0.999
    assert scores[-1] < 0.999
    watcher = Watcher(engine, PROMPTS[0]).install(monkeypatch)
    result = engine.generate(PROMPTS[0], GREEDY, TreeParams(3, 3, 8, min_score=cut), "aux",
                             keep_events=True)
    assert result.token_ids == baseline[0]
    trees = [ev.tree for ev in result.events if ev.tree]
    assert all(node.score >= cut for tree in trees for node in tree[1:])
    sizes = {len(tree) for tree in trees}
    assert len(sizes) >= 3 if where == "median" else sizes == {1}
    assert watcher.checks == len(trees)
    point_mass = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1, seed=5)
    sampled = engine.generate(PROMPTS[0], point_mass, TreeParams(3, 3, 8, min_score=cut), "aux")
    assert sampled.token_ids == baseline[0]  # sampled acceptance on the same trees


def test_step_cut_trees_keep_parity_and_exact_caches(engine: EagleEngine,
                                                     baseline: list[list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree with a `step_cut` at the median of the steps' best first-level scores drafts its
    second and third levels only in the steps whose best draft reaches it: some verified trees
    hold the head's drafts at depth 2 or more, others only depth 1. Greedy output equals the
    baseline, every commit leaves both caches equal to a fresh prefill, and sampling with
    top_k=1 (a point mass) equals greedy on such trees too."""
    tree = TreeParams(3, 3, 8, context_drafts=False)
    full = engine.generate(PROMPTS[0], GREEDY, tree, "aux", keep_events=True)
    best = sorted(max(n.score for n in ev.tree if n.depth == 1) for ev in full.events if ev.tree)
    cut = replace(tree, step_cut=best[len(best) // 2])
    watcher = Watcher(engine, PROMPTS[0]).install(monkeypatch)
    result = engine.generate(PROMPTS[0], GREEDY, cut, "aux", keep_events=True)
    assert result.token_ids == baseline[0]
    trees = [ev.tree for ev in result.events if ev.tree]
    deep = [max(n.depth for n in t) > 1 for t in trees]
    assert any(deep) and not all(deep)
    for t, d in zip(trees, deep):  # a step past the first ran exactly where the best reached it
        assert d == (max(n.score for n in t if n.depth == 1) >= cut.step_cut)
    assert watcher.checks == len(trees)
    point_mass = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1, seed=5)
    assert engine.generate(PROMPTS[0], point_mass, cut, "aux").token_ids == baseline[0]


def assert_rows_equal(cache: KVCache, fresh: KVCache, n: int) -> None:
    for (k, v), (fk, fv) in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(k[:, :, :n], fk[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[:, :, :n], fv[:, :, :n], atol=1e-4, rtol=1e-4)


def step_lengths(result: GenerationResult) -> list[int]:
    """Tokens each verify step produced (accepted drafts + bonus), from the event trees."""
    return [sum(node.accepted for node in ev.tree) for ev in result.events if ev.tree]


def late_sibling_accepts(result: GenerationResult) -> int:
    """Accepted tree nodes that were not their parent's first child."""
    count = 0
    for ev in result.events:
        for i, node in enumerate(ev.tree):
            if node.accepted and node.parent >= 0:
                first = next(j for j, m in enumerate(ev.tree) if m.parent == node.parent)
                count += first != i
    return count


ORACLE = [((1, 4, 5), "aux", 0), ((4, 5, 16), "noaux", 1), ((8, 8, 64), "deep_small_vocab", 2),
          ((3, 6, 4), "fcnorm_aux4", 0), ((2, 3, 10), "aux", 2)]


@pytest.mark.parametrize("shape, head, prompt", ORACLE,
                         ids=[f"k{s[0]}-s{s[1]}-n{s[2]}-{h}" for s, h, _ in ORACLE])
def test_perfect_oracle_full_accept_length(engine: EagleEngine, baseline: list[list[int]],
                                           monkeypatch: pytest.MonkeyPatch,
                                           shape: tuple[int, int, int], head: str,
                                           prompt: int) -> None:
    oracle = Oracle(engine, PROMPTS[prompt]).install(monkeypatch)
    tree = TreeParams(*shape, context_drafts=False)  # the head's depth bounds every step
    result = engine.generate(PROMPTS[prompt], GREEDY, tree, head, keep_events=True)
    assert result.token_ids == baseline[prompt]
    full = min(tree.num_steps, tree.num_draft_tokens - 1) + 1
    lengths = step_lengths(result)
    assert lengths[:-1] == [full] * (len(lengths) - 1) and lengths[-1] <= full
    assert result.stats.tau >= full - 1 and oracle.checks == len(lengths)


@pytest.mark.parametrize("shape, head, seed", [((1, 5, 6), "aux", 0), ((4, 4, 16), "noaux", 1),
                                               ((6, 6, 48), "deep_small_vocab", 2),
                                               ((3, 3, 10), "fcnorm_aux4", 3)])
def test_partial_oracle_parity_and_caches(engine: EagleEngine, baseline: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch,
                                          shape: tuple[int, int, int], head: str,
                                          seed: int) -> None:
    """Each level right with probability 0.7: accept lengths vary, accepted nodes sit at random
    sibling ranks (so commit moves non-contiguous rows), and every commit leaves exact caches."""
    prompt = seed % len(PROMPTS)
    oracle = Oracle(engine, PROMPTS[prompt], accuracy=0.7, seed=seed).install(monkeypatch)
    tree = TreeParams(*shape)
    result = engine.generate(PROMPTS[prompt], GREEDY, tree, head, keep_events=True)
    assert result.token_ids == baseline[prompt]
    lengths = step_lengths(result)
    assert len(set(lengths)) >= 2 and max(lengths) >= 3 and oracle.checks == len(lengths)
    if tree.topk > 1:
        assert late_sibling_accepts(result) > 0


def test_sampling_with_top_k_1_is_greedy(engine: EagleEngine, baseline: list[list[int]],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """temperature 1 with top_k=1 is a point mass: tree speculative sampling must reproduce
    the greedy output exactly, with random drafts and with an oracle."""
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1, seed=5)
    tree = TreeParams(4, 4, 16)
    assert engine.generate(PROMPTS[1], params, tree, "aux").token_ids == baseline[1]
    Oracle(engine, PROMPTS[1], accuracy=0.8, seed=4).install(monkeypatch)
    result = engine.generate(PROMPTS[1], params, tree, "aux")
    assert result.token_ids == baseline[1] and result.stats.tau > 2


@pytest.mark.parametrize("shape, params", [
    ((4, 4, 16), SamplingParams(max_new_tokens=NEW, temperature=0.02, seed=11)),
    ((1, 6, 7), SamplingParams(max_new_tokens=NEW, temperature=0.04, top_p=0.9, top_k=20, seed=3)),
])
def test_sampled_caches_and_seed(engine: EagleEngine, monkeypatch: pytest.MonkeyPatch,
                                 shape: tuple[int, int, int], params: SamplingParams) -> None:
    """Sampling: caches stay exact after every commit, a seed reproduces the output. (The
    tiny target's logits are flat, std ~0.1: low temperatures make its argmax, which the
    oracle plants, likely enough to be accepted often.)"""
    tree = TreeParams(*shape)
    oracle = Oracle(engine, PROMPTS[0], accuracy=1.0, seed=0).install(monkeypatch)
    first = engine.generate(PROMPTS[0], params, tree, "deep_small_vocab")
    assert oracle.checks >= 2 and first.stats.tau > 1.5 and len(first.token_ids) == NEW
    oracle.restart()
    again = engine.generate(PROMPTS[0], params, tree, "deep_small_vocab")
    assert again.token_ids == first.token_ids
    oracle.restart()
    other = engine.generate(PROMPTS[0], replace(params, seed=params.seed + 1), tree,
                            "deep_small_vocab")
    assert other.token_ids != first.token_ids


# ------------------------------------------------------------ stops inside an accepted run

CHAIN = TreeParams(1, 4, 5)  # with a perfect oracle: steps of exactly 5 tokens after the first


def run_with_oracle(engine: EagleEngine, monkeypatch: pytest.MonkeyPatch,
                    params: SamplingParams) -> GenerationResult:
    Oracle(engine, PROMPTS[0], check_caches=False).install(monkeypatch)
    return engine.generate(PROMPTS[0], params, CHAIN, "aux", keep_events=True)


def truncated_last_step(result: GenerationResult) -> bool:
    """The last verify step accepted more tokens than were emitted."""
    last = result.events[-1]
    return sum(node.accepted for node in last.tree) > len(last.tokens)


def test_eos_inside_accepted_run(engine: EagleEngine, baseline: list[list[int]],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ref = baseline[0]
    j = next(i for i in range(7, NEW) if ref[i] not in ref[:i] and (i - 1) % 5 not in (0, 4))
    monkeypatch.setattr(engine.parts, "eos_ids", (ref[j],))
    assert engine.generate(PROMPTS[0], GREEDY).token_ids == ref[:j]
    result = run_with_oracle(engine, monkeypatch, GREEDY)
    assert result.token_ids == ref[:j] and result.finished == "eos"
    assert truncated_last_step(result)


@pytest.mark.parametrize("limit", [8, 13, 22])
def test_max_new_tokens_inside_accepted_run(engine: EagleEngine, baseline: list[list[int]],
                                            monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    result = run_with_oracle(engine, monkeypatch, SamplingParams(max_new_tokens=limit))
    assert result.token_ids == baseline[0][:limit] and result.finished == "length"
    assert result.stats.num_tokens == limit and truncated_last_step(result)


def test_stop_string_inside_accepted_run(engine: EagleEngine, baseline: list[list[int]],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    decode = ByteTokenizer().decode
    text = decode(baseline[0])
    j = next(i for i in range(8, NEW - 2) if text.find(decode(baseline[0][i:i + 2])) == i)
    stop = decode(baseline[0][j:j + 2])
    result = run_with_oracle(engine, monkeypatch,
                             SamplingParams(max_new_tokens=NEW, stop=(stop,)))
    assert result.finished == "stop" and result.text == text[:j]
    assert result.token_ids == baseline[0][:j + 2]  # the stop string's tokens were emitted


def test_text_held_for_a_stop_string_is_released_at_eos(
        engine: EagleEngine, baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The last character before EOS starts a stop string that never completes: it is held
    back while a stop is possible and must still reach the output when EOS ends the run."""
    ref, decode = baseline[0], ByteTokenizer().decode
    j = next(i for i in range(7, NEW) if ref[i] not in ref[:i])
    monkeypatch.setattr(engine.parts, "eos_ids", (ref[j],))
    params = SamplingParams(max_new_tokens=NEW, stop=(decode(ref[j - 1:j]) + "\x7f",))
    for result in (engine.generate(PROMPTS[0], params),
                   run_with_oracle(engine, monkeypatch, params)):
        assert result.finished == "eos" and result.token_ids == ref[:j]
        assert result.text == decode(ref[:j])


def test_context_limit_mid_generation(engine: EagleEngine,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "config", replace(engine.config, max_len=40))
    monkeypatch.setattr(engine.parts, "max_len", 40)
    params = SamplingParams(max_new_tokens=200)
    base = engine.generate(PROMPTS[1], params)
    assert base.finished == "context" and len(base.token_ids) == 40 - len(PROMPTS[1]) + 1
    Oracle(engine, PROMPTS[1], check_caches=False).install(monkeypatch)
    spec = engine.generate(PROMPTS[1], params, CHAIN, "noaux")
    assert spec.finished == "context"
    assert spec.token_ids == base.token_ids[:len(spec.token_ids)]
    # steps of 5 from seq_len 7 while seq_len + 5 + 1 <= 40: 7, 12, ..., 32 -> 31 tokens
    assert len(spec.token_ids) == 31
