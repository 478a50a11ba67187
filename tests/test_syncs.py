"""Issue 25, part 3: host syncs per EAGLE-3 iteration.

`sync_count.HostSyncs` counts what would make a GPU's host wait (scalar reads, `torch.equal`,
`.tolist()`, uploads of Python data, data-dependent shapes); it must see each of them, and not
plain device ops. With it, every iteration of the engine on CPU (greedy, sampled, traced or not)
makes exactly one host sync, the packed copy of `accept.readback_parts` (with drafts from the
context too), and a baseline step one (its token). On CUDA the same is checked with
`torch.cuda.set_sync_debug_mode` (marked `cuda`).
"""
from __future__ import annotations

import pytest
import torch

from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.tools.parity import TINY_TREE, IdTokenizer, tiny_models
from eagle_engine.tools.sync_count import HostSyncs, per_step, sync_kind
from tests.helpers import tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPT = [1, 28, 82, 80, 60, 38, 28, 32, 69, 20, 60, 52]
NEW = 20
PARAMS = {"greedy": SamplingParams(max_new_tokens=NEW),
          "sampled": SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=40, top_p=0.9,
                                    seed=3)}


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference"])
def test_counter_sees_each_kind_of_host_sync(inference: bool) -> None:
    """Each host sync counts once (in and out of inference mode, where scalar reads dispatch
    differently); ops that stay on the device count nothing."""
    with torch.inference_mode(inference):
        t, z = torch.arange(6), torch.tensor(2)
        cases = {"item": (lambda: z.item(), "scalar read"),
                 "int": (lambda: int(z), "scalar read"),
                 "bool": (lambda: bool(z > 1), "scalar read"),
                 "slice bound": (lambda: t[:z], "scalar read"),
                 "equal": (lambda: torch.equal(t, t), "torch.equal"),
                 "tolist": (lambda: t.tolist(), "tolist"),
                 "upload": (lambda: torch.tensor([1, 2]), "upload"),
                 "boolean index": (lambda: t[t > 2], "data-dependent shape"),
                 "nonzero": (lambda: t.nonzero(), "data-dependent shape")}
        for name, (fn, kind) in cases.items():
            with HostSyncs() as syncs:
                fn()
            assert dict(syncs.kinds) == {kind: 1}, name
            assert list(syncs.where) == [f"{kind} at ?"]  # called from outside the package
        with HostSyncs() as syncs:
            i = t.index_select(0, z.view(1))
            torch.where(t > 2, t, -1).roll(1)[i.clamp_min(0)].cumsum(0)
            torch.as_tensor(t)  # already a tensor: nothing uploaded
        assert syncs.total == 0, syncs.kinds


def test_copies_to_the_host_count_and_copies_elsewhere_do_not() -> None:
    """Without a GPU, the classification of device copies on its own (meta tensors stand in)."""
    aten, meta = torch.ops.aten, torch.empty(3, device="meta")
    cpu = torch.device("cpu")
    assert sync_kind(aten._to_copy.default, (meta,), {"device": cpu}) == "copy to host"
    assert sync_kind(aten.copy_.default, (torch.empty(3), meta), {}) == "copy to host"
    assert sync_kind(aten._to_copy.default, (torch.empty(3),), {"device": "meta"}) is None
    assert sync_kind(aten._to_copy.default, (meta,), {"dtype": torch.float64}) is None
    assert sync_kind(aten.copy_.default, (meta, torch.empty(3)), {}) is None  # an upload


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EagleEngine:
    return tiny_engine(tmp_path_factory.mktemp("syncs"), weight_scale=1.0)


@pytest.mark.parametrize("trace", [False, True], ids=["plain", "traced"])
@pytest.mark.parametrize("mode", sorted(PARAMS))
@pytest.mark.parametrize("shape", [(2, 3, 6), (1, 4, 5), (4, 2, 9)],
                         ids=["k2s3n6", "chain", "k4s2n9"])
def test_eagle_iteration_syncs_once(engine: EagleEngine, mode: str, trace: bool,
                                    shape: tuple[int, int, int]) -> None:
    """Counted per iteration (per event of `stream`): exactly one host sync, the read-back's
    copy."""
    events = engine.stream(PROMPT, PARAMS[mode], TreeParams(*shape), "head", trace=trace)
    steps = list(per_step(events))
    assert steps[0][0].step == 0 and len(steps) > 3  # the prefill's event, then iterations
    assert sum(len(ev.tokens) for ev, _ in steps) == NEW
    for ev, syncs in steps[1:]:
        assert syncs.kinds == {"tolist": 1}, (ev.step, syncs.where)
        assert next(iter(syncs.where)).startswith("tolist at scheduler.py:")  # the step's read
        assert bool(ev.tree) == trace and ev.tokens


@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_context_drafts_add_no_sync(engine: EagleEngine, mode: str) -> None:
    """With drafts from the context on a repetitive prompt (chains proposed, merged and
    accepted), still one host sync per iteration: the suffix match runs over tokens the host
    already has, and its chain reaches the device as fills, not an upload."""
    repeat = [1] + [10, 11, 12, 13, 14, 15, 16, 17] * 4
    tree = TreeParams(2, 3, 6, context_drafts=True)
    events = engine.stream(repeat, PARAMS[mode], tree, "head", trace=True)
    steps = list(per_step(events))
    for ev, syncs in steps[1:]:
        assert syncs.kinds == {"tolist": 1}, (ev.step, syncs.where)
    assert any(node.source == "context" for ev, _ in steps for node in ev.tree)
    if mode == "greedy":  # the tiny target's sampled text does not repeat the prompt
        assert steps[-1][0].stats["context_tokens"] > 0


def test_baseline_step_syncs_once(engine: EagleEngine) -> None:
    for params in PARAMS.values():
        steps = list(per_step(engine.stream(PROMPT, params)))
        assert len(steps) == NEW
        assert all(syncs.kinds == {"tolist": 1} for _, syncs in steps[1:])


def test_events_from_the_packed_copy_match_the_tree(engine: EagleEngine) -> None:
    """What the events say (emitted tokens, accepted nodes, rejected continuation) is what the
    verified tree holds: the packed copy is unpacked at the right offsets."""
    result = engine.generate(PROMPT, PARAMS["greedy"], TreeParams(2, 3, 6), "head",
                             keep_events=True)
    checked = 0
    for ev in result.events[1:]:
        accepted = [i for i, node in enumerate(ev.tree) if node.accepted]
        assert accepted[0] == 0 and [ev.tree[i].depth for i in accepted] == list(
            range(len(accepted)))
        for a, b in zip(accepted, accepted[1:]):
            assert ev.tree[b].parent == a
        drafts = [ev.tree[i].token_id for i in accepted[1:]]
        emitted = [t.token_id for t in ev.tokens]
        assert emitted[:len(drafts)] == drafts[:len(emitted)]
        if ev.rejected:
            first = next(i for i, n in enumerate(ev.tree) if n.parent == accepted[-1])
            assert ev.rejected[0].token_id == ev.tree[first].token_id
            assert ev.rejected[0].depth == len(accepted)
            checked += 1
    assert checked > 0


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_iteration_syncs_once(graphs: bool) -> None:
    target, head = tiny_models("cuda")
    engine = EagleEngine(target, IdTokenizer(), {"tiny": head},
                         EngineConfig(dtype="fp32", device="cuda", max_len=192,
                                      cuda_graphs=graphs))
    for params in PARAMS.values():
        for name in ("tiny", None):
            engine.generate(list(range(3, 40)), params, TINY_TREE, name)  # capture first
            events = engine.stream(list(range(3, 40)), params, TINY_TREE, name)
            counts = [s.total for _, s in per_step(events, torch.device("cuda"))]
            assert max(counts[1:]) <= 1, (name, counts)
