"""Every phase a CUDA graph captures is capture-safe by construction, checked on a CPU.

Each runner `GraphPhases.warm_up` makes (every bucket of plain decoding and of the default
trees) runs its phase on the meta device, where no value exists, under `CaptureGuard`, which
refuses by name every op that reads a value on the host or shapes its output by values; a
host copy that dispatches no op (`.tolist()`) fails on the meta device itself. The last tests
show that the check fails when such an op is added to a phase.
"""
from __future__ import annotations

import pytest
import torch

import eagle_engine.draft as draft_mod
import eagle_engine.verify as verify_mod
from eagle_engine.capture_guard import CaptureGuard, CaptureUnsafe
from eagle_engine.config import Q4_TREE, TreeParams
from eagle_engine.cuda_graph import GraphMode, GraphPhases, GraphRunner, buckets
from eagle_engine.tools.parity import EAGLE31, TINY_TREE, tiny_models

DEFAULT_TREES = [TreeParams(), Q4_TREE, TINY_TREE]


def meta_runners(tree: TreeParams, max_batch: int = 4, recipe: dict | None = None
                 ) -> list[GraphRunner]:
    target, head = (m.to("meta") for m in tiny_models("cpu", recipe=recipe))
    backend = GraphPhases(target, {"head": head}, target.max_len - 32, max_batch,
                          GraphMode.STATIC)
    return backend.warm_up({"head": tree})


@pytest.mark.parametrize("recipe", [None, EAGLE31], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("tree", DEFAULT_TREES, ids=lambda t: t.spec())
def test_every_static_phase_runs_on_meta_under_the_guard(tree: TreeParams,
                                                         recipe: dict | None) -> None:
    runners = meta_runners(tree, recipe=recipe)
    kinds = {(type(r).__name__, r.buffers.batch) for r in runners}
    phases = {"DecodeRunner", "VerifyRunner", "ExtendRunner"} | (
        set() if tree.step_cut else {"DraftRunner"})  # a step cut drafts on the host's word
    assert kinds == {(p, b) for p in phases for b in buckets(4)}
    for runner in runners:
        with CaptureGuard():
            out = runner.forward()
        assert out is not None


def test_the_guard_names_a_host_read_added_to_the_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    real = draft_mod.top_children

    def with_item(logits, K, target_ids):  # noqa: ANN001, ANN202
        float(logits.max())  # a host read inside the phase
        return real(logits, K, target_ids)
    monkeypatch.setattr(draft_mod, "top_children", with_item)
    draft = next(r for r in meta_runners(TINY_TREE) if type(r).__name__ == "DraftRunner")
    with pytest.raises(CaptureUnsafe, match="reads a value on the host"), CaptureGuard():
        draft.forward()


@pytest.mark.parametrize("op", ["nonzero", "masked_select", "tolist"])
def test_a_data_dependent_op_added_to_the_verify_fails(monkeypatch: pytest.MonkeyPatch,
                                                       op: str) -> None:
    real = verify_mod.verify_forward

    def with_op(target, rows, tokens, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if op == "nonzero":
            tokens.nonzero()
        elif op == "masked_select":
            tokens.masked_select(tokens > 0)
        else:
            tokens.tolist()
        return real(target, rows, tokens, *args, **kwargs)
    runner = next(r for r in meta_runners(TINY_TREE) if type(r).__name__ == "VerifyRunner")
    monkeypatch.setattr("eagle_engine.cuda_graph.verify_forward", with_op)
    with pytest.raises((CaptureUnsafe, NotImplementedError)), CaptureGuard():
        runner.forward()


def test_the_guard_lets_static_ops_pass() -> None:
    t = torch.arange(6.0).view(2, 3)
    with CaptureGuard():
        t.repeat_interleave(2, dim=-1)
        torch.where(t > 2, t, 0.0).topk(2)
        t[:, torch.tensor([0, 2])]


def graphs_backend(monkeypatch: pytest.MonkeyPatch, max_batch: int = 4) -> GraphPhases:
    """A GRAPHS backend on the CPU whose CUDA calls are stubbed: capture runs each phase once
    under the guard, then `GraphRunner.capture` (made to fail by the tests that need it)."""
    import torch.cuda

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    target, head = tiny_models("cpu")
    return GraphPhases(target, {"head": head}, target.max_len - 32, max_batch, GraphMode.GRAPHS)


def test_a_failed_capture_stops_warm_up_naming_the_phase_and_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle_engine.cuda_graph import GraphCaptureError

    backend = graphs_backend(monkeypatch)

    def fails(self, mempool, stream):  # noqa: ANN001, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(GraphRunner, "capture", fails)
    with pytest.raises(GraphCaptureError, match=r"decode phase .* bucket 1.*not permitted.*"
                                                r"--no-cuda-graphs"):
        backend.warm_up({"head": TINY_TREE})


def test_a_host_read_in_a_phase_stops_capture_naming_the_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle_engine.cuda_graph import GraphCaptureError

    backend = graphs_backend(monkeypatch)
    monkeypatch.setattr(GraphRunner, "capture", lambda self, mempool, stream: None)
    real = draft_mod.top_children

    def with_item(logits, K, target_ids):  # noqa: ANN001, ANN202
        logits.max().item()
        return real(logits, K, target_ids)
    monkeypatch.setattr(draft_mod, "top_children", with_item)
    with pytest.raises(GraphCaptureError, match=r"draft phase .*aten\.item.*host"):
        backend.warm_up({"head": TINY_TREE})


def test_runners_are_bounded_and_warm_ups_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `MAX_GRAPHS` the least recently used runner that no warm-up made is released."""
    import eagle_engine.cuda_graph as cuda_graph

    target, head = tiny_models("cpu")
    backend = GraphPhases(target, {"head": head}, target.max_len - 32, 2, GraphMode.STATIC)
    pinned = backend.warm_up({"head": TINY_TREE})
    monkeypatch.setattr(cuda_graph, "MAX_GRAPHS", len(pinned) + 3)
    made = []
    for n in range(4, 12):  # a slider's trees: a verify runner each
        key, make = backend._verify_runner((2, 4, 5), TreeParams(4, 3, n), 1)
        made.append(key)
        backend._runner(key, make)
    assert len(backend.runners) == len(pinned) + 3
    assert all(r in backend.runners.values() for r in pinned)
    assert set(made[-3:]) <= set(backend.runners) and made[0] not in backend.runners
