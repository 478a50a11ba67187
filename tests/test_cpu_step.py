"""The CPU engine's per-iteration steps in C++ (`kernels/cpu_step.cpp`) against their torch
references, exactly: the greedy argmax of logits rows (ties, NaN, -inf, every width), greedy
tree acceptance on the kernel cases (nothing, everything and some accepted; many ties), the
tree built from random candidate sets with and without the context's chain, the tree from its
parents and the KV commit (float32, bfloat16, float16; reversed and overlapping rows). The engine uses them once the q4 weights have built the module (and the references
otherwise); bad input is refused naming the values.
"""
from __future__ import annotations

import pytest
import torch

from eagle_engine import kernels
from eagle_engine.io_struct import EagleVerifyInput
from eagle_engine.kernels import cpu_lowbit, reference
from eagle_engine.kernels.checks import compact_cases, tree_cases, verify_cases
from eagle_engine.verify import greedy_acceptance, greedy_acceptance_torch


@pytest.fixture(scope="module")
def cpu():
    return cpu_lowbit.load()


@pytest.mark.parametrize("V", [1, 7, 31, 32, 33, 100, 49152])
def test_argmax_rows_equals_torch_max(cpu, V: int) -> None:
    g = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=g), torch.randint(0, 3, (V,), generator=g).float(),
            torch.full((V,), -float("inf")), torch.zeros(V)]
    nan = torch.randn(V, generator=g)
    nan[V // 2] = float("nan")
    nan[-1] = float("nan")
    late = torch.randn(V, generator=g)
    late[-1] = 1e30  # the maximum in the scalar tail
    rows += [nan, late]
    logits = torch.stack(rows)  # [6, V]
    assert torch.equal(cpu.argmax_rows(logits), reference.argmax_rows(logits))
    assert torch.equal(kernels.argmax_rows(logits[None]), reference.argmax_rows(logits[None]))


def _vin(tokens: torch.Tensor, parents: torch.Tensor) -> EagleVerifyInput:
    n = parents.numel()
    depth, ancestors, retrieve = reference.build_tree_from_parents(parents, n)
    width = int(depth.max()) + 1
    return EagleVerifyInput(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors,
                            retrieve_indices=retrieve[:, :width].contiguous(), seq_len=5,
                            scores=torch.ones(n), sources=torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize("case", range(len(verify_cases())))
def test_greedy_accept_equals_the_torch_acceptance(cpu, monkeypatch: pytest.MonkeyPatch,
                                                   case: int) -> None:
    """Logits rows whose first maximum is each case's prediction, with a tie after it and
    small integer values elsewhere (many equal values)."""
    name, (tokens, parents, _, _, predict) = verify_cases()[case]
    g = torch.Generator().manual_seed(case)
    n, V = parents.numel(), 40
    logits = torch.randint(0, 3, (n, V), generator=g).float()
    logits[torch.arange(n), predict] = 5.0
    logits[torch.arange(n), (predict + 1 + torch.arange(n) % 3).clamp_max(V - 1)] = 5.0
    vin = _vin(tokens, parents)
    got = greedy_acceptance(vin, logits)
    monkeypatch.setattr(cpu_lowbit, "built", lambda: None)
    want = greedy_acceptance_torch(vin, logits)
    for field in ("accepted_nodes", "num_accepted", "emitted"):
        assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)


@pytest.mark.parametrize("case", range(len(tree_cases())))
def test_tree_from_parents_equals_the_reference(cpu, case: int) -> None:
    name, parents, max_depth = tree_cases()[case]
    got = cpu.tree_from_parents(parents, max_depth)
    want = reference.build_tree_from_parents(parents, max_depth)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), name


@pytest.mark.parametrize("case", range(len(compact_cases())))
def test_compact_rows_equals_the_reference(cpu, case: int) -> None:
    name, cache, src, dst = compact_cases()[case]
    for c in (cache, cache.half()):
        got, want = c.clone(), c.clone()
        cpu.compact_rows(got, src, dst)
        reference.compact_kv(want, src, dst)
        assert torch.equal(got, want), name


def test_the_engine_dispatches_to_them_once_built(cpu) -> None:
    t = torch.zeros(2)
    assert kernels.cpu_step(t) is cpu
    parents = torch.tensor([-1, 0, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(kernels.build_tree_from_parents(parents, 3),
                                                 reference.build_tree_from_parents(parents, 3)))


def test_bad_input_is_refused_naming_it(cpu) -> None:
    with pytest.raises(RuntimeError, match="logits must be contiguous float32"):
        cpu.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    tokens, parents = torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 2])
    vin = _vin(tokens, torch.tensor([-1, 0, 1]))
    with pytest.raises(RuntimeError, match="node 2 has parent 2"):
        cpu.greedy_accept(torch.zeros(3, 8), tokens, parents, vin.depth, vin.retrieve_indices)
    with pytest.raises(RuntimeError, match=r"tokens must be a contiguous int64 \[3\]"):
        cpu.greedy_accept(torch.zeros(3, 8), tokens.int(), vin.parents, vin.depth,
                          vin.retrieve_indices)
    with pytest.raises(RuntimeError, match=r"rows \[7, 9\) past the cache's 8"):
        cpu.compact_rows(torch.zeros(1, 1, 8, 4), torch.tensor([6, 7]), 7)
    with pytest.raises(RuntimeError, match="source row 9 past"):
        cpu.compact_rows(torch.zeros(1, 1, 8, 4), torch.tensor([9]), 2)


def _candidates(g: torch.Generator, K: int, S: int, with_sources: bool):
    """A draft's candidates as `draft` lays them out: K at level 1, K*K below each level's
    frontier, scores the path products (on a grid of quarters: many ties), distinct siblings."""
    from eagle_engine.io_struct import DraftTree

    scores, tokens, parents = [], [], []
    frontier = [(-1, 1.0)]
    for level in range(S):
        nxt = []
        for parent, score in frontier:
            p = sorted((torch.randint(1, 5, (K,), generator=g) / 4).tolist(), reverse=True)
            for tok, pk in zip(torch.randperm(6, generator=g)[:K].tolist(), p):
                scores.append(score * pk)
                tokens.append(tok)
                parents.append(parent)
                nxt.append((len(tokens) - 1, score * pk))
        frontier = sorted(nxt, key=lambda x: -x[1])[:K] if level < S - 1 else []
    sources = torch.randint(0, 3, (len(tokens),), generator=g) if with_sources else None
    return DraftTree(torch.tensor(scores), torch.tensor(tokens), torch.tensor(parents), sources)


def _chain(g: torch.Generator, drafted, kind: str):
    from eagle_engine.io_struct import ContextDraft

    if kind == "none":
        return None
    L = int(torch.randint(1, 6, (), generator=g))
    tokens = torch.randint(0, 6, (L,), generator=g).tolist()
    if kind == "along the head":  # the chain starts down a candidate's root path
        node, path = int(torch.randint(0, drafted.tokens.numel(), (), generator=g)), []
        while node >= 0:
            path.insert(0, int(drafted.tokens[node]))
            node = int(drafted.parents[node])
        tokens = (path + tokens)[:max(L, len(path))]
    scores = sorted(torch.rand(len(tokens), generator=g).tolist(), reverse=True)
    return ContextDraft(tokens, scores, match_len=3)


@pytest.mark.parametrize("seed", range(24))
def test_build_tree_equals_merge_then_build(cpu, monkeypatch: pytest.MonkeyPatch,
                                            seed: int) -> None:
    from eagle_engine.config import TreeParams
    from eagle_engine.tree import tree_input

    g = torch.Generator().manual_seed(seed)
    K, S = [(1, 1), (2, 1), (2, 2), (3, 2), (4, 3), (2, 4)][seed % 6]
    drafted = _candidates(g, K, S, with_sources=seed % 4 == 3)
    ctx = _chain(g, drafted, ["none", "random", "along the head"][seed % 3])
    n = int(torch.randint(2, drafted.tokens.numel() + 2, (), generator=g))  # up to capacity
    # thresholds on the scores' grid of quarters (ties at the cut) and between it
    tree = TreeParams(K, S, n, min_score=[0.0, 0.25, 0.1, 0.5625][seed // 6])
    root = torch.tensor([11])
    got = tree_input(drafted, ctx, root, 7, tree)
    assert bool((got.scores[1:] >= tree.min_score).all())
    monkeypatch.setattr(cpu_lowbit, "built", lambda: None)
    want = tree_input(drafted, ctx, root, 7, tree)
    for field in ("tokens", "parents", "depth", "ancestors", "retrieve_indices", "scores",
                  "sources"):
        assert torch.equal(getattr(got, field), getattr(want, field).contiguous()), field
    assert got.seq_len == want.seq_len
