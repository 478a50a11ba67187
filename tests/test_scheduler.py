"""Issue 26, part 1: the scheduler steps several requests together (`scheduler.py`).

Every request's output equals running it alone: greedy EAGLE-3 (trees of different shapes and
heads in one batch) and plain decoding side by side, requests joining and leaving as others
finish, stop on a stop string, are cancelled, or hit the context window; seeded sampling draws
the same coins. A step makes one host read; a failing step fails only its own requests and the
scheduler goes on. On the bundled q4 target the batched forwards give the same answers as
solo runs.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from eagle_engine.config import ConfigError, EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.events import StepEvent
from eagle_engine.io_struct import EagleDraftExtendInput, EagleDraftInput
from eagle_engine.kv_cache import causal_mask, tree_mask
from eagle_engine.models.batched import SeqRows, draft_forward, target_forward
from eagle_engine.run import Run
from eagle_engine.scheduler import Handle, Scheduler
from eagle_engine.tools.sync_count import HostSyncs
from tests.helpers import tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")
HEADS = {"aux": {"intermediate_size": 64},
         "noaux": {"use_aux": False, "seed": 1, "intermediate_size": 64}}
Q4 = {"weights": "q4", "hidden_size": 64, "intermediate_size": 96}
TREES = [TreeParams(2, 3, 6), TreeParams(1, 1, 2), TreeParams(3, 2, 7), TreeParams(1, 4, 5)]
Request = tuple[list[int], SamplingParams, TreeParams, str | None]


@pytest.fixture(scope="module", params=["q4", "fp32"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> EagleEngine:
    kw = Q4 if request.param == "q4" else {}
    return tiny_engine(tmp_path_factory.mktemp(f"sched_{request.param}"), HEADS, max_len=256,
                       weight_scale=1.0, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mixed_requests(count: int, **params) -> list[Request]:
    """EAGLE-3 requests with both heads and four tree shapes, and plain requests, with
    different prompt lengths and answer lengths (so they leave at different steps)."""
    heads = ["aux", None, "noaux", "aux", "noaux", None]
    return [(prompt(i, 5 + 3 * i), SamplingParams(**{"max_new_tokens": 8 + 5 * i,
                                                     "ignore_eos": True, **params}),
             TREES[i % len(TREES)], heads[i % len(heads)]) for i in range(count)]


def solo(engine: EagleEngine, requests: list[Request]) -> list[list[int]]:
    return [engine.generate(*r).token_ids for r in requests]


def tokens(events: list[StepEvent]) -> list[int]:
    return [t.token_id for ev in events for t in ev.tokens]


def run_all(engine: EagleEngine, requests: list[Request], max_batch: int
            ) -> tuple[list[list[StepEvent]], Scheduler]:
    scheduler = engine.new_scheduler(max_batch)
    handles = [scheduler.submit(*r) for r in requests]
    scheduler.run_until_idle()
    return [list(h.events()) for h in handles], scheduler


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_greedy_batched_equals_solo(engine: EagleEngine, max_batch: int) -> None:
    """Six requests (four tree shapes, two heads, plain decoding) through batches of 1, 3
    (requests join as others leave) and 8 (all at once)."""
    requests = mixed_requests(6)
    events, scheduler = run_all(engine, requests, max_batch)
    assert [tokens(e) for e in events] == solo(engine, requests)
    assert all(e[-1].finished == "length" for e in events)
    batches = [ev.batch for e in events for ev in e]
    assert max(batches) == min(max_batch, 6) and min(batches) >= 1
    if max_batch == 3:  # the later requests joined mid-way, after the first ones left
        assert max(batches) == 3 and scheduler.steps < sum(len(e) for e in events)


def test_sampled_batched_equals_solo_with_the_same_seed(engine: EagleEngine) -> None:
    """Each request draws its coins from its own generator: the same tokens as alone."""
    requests = mixed_requests(5, temperature=0.9, top_p=0.95, seed=11)
    events, _ = run_all(engine, requests, 4)
    assert [tokens(e) for e in events] == solo(engine, requests)


def test_trees_with_a_min_score_batch_like_solo(engine: EagleEngine) -> None:
    """Trees cut at a minimum draft probability vary in size from step to step (at 0.999 every
    tree is the root alone); batched with full trees and plain decoding, greedy and sampled,
    each request gets its solo tokens."""
    cuts = [TreeParams(3, 2, 7, min_score=0.1), TreeParams(2, 3, 6, min_score=0.999),
            TreeParams(2, 3, 6), None]
    for params in ({}, {"temperature": 0.9, "seed": 3}):
        requests = [(prompt(i, 6 + 2 * i), SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                          **params), tree, tree and "aux")
                    for i, tree in enumerate(cuts)]
        events, _ = run_all(engine, requests, 4)
        assert [tokens(e) for e in events] == solo(engine, requests)
        root_only = events[1][-1].stats
        assert root_only["step_tokens"] == root_only["num_steps"]  # one token a step


def test_sure_context_chains_past_the_tree_batch_like_solo(engine: EagleEngine) -> None:
    """Trees whose context chain goes past the budget (context_extra) on a repetitive prompt,
    batched with a tree without it and plain decoding, greedy and sampled: each request gets
    its solo tokens, and some verified tree is larger than its num_draft_tokens."""
    repeat = [1] + [10, 11, 12, 13, 14, 15, 16, 17] * 4
    trees = [TreeParams(2, 1, 3, context_extra=8), TreeParams(3, 2, 5, min_score=0.05,
                                                              context_extra=4),
             TreeParams(2, 3, 6), None]
    for params in ({}, {"temperature": 0.9, "seed": 3}):
        requests = [(repeat[i:], SamplingParams(max_new_tokens=64, ignore_eos=True, **params),
                     tree, tree and "aux") for i, tree in enumerate(trees)]
        events, _ = run_all(engine, requests, 4)
        assert [tokens(e) for e in events] == solo(engine, requests)
        if not params:
            assert max(len(ev.tree) for ev in events[0]) > trees[0].num_draft_tokens


def test_step_cut_trees_batch_like_solo(engine: EagleEngine) -> None:
    """Trees with a `step_cut` (at the median of a probe's best first-level scores) stop drafting
    in some steps and not in others; batched with a tree without one and plain decoding, greedy
    and sampled, each request verifies its solo trees and gets its solo tokens."""
    probe = TreeParams(3, 2, 5, context_drafts=False)
    first = prompt(7, 9)
    steps = engine.generate(first, SamplingParams(max_new_tokens=24, ignore_eos=True), probe,
                            "aux", keep_events=True).events
    best = sorted({max(n.score for n in ev.tree if n.depth == 1) for ev in steps if ev.tree})
    # halfway between two scores next to the median: a dense fp32 batch may round a score in its
    # last bits, which must not decide the cut
    cut = (best[len(best) // 2 - 1] + best[len(best) // 2]) / 2
    trees = [replace(probe, step_cut=cut), TreeParams(2, 3, 6, context_drafts=False,
                                                      step_cut=cut), TreeParams(2, 3, 6), None]

    def shapes(events: list[StepEvent]) -> list[list[tuple[int, int]]]:
        return [[(n.token_id, n.parent) for n in ev.tree] for ev in events]

    for params in ({}, {"temperature": 0.9, "seed": 3}):
        requests = [(first if i == 0 else prompt(i, 6 + 2 * i),
                     SamplingParams(max_new_tokens=24, ignore_eos=True, **params), tree,
                     tree and "aux") for i, tree in enumerate(trees)]
        events, _ = run_all(engine, requests, 4)
        alone = [engine.generate(*r, keep_events=True).events for r in requests]
        assert [tokens(e) for e in events] == [tokens(e) for e in alone]
        assert [shapes(e) for e in events] == [shapes(e) for e in alone]
        if not params:  # the cut is at the greedy probe's median
            deep = [max(n.depth for n in ev.tree) > 1 for ev in events[0] if ev.tree]
            assert any(deep) and not all(deep)


def test_caches_after_every_batched_commit_equal_a_fresh_prefill(engine: EagleEngine) -> None:
    """Four EAGLE-3 requests (two heads, four trees) stepped together: after every step, each
    one's committed target and draft cache rows equal a fresh prefill of its committed tokens
    (the one definition of verify, commit and extend, over a batch)."""
    requests = [(prompt(i, 6 + 3 * i), SamplingParams(max_new_tokens=20, ignore_eos=True),
                 TREES[i], ("aux", "noaux")[i % 2]) for i in range(4)]
    scheduler = engine.new_scheduler(4)
    handles = [scheduler.submit(*r) for r in requests]
    checked = 0
    while scheduler.busy:
        scheduler.step()
        for req in scheduler._active:
            if req.state is not None:
                with torch.inference_mode():
                    check_caches(engine, req.run, req.state.seq_len)
                checked += 1
    assert checked >= 20 and all(list(h.events())[-1].finished == "length" for h in handles)


def check_caches(engine: EagleEngine, run: Run, n: int) -> None:
    """Rows [0, n) of `run`'s target and draft caches == a fresh prefill of its n committed
    tokens."""
    from tests.test_loop import assert_rows_equal

    assert len(run.tokens) == n + 1  # the committed rows and the root
    positions, mask = torch.arange(n)[None], causal_mask(n, 0, "cpu")
    fresh = engine.target.new_cache(max_len=n)
    out = engine.target(torch.tensor([run.tokens[:n]]), positions, fresh, 0, mask, run.aux_ids)
    assert_rows_equal(run.cache, fresh, n)
    feats = out.aux_hidden if run.aux_ids else out.final_hidden
    fresh_draft = run.draft_model.new_cache(n)
    run.draft_model(torch.tensor([run.tokens[1:n + 1]]), feats, positions, fresh_draft, 0, mask,
                    from_target=True)
    assert_rows_equal(run.draft_cache, fresh_draft, n)


def test_stop_string_mid_batch(engine: EagleEngine) -> None:
    """A request ends on a stop string inside an accepted run while the rest go on; its text
    is its solo text."""
    requests = mixed_requests(5)
    alone = solo(engine, requests)
    text = engine.tokenizer.decode(alone[2])
    stop = text[len(text) // 3:len(text) // 3 + 2]
    p = requests[2][1]
    requests[2] = (requests[2][0], SamplingParams(max_new_tokens=p.max_new_tokens,
                                                  ignore_eos=True, stop=(stop,)),
                   *requests[2][2:])
    expected = solo(engine, requests)
    assert len(expected[2]) < len(alone[2])
    events, _ = run_all(engine, requests, 4)
    assert [tokens(e) for e in events] == expected
    assert events[2][-1].finished == "stop"
    assert "".join(ev.text for ev in events[2]) == engine.generate(*requests[2]).text


def test_cancel_mid_batch(engine: EagleEngine) -> None:
    """A request cancelled after three steps leaves with a prefix of its solo answer; the
    others are unchanged."""
    requests = mixed_requests(4)
    expected = solo(engine, requests)
    scheduler = engine.new_scheduler(4)
    handles = [scheduler.submit(*r) for r in requests]
    for _ in range(3):
        scheduler.step()
    handles[0].cancel()
    scheduler.run_until_idle()
    got = [tokens(list(h.events())) for h in handles]
    assert got[1:] == expected[1:]
    assert 0 < len(got[0]) < len(expected[0]) and got[0] == expected[0][:len(got[0])]


def test_context_limit_for_one_request_while_the_others_go_on(engine: EagleEngine) -> None:
    long_prompt = prompt(99, engine.config.max_len - 20)
    requests = mixed_requests(3) + [(long_prompt, SamplingParams(max_new_tokens=64,
                                                                 ignore_eos=True),
                                     TreeParams(2, 3, 6), "aux")]
    events, _ = run_all(engine, requests, 4)
    assert [tokens(e) for e in events] == solo(engine, requests)
    assert events[3][-1].finished == "context"
    assert [e[-1].finished for e in events[:3]] == ["length"] * 3


def test_one_host_read_per_step(engine: EagleEngine) -> None:
    """Steps that admit nobody make one host sync: the packed read of every request's results
    (admitting adds the prompt's upload, as a solo prefill does)."""
    scheduler = engine.new_scheduler(4)
    handles = [scheduler.submit(*r) for r in mixed_requests(4)]
    scheduler.step()  # admits all four
    counted = 0
    while scheduler.busy:
        with HostSyncs() as syncs:
            scheduler.step()
        assert syncs.kinds == {"tolist": 1}, syncs.where
        assert next(iter(syncs.where)).startswith("tolist at scheduler.py:")
        counted += 1
    assert counted > 5 and all(list(h.events()) for h in handles)


def test_first_token_goes_out_before_the_head_reads_the_prompt(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An admitted request's first event is in its handle before it reads its prompt (the
    context's index, the head's extend), also for a one-token answer; the answers stay their
    solo answers."""
    requests = mixed_requests(4)
    requests[3] = (requests[3][0], SamplingParams(max_new_tokens=1, ignore_eos=True),
                   *requests[3][2:])
    scheduler = engine.new_scheduler(4)
    handles = [scheduler.submit(*r) for r in requests]
    waiting = []  # per request reading its prompt: the events already in its handle
    real = Scheduler._read_prompt

    def read_prompt(run: Run, ext: EagleDraftExtendInput) -> EagleDraftInput:
        owner = handles[[r[0] for r in requests].index(run.prompt)]
        waiting.append(owner._queue.qsize())
        return real(run, ext)
    monkeypatch.setattr(Scheduler, "_read_prompt", staticmethod(read_prompt))
    scheduler.run_until_idle()
    assert waiting == [1, 1, 1], waiting  # three EAGLE-3 requests, one of them one token long
    assert [tokens(list(h.events())) for h in handles] == solo(engine, requests)


def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    import eagle_engine.batch_phases as sched

    scheduler = engine.new_scheduler(4)
    requests = mixed_requests(3)
    handles = [scheduler.submit(*r) for r in requests]
    scheduler.step()
    real = sched.verify_forward

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("injected")
    monkeypatch.setattr(sched, "verify_forward", broken)
    scheduler.step()
    monkeypatch.setattr(sched, "verify_forward", real)
    for h in handles:
        with pytest.raises(RuntimeError, match="injected"):
            list(h.events())
    assert not scheduler.busy
    events, _ = run_all(engine, requests, 4)  # a fresh batch: the same answers as alone
    assert [tokens(e) for e in events] == solo(engine, requests)
    with pytest.raises(ConfigError, match="unknown draft head"):
        scheduler.submit([1, 2, 3], SamplingParams(), None, "missing")


def test_an_executor_steps_requests_submitted_from_threads(engine: EagleEngine) -> None:
    requests = mixed_requests(4)
    expected = solo(engine, requests)
    with ThreadPoolExecutor(max_workers=1) as pool:
        scheduler = engine.new_scheduler(4, pool)
        with ThreadPoolExecutor(max_workers=4) as visitors:
            futures = [visitors.submit(lambda r: tokens(list(scheduler.submit(*r).events())), r)
                       for r in requests]
            assert [f.result(timeout=120) for f in futures] == expected
    assert not scheduler.busy


def test_waiting_request_cancelled_before_admission(engine: EagleEngine) -> None:
    scheduler = engine.new_scheduler(1)
    first, second = (scheduler.submit(*r) for r in mixed_requests(2))
    second.cancel()
    scheduler.run_until_idle()
    assert list(second.events()) == [] and list(first.events())
    assert isinstance(first, Handle)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dense_batched_forwards_read_each_weight_once(tmp_path, dtype: str) -> None:
    """Dense weights: three requests' rows (a prompt, a tree, one token; different caches,
    starts and masks) go through each linear in one call, target and head, and every request
    gets the logits, features and cache rows of its solo forward."""
    engine = tiny_engine(tmp_path, {"aux": {"intermediate_size": 64}}, dtype=dtype)
    target, head = engine.target, engine.heads["aux"]
    aux = head.cfg.resolve_aux_layer_ids(target.cfg)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "fp32" else {"atol": 3e-2, "rtol": 3e-2}
    lens, starts = [7, 5, 1], [0, 9, 4]
    ancestors = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    ancestors[3, 2] = ancestors[4, 2] = ancestors[4, 3] = False  # two branches from node 1
    masks = [causal_mask(7, 0, "cpu")[0], tree_mask(ancestors, 9)[0], None]

    def seqs(model, caches):
        return [SeqRows(torch.tensor(prompt(i, n)), torch.arange(s, s + n), c, s, m,
                        torch.randn(n, 3 * target.cfg.hidden_size if model is head else 0,
                                    generator=torch.Generator().manual_seed(i)).to(
                            target.dtype))
                for i, (n, s, c, m) in enumerate(zip(lens, starts, caches, masks))]

    def filled(model):  # caches with rows before each request's start
        caches = [model.new_cache() for _ in lens]
        for c in caches:
            for k, v in c.layers:
                k.normal_(generator=torch.Generator().manual_seed(5))
                v.normal_(generator=torch.Generator().manual_seed(6))
        return caches

    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for m in (target.layers[0].self_attn.qkv_proj, head.layers[0].mlp.down_proj)]
    solo_caches, many_caches = filled(target), filled(target)
    many = target_forward(target, seqs(target, many_caches), aux)
    assert len(calls) == 1
    for s, out, c in zip(seqs(target, solo_caches), many, many_caches):
        alone = target(s.ids[None], s.positions[None], s.cache, s.start,
                       None if s.mask is None else s.mask[None], aux)
        torch.testing.assert_close(out.logits, alone.logits, **tol)
        torch.testing.assert_close(out.aux_hidden, alone.aux_hidden, **tol)
        for (k1, v1), (k2, v2) in zip(c.layers, s.cache.layers):
            torch.testing.assert_close(k1, k2, **tol)
            torch.testing.assert_close(v1, v2, **tol)
    calls.clear()
    solo_caches, many_caches = filled(head), filled(head)
    many = draft_forward(head, seqs(head, many_caches), from_target=True)
    assert len(calls) == 1
    for s, (logits, hidden) in zip(seqs(head, solo_caches), many):
        alone = head(s.ids[None], s.hidden[None], s.positions[None], s.cache, s.start,
                     None if s.mask is None else s.mask[None], from_target=True)
        torch.testing.assert_close(logits, alone[0], **tol)
        torch.testing.assert_close(hidden, alone[1], **tol)
    for h in hooks:
        h.remove()


@pytest.mark.slow
def test_bundled_q4_batched_equals_solo() -> None:
    """The real target and head: four chat prompts batched, EAGLE-3 and plain decoding, the
    tokens of their solo runs."""
    engine = EagleEngine.load(EngineConfig(drafts=("eagle3-aux-1layer",), max_len=512))
    assert engine.config.weights == "q4"
    prompts = ["Write a haiku about the sea.", "What is the capital of France?",
               "Give me three tips for staying productive.", "Name two prime numbers."]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    requests = [(engine.encode(p), params, tree, head) for p, tree, head in zip(
        prompts, [TreeParams(1, 1, 2), TreeParams(2, 2, 3), None, TreeParams(4, 3, 8)],
        ["eagle3-aux-1layer", "eagle3-aux-1layer", None, "eagle3-aux-1layer"])]
    events, _ = run_all(engine, requests, 4)
    assert [tokens(e) for e in events] == solo(engine, requests)


def test_bad_batch_and_cache_sizes_are_named() -> None:
    with pytest.raises(ConfigError, match="max_batch must be in \\[1, 64\\], got 0"):
        EngineConfig(max_batch=0)
    with pytest.raises(ConfigError, match="prefix_cache_mb must be >= 0, got -1"):
        EngineConfig(prefix_cache_mb=-1)
