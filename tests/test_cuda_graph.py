"""The static-buffer (CUDA-graph) path against the dynamic path.

On CPU the runners replay their static functions eagerly (GraphMode.STATIC): padding, copy-in
and slice-out, whole-cache masks and index-written KV rows must give the eager phases' tokens
exactly and their floats to rounding, phase by phase and through the whole engine. The graph
tests proper (captured replay == eager for every shape and padding, no host sync under
`torch.cuda.set_sync_debug_mode("error")`, graphs on by default) are marked `cuda` and skipped
without it; `python -m eagle_engine selfcheck` runs the same checks on a GPU.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from eagle_engine import cuda_graph
from eagle_engine.accept import extend
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.cuda_graph import (
    EAGER_PHASES,
    CaptureHidden,
    DecodeRunner,
    DraftDecodeRunner,
    DraftExtendRunner,
    GraphMode,
    GraphPhases,
    VerifyRunner,
    decode,
    graph_mode,
)
from eagle_engine.draft import draft
from eagle_engine.engine import EagleEngine
from eagle_engine.io_struct import EagleDraftExtendInput, EagleVerifyInput
from eagle_engine.kernels import reference
from eagle_engine.kv_cache import causal_mask
from eagle_engine.scheduler import Scheduler
from eagle_engine.selfcheck import (
    EAGLE31,
    TINY_TREE,
    IdTokenizer,
    batch_parity,
    check_no_sync,
    engine_pair,
    engine_parity,
    phase_parity,
    prefill_both,
    tiny_models,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")
TREES = [TINY_TREE, TreeParams(1, 3, 4), TreeParams(8, 6, 32), TreeParams(2, 1, 3),
         TreeParams(2, 2, 6, context_drafts=True), TreeParams(1, 3, 4, context_drafts=False)]
HEAD_TREE = replace(TINY_TREE, context_drafts=False)  # the extend is num_steps + 1 wide
# the default head's recipe, in fp32: in bf16 the random tiny heads' drafts sit at near-ties, and
# whole-cache attention (static) rounds them apart from live-row attention (eager) for 4 of seeds
# 0-4 with fc_norm and normed recycling, 1 of 5 without
EAGLE31_TREES = [TINY_TREE, TreeParams(2, 2, 6, context_drafts=True)]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def failures(rows: list) -> list:
    return [(r.check, r.detail) for r in rows if not r.ok]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tree", TREES, ids=[f"K{t.topk}-S{t.num_steps}-N{t.num_draft_tokens}"
                                             f"{'-ctx' * t.context_drafts}" for t in TREES])
def test_static_phases_equal_eager_phases(tree: TreeParams, dtype: torch.dtype) -> None:
    target, head = tiny_models("cpu", dtype)
    rows = phase_parity(target, head, tree, GraphMode.STATIC)
    assert len(rows) == 5 and failures(rows) == []


@pytest.mark.parametrize("tree", EAGLE31_TREES, ids=["tiny", "K2-S2-N6-ctx"])
def test_static_phases_equal_eager_phases_for_an_eagle31_head(tree: TreeParams) -> None:
    """fc_norm and the normed hidden recycled (norm_output) through the static buffers."""
    target, head = tiny_models("cpu", recipe=EAGLE31)
    assert head.cfg.fc_norm and head.cfg.norm_output
    rows = phase_parity(target, head, tree, GraphMode.STATIC)
    assert len(rows) == 5 and failures(rows) == []


def test_extend_prepare_pads_copies_and_masks() -> None:
    target, head = tiny_models("cpu")
    runners = GraphPhases(target, target.new_cache(max_len=64), head, HEAD_TREE, 96)
    runner = runners.runners["extend"][1]
    width = runner.buffers.hidden.shape[1]
    for T in (2, 5, 1):  # grow to the full width, then shrink: stale rows must not survive
        tokens = torch.arange(10, 10 + T)
        hidden = torch.randn(T, width)
        runner.replay_prepare(EagleDraftExtendInput(tokens, hidden, 30))
        b, pad = runner.buffers, 5 - T
        assert b.ids.tolist() == [0] * pad + tokens.tolist()
        assert torch.equal(b.hidden[:pad], torch.zeros(pad, width))
        assert torch.equal(b.hidden[pad:], hidden)
        real_rows, pad_rows = list(range(30, 30 + T)), list(range(30 + T, 35))
        assert b.cache_rows.tolist() == pad_rows + real_rows
        assert torch.equal(b.positions, b.cache_rows)
        assert torch.equal(b.mask, torch.arange(96)[None, :] <= b.cache_rows[:, None])
        assert not b.mask[pad:, 30 + T:].any()  # no real row sees a pad row


def test_verify_prepare_builds_whole_cache_tree_mask() -> None:
    target, _ = tiny_models("cpu")
    runner = VerifyRunner(target, target.new_cache(max_len=64), 6, ())
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    depth, ancestors, retrieve = reference.build_tree_from_parents(parents, 3)
    runner.replay_prepare(EagleVerifyInput(torch.arange(6) + 3, parents, depth, ancestors,
                                           retrieve, 20, torch.ones(6), torch.zeros_like(parents)))
    b = runner.buffers
    assert b.mask[:, :20].all() and not b.mask[:, 26:].any()
    assert torch.equal(b.mask[:, 20:26], ancestors)
    assert b.positions.tolist() == (20 + depth).tolist()
    assert b.cache_rows.tolist() == list(range(20, 26))


def test_decode_runner_equals_the_baseline_step() -> None:
    target, _ = tiny_models("cpu")
    eager_cache, static_cache = target.new_cache(max_len=64), target.new_cache(max_len=64)
    runner = DecodeRunner(target, static_cache)
    prompt = torch.arange(3, 13)
    for cache in (eager_cache, static_cache):
        out = target(prompt[None], torch.arange(10)[None], cache, 0, causal_mask(10, 0, "cpu"))
    token = out.logits[0, -1:].argmax(-1)  # [1]
    for seq in range(10, 20):
        want = decode(target, token, seq, eager_cache)
        got = runner((token, seq))
        assert want.shape == got.shape == (1, target.cfg.vocab_size)
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        # floats to rounding relative to the largest logit, as `selfcheck.phase_parity` compares
        torch.testing.assert_close(got, want, rtol=0, atol=5e-5 * want.abs().max().item())
        token = want.argmax(-1)


def test_fallback_to_eager_when_the_call_does_not_fit() -> None:
    target, head = tiny_models("cpu")
    K, S = HEAD_TREE.topk, HEAD_TREE.num_steps
    runners = GraphPhases(target, target.new_cache(max_len=96), head, HEAD_TREE, 96 + K * S)
    state = prefill_both(target, head, (runners.runners["verify"][1].cache,),
                         (runners.draft_cache,), K, seed=3)
    long_ext = EagleDraftExtendInput(torch.arange(3, 3 + S + 2), torch.randn(
        S + 2, runners.runners["extend"][1].buffers.hidden.shape[1]), state.seq_len)
    assert not runners.runners["extend"][1].fits(long_ext)  # longer than num_steps + 1
    eager_cache = head.new_cache(96 + K * S)
    for layer, bound in zip(eager_cache.layers, runners.draft_cache.layers):
        for t, b in zip(layer, bound):
            t.copy_(b)
    want = extend(head, long_ext, eager_cache, K)
    got = runners.extend(head, long_ext, runners.draft_cache, K)
    assert torch.equal(want.topk_p, got.topk_p) and torch.equal(want.hidden, got.hidden)
    other = head.new_cache(96 + K * S)  # a cache the runners were not built on
    assert runners._runner("draft", head, other, state) is None
    assert runners._runner("draft", head, runners.draft_cache, state) is not None
    head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.clone())  # rebound after capture
    assert runners._runner("draft", head, runners.draft_cache, state) is None
    tree = runners.draft(head, state, runners.draft_cache, HEAD_TREE)
    assert torch.equal(tree.tokens, draft(head, state, runners.draft_cache, HEAD_TREE).tokens)


def static_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's graph mode becomes STATIC on CPU: what graphs mode runs on CUDA, replayed
    eagerly."""
    monkeypatch.setattr(cuda_graph, "graph_mode",
                        lambda enabled, device: GraphMode.STATIC if enabled else GraphMode.EAGER)


def test_engine_static_path_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    static_graphs(monkeypatch)
    target, head = tiny_models("cpu")
    eager, static = engine_pair(target, IdTokenizer(), {"tiny": head},
                                EngineConfig(dtype="fp32", max_len=192))
    cache = target.new_cache(max_len=192)
    assert static.phases("tiny", TINY_TREE, cache).mode is GraphMode.STATIC
    assert eager.phases("tiny", TINY_TREE, cache) is EAGER_PHASES
    rows = engine_parity((eager, static), "tiny", list(range(3, 40)), TINY_TREE, 60)
    assert len(rows) == 2 and failures(rows) == []
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    assert failures(batch_parity((eager, static), "tiny", prompts, TINY_TREE, 40)) == []


def test_the_apps_request_path_runs_graph_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under graphs, requests stepped together by a scheduler on an executor (the app's path)
    run every phase through the runners on their slot's cache: the eager functions run only
    the draft extend over each prompt (wider than the extend's graph); slots are reused, at
    most `max_batch` of them."""
    static_graphs(monkeypatch)
    target, head = tiny_models("cpu")
    engine = EagleEngine(target, IdTokenizer(), {"tiny": head},
                         EngineConfig(dtype="fp32", max_len=192, max_batch=2))
    called = []
    for cls in (DraftDecodeRunner, VerifyRunner, DraftExtendRunner, DecodeRunner):
        monkeypatch.setattr(cls, "__call__", lambda self, inp, real=cls.__call__: (
            called.append(type(self).__name__), real(self, inp))[1])
    eager = []
    for fn in ("draft", "run_target", "extend", "decode"):
        monkeypatch.setattr(cuda_graph, fn, lambda *a, real=getattr(cuda_graph, fn), name=fn: (
            eager.append((name, a[1].tokens.numel() if name == "extend" else 0)), real(*a))[1])
    scheduler = Scheduler(engine, executor=ThreadPoolExecutor(1))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    handles = [scheduler.submit(list(range(3 + i, 30)), params, TINY_TREE, h)
               for i in range(3) for h in ("tiny", None)]
    assert all(len(list(h.events())) > 1 for h in handles)
    assert set(called) == {"DraftDecodeRunner", "VerifyRunner", "DraftExtendRunner",
                           "DecodeRunner"}
    assert sorted(eager) == [("extend", 27 - i) for i in range(3)][::-1], eager  # the prompts
    assert len(scheduler._free) == 2 and not scheduler.busy


def test_cpu_engine_keeps_the_eager_path() -> None:
    assert graph_mode(True, torch.device("cpu")) is GraphMode.EAGER
    assert graph_mode(True, torch.device("cuda")) is GraphMode.GRAPHS
    assert graph_mode(False, torch.device("cuda")) is GraphMode.EAGER
    target, head = tiny_models("cpu")
    engine = engine_pair(target, IdTokenizer(), {"tiny": head}, EngineConfig(max_len=64))[1]
    phases = engine.phases("tiny", TINY_TREE, target.new_cache(max_len=64))
    assert phases is EAGER_PHASES and phases.draft is draft and phases.draft_cache is None


def test_capture_hidden_modes() -> None:
    h = torch.arange(12.0).view(3, 4)
    assert CaptureHidden.NONE.select(h) is None
    assert torch.equal(CaptureHidden.LAST.select(h), h[-1])
    assert torch.equal(CaptureHidden.FULL.select(h), h)
    target, head = tiny_models("cpu")
    runners = GraphPhases(target, target.new_cache(max_len=64), head, TINY_TREE, 96).runners
    modes = {name: runner.capture_hidden for name, (_, runner) in runners.items()}
    assert modes == {"verify": CaptureHidden.FULL, "draft": CaptureHidden.NONE,
                     "extend": CaptureHidden.LAST}
    verify_out = runners["verify"][1](runners["verify"][1].dummy_input())
    assert verify_out.features.shape == (TINY_TREE.num_draft_tokens, 3 * 32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tree", TREES, ids=[f"K{t.topk}-S{t.num_steps}-N{t.num_draft_tokens}"
                                             f"{'-ctx' * t.context_drafts}" for t in TREES])
def test_graph_replay_equals_eager(tree: TreeParams, dtype: torch.dtype) -> None:
    target, head = tiny_models("cuda", dtype)
    assert failures(phase_parity(target, head, tree, GraphMode.GRAPHS)) == []


@pytest.mark.cuda
@pytest.mark.parametrize("tree", EAGLE31_TREES, ids=["tiny", "K2-S2-N6-ctx"])
def test_graph_replay_equals_eager_for_an_eagle31_head(tree: TreeParams) -> None:
    target, head = tiny_models("cuda", recipe=EAGLE31)
    assert failures(phase_parity(target, head, tree, GraphMode.GRAPHS)) == []


@pytest.mark.cuda
def test_no_host_sync_in_graphed_phases_and_kernels() -> None:
    target, head = tiny_models("cuda")
    row = check_no_sync(target, head, TINY_TREE)
    assert row.ok, row.detail


@pytest.mark.cuda
def test_engine_uses_graphs_by_default_on_cuda_and_matches_eager() -> None:
    target, head = tiny_models("cuda")
    engines = engine_pair(target, IdTokenizer(), {"tiny": head},
                          EngineConfig(dtype="fp32", device="cuda", max_len=192))
    cache = target.new_cache(max_len=192)
    assert engines[1].phases("tiny", TINY_TREE, cache).mode is GraphMode.GRAPHS
    assert engines[1].phases(None, TINY_TREE, cache).mode is GraphMode.GRAPHS
    assert failures(engine_parity(engines, "tiny", list(range(3, 40)), TINY_TREE, 60)) == []
    prompts = [list(range(3 + i, 40)) for i in range(2)]  # B = 4: two prompts, EAGLE and plain
    assert failures(batch_parity(engines, "tiny", prompts, TINY_TREE, 60)) == []
