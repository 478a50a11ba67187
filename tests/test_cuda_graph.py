"""The static-buffer (CUDA-graph) path against the dynamic path.

On CPU the runners run the phases' one definition over the pools eagerly (GraphMode.STATIC):
padding, copy-in and slice-out, whole-row masks and index-written KV rows must give the eager
phases' tokens exactly and their floats to rounding, phase by phase and through the whole
engine. The graph
tests proper (captured replay == eager for every shape and padding, no host sync under
`torch.cuda.set_sync_debug_mode("error")`, graphs on by default) are marked `cuda` and skipped
without it; `python -m eagle_engine selfcheck` runs the same checks on a GPU (the shared
harness: `tools/parity.py`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from eagle_engine import cuda_graph
from eagle_engine.accept import extend
from eagle_engine.batch_phases import EagerPhases
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.cuda_graph import (
    DecodeRunner,
    DraftRunner,
    ExtendRunner,
    GraphMode,
    GraphPhases,
    VerifyRunner,
    bucket_for,
    buckets,
    graph_mode,
)
from eagle_engine.engine import EagleEngine
from eagle_engine.io_struct import (
    EagleDraftExtendInput,
    EagleDraftInput,
    EagleVerifyInput,
)
from eagle_engine.kernels import reference
from eagle_engine.kernels.reference import block_mask
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.tools.parity import (
    EAGLE31,
    TINY_TREE,
    IdTokenizer,
    Seat,
    batch_parity,
    engine_pair,
    engine_parity,
    graph_backend,
    phase_parity,
    tiny_models,
)
from eagle_engine.tools.selfcheck import check_no_sync
from eagle_engine.verify import run_target

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tree", TREES, ids=[f"K{t.topk}-S{t.num_steps}-N{t.num_draft_tokens}"
                                             f"{'-ctx' * t.context_drafts}" for t in TREES])
def test_static_phases_equal_eager_phases(tree: TreeParams, dtype: torch.dtype) -> None:
    target, head = tiny_models("cpu", dtype)
    rows = phase_parity(target, head, tree, GraphMode.STATIC)
    assert len(rows) == 6 and failures(rows) == []


@pytest.mark.parametrize("tree", EAGLE31_TREES, ids=["tiny", "K2-S2-N6-ctx"])
def test_static_phases_equal_eager_phases_for_an_eagle31_head(tree: TreeParams) -> None:
    """fc_norm and the normed hidden recycled (norm_output) through the static buffers."""
    target, head = tiny_models("cpu", recipe=EAGLE31)
    assert head.cfg.fc_norm and head.cfg.norm_output
    rows = phase_parity(target, head, tree, GraphMode.STATIC)
    assert len(rows) == 6 and failures(rows) == []


@pytest.mark.parametrize("batch,max_batch", [(2, 2), (3, 4), (4, 8)])
@pytest.mark.parametrize("tree", [TINY_TREE, TreeParams(2, 2, 6, context_drafts=True)],
                         ids=["tiny", "K2-S2-N6-ctx"])
def test_static_phases_of_a_padded_batch_equal_each_request_alone(
        tree: TreeParams, batch: int, max_batch: int) -> None:
    """Several requests replay one runner per phase, padded to their bucket: each gets
    its own eager phase's tokens, floats and cache rows, the pad rows touching no request's."""
    target, head = tiny_models("cpu")
    rows = phase_parity(target, head, tree, GraphMode.STATIC, batch=batch, max_batch=max_batch)
    assert len(rows) == 6 and failures(rows) == []


def test_buckets() -> None:
    assert buckets(1) == [1] and buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6]
    assert [bucket_for(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def backend(max_batch: int = 2, tree: TreeParams = HEAD_TREE
            ) -> tuple[GraphPhases, list[Seat], Eagle3Draft]:
    target, head = tiny_models("cpu")
    phases, pairs = graph_backend(target, head, tree, GraphMode.STATIC, max_batch, seed=3)
    return phases, [p.graph for p in pairs], head


def test_extend_prepare_pads_copies_and_masks() -> None:
    phases, seats, head = backend()
    pool = phases.draft_pools["head"]
    runner = ExtendRunner(head, phases.target, pool, HEAD_TREE, 2)
    width = runner.buffers.hidden.shape[-1]
    for T in (2, 5, 1):  # grow to the full width, then shrink: stale rows must not survive
        tokens = torch.arange(10, 10 + T)
        hidden = torch.randn(T, width)
        runner.prepare(1, EagleDraftExtendInput(tokens, hidden, 30))
        b, pad = runner.buffers, 5 - T
        assert b.ids[1].tolist() == [0] * pad + tokens.tolist()
        assert torch.equal(b.hidden[1, :pad], torch.zeros(pad, width))
        assert torch.equal(b.hidden[1, pad:], hidden)
        assert (30 + b.offsets[1]).tolist() == list(range(30 + T, 35)) + list(range(30, 30 + T))
        assert b.seq_len[1] == 30
    assert b.slots.tolist() == [pool.scratch] * 2  # as allocated: padding on the scratch row


def test_block_mask_places_each_requests_block_after_its_committed_rows() -> None:
    cols = torch.arange(12)
    block = torch.tensor([[[True, False, False], [True, True, False]],
                          [[True, False, True], [False, True, False]]])  # [B=2, T=2, W=3]
    mask = block_mask(cols, torch.tensor([2, 6]), block)
    assert mask.shape == (2, 2, 12)
    assert mask[0, :, :2].all() and torch.equal(mask[0, :, 2:5], block[0])
    assert not mask[0, :, 5:].any()
    assert mask[1, :, :6].all() and torch.equal(mask[1, :, 6:9], block[1])
    assert not mask[1, :, 9:].any()


def test_verify_pads_a_smaller_tree_and_the_batch() -> None:
    """A tree of 4 nodes in a graph of 6 (its pad nodes see only themselves and the committed
    rows), one request in a bucket of 2 (the other row writes the scratch row only)."""
    phases, seats, _ = backend()
    runner = VerifyRunner(phases.target, phases.pool, 6, (), 2)
    parents = torch.tensor([-1, 0, 0, 1])
    depth, ancestors, retrieve = reference.build_tree_from_parents(parents, 3)
    vin = EagleVerifyInput(torch.arange(4) + 3, parents, depth, ancestors, retrieve, 20,
                           torch.ones(4), torch.zeros_like(parents))
    before = phases.pool.data[seats[1].slot].clone()
    eager = phases.target.new_cache(max_len=phases.pool.max_len)
    eager.data.copy_(seats[0].cache.data)  # the request's committed rows
    (out,) = runner([vin], [seats[0].slot])
    b = runner.buffers
    assert out.logits.shape == (4, phases.target.cfg.vocab_size)
    assert b.ids[0].tolist() == [3, 4, 5, 6, 0, 0] and b.offsets[0].tolist() == [0, 1, 1, 2, 0, 0]
    assert torch.equal(b.ancestors[0, :4, :4], ancestors)
    assert torch.equal(b.ancestors[0, 4:], torch.eye(6, dtype=torch.bool)[4:])
    assert b.slots.tolist() == [seats[0].slot, phases.pool.scratch]
    assert torch.equal(phases.pool.data[seats[1].slot], before)  # no other request's rows
    want = run_target(phases.target, vin, eager, ())
    assert torch.equal(want.logits.argmax(-1), out.logits.argmax(-1))
    torch.testing.assert_close(out.logits, want.logits, rtol=0,
                               atol=5e-5 * want.logits.abs().max().item())


def test_phases_fall_back_to_eager_where_no_graph_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step cut (the host decides the levels), a head whose weights moved after capture and
    an extend longer than the graph run the eager phases, only for the requests concerned."""
    phases, seats, head = backend()
    K, S = HEAD_TREE.topk, HEAD_TREE.num_steps
    calls: list[str] = []
    for name in ("draft", "extend"):
        monkeypatch.setattr(EagerPhases, name, lambda self, model, runs, inputs, name=name,
                            real=getattr(EagerPhases, name): (
                                calls.append(f"{name} x{len(runs)}"),
                                real(self, model, runs, inputs))[1])
    states = [draft_input(head, seat) for seat in seats]
    trees = phases.draft(head, seats, states)
    assert calls == [] and len(trees) == 2
    cut = replace(seats[0], tree=replace(HEAD_TREE, step_cut=0.5))
    mixed = phases.draft(head, [cut, seats[1]], states)
    assert calls == ["draft x1"]  # the step-cut request alone
    assert torch.equal(mixed[1].tokens, trees[1].tokens)
    width = phases.runners[("draft", "head", K, S, 1)].buffers.hidden.shape[-1]
    long_ext = EagleDraftExtendInput(torch.arange(3, 3 + S + 2), torch.randn(
        S + 2, 3 * width), states[0].seq_len)
    (got,) = phases.extend(head, seats[:1], [long_ext])
    assert calls == ["draft x1", "extend x1"]  # longer than num_steps + 1
    assert got.seq_len == states[0].seq_len + S + 2
    head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.clone())  # rebound
    phases.draft(head, seats, states)
    assert calls == ["draft x1", "extend x1", "draft x2"]


def draft_input(head: Eagle3Draft, seat: Seat) -> EagleDraftInput:
    """The draft input after an extend over 3 committed rows of `seat`'s draft cache."""
    width = EagleDraftExtendInput.hidden_size_for(head.cfg)
    ext = EagleDraftExtendInput(torch.arange(3, 6), torch.randn(3, width), 0)
    return extend(head, ext, seat.draft_cache, seat.tree.topk)


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
    assert isinstance(static.scheduler.phases, GraphPhases)
    assert type(eager.scheduler.phases) is EagerPhases
    rows = engine_parity((eager, static), "tiny", list(range(3, 40)), TINY_TREE, 60)
    assert len(rows) == 2 and failures(rows) == []
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    assert failures(batch_parity((eager, static), "tiny", prompts, TINY_TREE, 40)) == []


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_apps_request_path_runs_one_graph_per_phase_for_the_batch(
        monkeypatch: pytest.MonkeyPatch, max_batch: int) -> None:
    """Under graphs, requests stepped together by a scheduler on an executor (the app's path)
    run every phase through the runners, all of a step's requests of one head and tree in one
    call padded to its bucket: the eager phases run only the draft extend over each prompt
    (wider than the extend's graph, `run.extend`). Slots are reused, at most `max_batch`; the
    answers equal the eager engine's."""
    static_graphs(monkeypatch)
    target, head = tiny_models("cpu")
    config = EngineConfig(dtype="fp32", max_len=192, max_batch=max_batch)
    engine = EagleEngine(target, IdTokenizer(), {"tiny": head}, config)
    eager = EagleEngine(target, IdTokenizer(), {"tiny": head}, replace(config, cuda_graphs=False))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    requests = [(list(range(3 + i, 30)), h) for i in range(3) for h in ("tiny", None)]
    want = [eager.generate(p, params, TINY_TREE, h).token_ids for p, h in requests]
    called: list[tuple[str, int, int]] = []  # runner, requests, bucket
    for cls in (DraftRunner, VerifyRunner, ExtendRunner, DecodeRunner):
        monkeypatch.setattr(cls, "__call__", lambda self, inp, slots, real=cls.__call__: (
            called.append((type(self).__name__, len(inp), self.buffers.batch)),
            real(self, inp, slots))[1])
    eager_calls = []
    for fn in ("draft", "verify", "extend"):
        monkeypatch.setattr(EagerPhases, fn, lambda *a, name=fn: eager_calls.append(name))
    scheduler = engine.new_scheduler(executor=ThreadPoolExecutor(1))
    handles = [scheduler.submit(p, params, TINY_TREE, h) for p, h in requests]
    answers = [[t.token_id for ev in hd.events() for t in ev.tokens] for hd in handles]
    assert answers == want
    assert {c[0] for c in called} == {"DraftRunner", "VerifyRunner", "ExtendRunner",
                                      "DecodeRunner"}
    assert eager_calls == []
    assert all(n <= bucket == bucket_for(n, max_batch) for _, n, bucket in called)
    if max_batch > 1:  # several requests shared a replay
        assert max(n for _, n, _ in called) == 2  # two EAGLE-3 and two plain at a time
    assert sorted(scheduler.phases.free) == list(range(max_batch)) and not scheduler.busy


def test_mixed_trees_under_graphs_answer_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of trees that share no graph (a step cut, which drafts eagerly; a min score, whose
    trees vary in size and replay padded; drafts from the context; another head shape) and plain
    requests, stepped together under graphs: every greedy answer equals the eager engine's."""
    static_graphs(monkeypatch)
    target, head = tiny_models("cpu")
    config = EngineConfig(dtype="fp32", max_len=192, max_batch=4)
    eager = EagleEngine(target, IdTokenizer(), {"tiny": head}, replace(config, cuda_graphs=False))
    graphed = EagleEngine(target, IdTokenizer(), {"tiny": head}, config)
    trees = [TINY_TREE, replace(HEAD_TREE, step_cut=0.3), replace(TINY_TREE, min_score=0.05),
             TreeParams(2, 2, 6, context_drafts=True), TreeParams(2, 3, 5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    requests = [(list(range(3 + i, 28 + 2 * i)), trees[i % len(trees)], "tiny" if i % 4 else None)
                for i in range(7)]
    answers = []
    for engine in (eager, graphed):
        handles = [engine.scheduler.submit(p, params, t, h, trace=False) for p, t, h in requests]
        engine.scheduler.run_until_idle()
        answers.append([[t.token_id for ev in hd.events() for t in ev.tokens] for hd in handles])
    assert answers[0] == answers[1]
    keys = {key[0] for key, runner in graphed.scheduler.phases.runners.items() if runner}
    assert keys == {"draft", "verify", "extend", "decode"}


def test_cpu_engine_keeps_the_eager_path() -> None:
    assert graph_mode(True, torch.device("cpu")) is GraphMode.EAGER
    assert graph_mode(True, torch.device("cuda")) is GraphMode.GRAPHS
    assert graph_mode(False, torch.device("cuda")) is GraphMode.EAGER
    target, head = tiny_models("cpu")
    engine = engine_pair(target, IdTokenizer(), {"tiny": head}, EngineConfig(max_len=64))[1]
    assert type(engine.scheduler.phases) is EagerPhases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
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
@pytest.mark.parametrize("batch,max_batch", [(2, 2), (3, 4)])
def test_graph_replay_of_a_padded_batch_equals_eager(batch: int, max_batch: int) -> None:
    target, head = tiny_models("cuda")
    assert failures(phase_parity(target, head, TINY_TREE, GraphMode.GRAPHS, batch=batch,
                                 max_batch=max_batch)) == []


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
    assert engines[1].scheduler.phases.mode is GraphMode.GRAPHS
    assert failures(engine_parity(engines, "tiny", list(range(3, 40)), TINY_TREE, 60)) == []
    prompts = [list(range(3 + i, 40)) for i in range(2)]  # B = 4: two prompts, EAGLE and plain
    assert failures(batch_parity(engines, "tiny", prompts, TINY_TREE, 60)) == []
    runners = engines[1].scheduler.phases.runners
    assert {key[-1] for key in runners} >= {1, 2} and all(runners.values())  # captured buckets


def test_auto_dtype_is_fp16_on_a_gpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A T4 or V100 (compute capability below 8.0) has fp16 tensor cores and no bf16 ones."""
    from eagle_engine import hardware
    from eagle_engine.config import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "cuda_capability", lambda device: (7, 5))
    assert resolve_dtype("auto", "cuda") == "fp16" and resolve_dtype("bf16", "cuda") == "bf16"
    monkeypatch.setattr(hardware, "cuda_capability", lambda device: (9, 0))
    assert resolve_dtype("auto", "cuda:0") == "bf16"
