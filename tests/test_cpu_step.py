"""The CPU engine's per-iteration steps in C++ (`kernels/cpu_step.cpp`) against their torch
references, exactly: the greedy argmax of logits rows (ties, NaN, -inf, every width), greedy
tree acceptance on the kernel cases (nothing, everything and some accepted; many ties), the
tree built from random candidate sets with and without the context's chain, the tree from its
parents and the KV commit (float32, bfloat16, float16; reversed and overlapping rows). The
sampler: its distribution equals the reference's up to float rounding (temperature, top-k,
top-p; peaked and flat rows), its draws equal the reference's for the same coins, and tree
speculative sampling gives the torch acceptance's path and bonus for the same coins. An engine
with q4 weights holds them as its step backend (`kernels.cpp_ops`), every other CPU engine the
references; bad input is refused naming the values.
"""
from __future__ import annotations

import pytest
import torch

from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.io_struct import EagleVerifyInput
from eagle_engine.kernels import TORCH, cpp_ops, cpu_lowbit, reference, step_ops
from eagle_engine.kernels.checks import compact_cases, tree_cases, verify_cases
from eagle_engine.verify import (
    greedy_acceptance,
    sampled_acceptance,
    sampled_acceptance_torch,
)


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
    assert torch.equal(cpp_ops(cpu).argmax_rows(logits[None]),
                       reference.argmax_rows(logits[None]))


def _vin(tokens: torch.Tensor, parents: torch.Tensor) -> EagleVerifyInput:
    n = parents.numel()
    depth, ancestors, retrieve = reference.build_tree_from_parents(parents, n)
    width = int(depth.max()) + 1
    return EagleVerifyInput(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors,
                            retrieve_indices=retrieve[:, :width].contiguous(), seq_len=5,
                            scores=torch.ones(n), sources=torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize("case", range(len(verify_cases())))
def test_greedy_accept_equals_the_torch_acceptance(cpu, case: int) -> None:
    """Logits rows whose first maximum is each case's prediction, with a tie after it and
    small integer values elsewhere (many equal values)."""
    name, (tokens, parents, _, _, predict) = verify_cases()[case]
    g = torch.Generator().manual_seed(case)
    n, V = parents.numel(), 40
    logits = torch.randint(0, 3, (n, V), generator=g).float()
    logits[torch.arange(n), predict] = 5.0
    logits[torch.arange(n), (predict + 1 + torch.arange(n) % 3).clamp_max(V - 1)] = 5.0
    vin = _vin(tokens, parents)
    got = greedy_acceptance(vin, logits, cpp_ops(cpu))
    want = greedy_acceptance(vin, logits, TORCH)
    for field in ("accepted_nodes", "num_accepted", "emitted"):
        assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)


SAMPLERS = [(1.0, 0, 1.0), (0.7, 0, 0.95), (0.3, 50, 0.9), (1.5, 3, 1.0), (0.7, 0, 0.05),
            (1.0, 0, 0.999), (1.2, 40, 0.8)]  # (temperature, top_k, top_p)


@pytest.mark.parametrize("V", [5, 33, 1000, 49152])
def test_sampling_probs_equal_the_reference(cpu, V: int) -> None:
    """Peaked rows (a few tokens far above a normal spread, as a language model's) and flat
    ones (every token within a factor of ~3: the nucleus lowers its floor), -inf logits and
    tied values at the top-k boundary (without top-p: which of several tied tokens a nucleus
    keeps is torch.topk's order, unspecified, where the kernel takes the lowest index)."""
    g = torch.Generator().manual_seed(V)
    peaked = torch.randn(3, V, generator=g) * 2.5
    peaked[:, :min(V, 20)] += 8
    flat = torch.randn(2, V, generator=g) * 0.3
    masked = torch.randn(1, V, generator=g)
    masked[0, ::2] = -float("inf")
    ties = torch.randint(0, 4, (1, V), generator=g).float()
    logits = torch.cat([peaked, flat, masked, ties])  # [7, V]
    for temperature, top_k, top_p in SAMPLERS:
        rows = logits if top_p == 1 else logits[:-1]  # no ties under top-p
        got = cpu.sampling_probs(rows, temperature, top_k, top_p)
        want = reference.sampling_probs(rows, temperature, top_k, top_p)
        config = (temperature, top_k, top_p)
        torch.testing.assert_close(got.sum(-1), torch.ones(len(rows)), rtol=0, atol=1e-5)
        if top_p == 1:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{config}")
            continue
        # torch's softmax sums in float32, the kernel in double: the reference's probabilities
        # are off by a common factor 1 - delta (delta up to 2.3e-5 of the mass on an AVX2 EPYC,
        # where a fixed 5e-6 failed), so tokens whose predecessors hold top_p within
        # top_p * delta (plus rounding) may be kept by one and not the other
        full = reference.sampling_probs(rows, temperature, top_k, 1.0)
        for g_row, w_row, p_row in zip(got, want, full):
            kept_g, kept_w = g_row > 0, w_row > 0
            v, order = p_row.double().sort(descending=True)
            before = torch.empty_like(v).scatter_(0, order, v.cumsum(0) - v)  # mass before each
            tol = 5e-6 + top_p * abs(float(v.sum()) - 1)
            assert bool(((before[kept_g ^ kept_w] - top_p).abs() < tol).all()), config
            both = kept_g & kept_w
            torch.testing.assert_close(g_row[both] / g_row[both].sum(),
                                       w_row[both] / w_row[both].sum(), rtol=1e-5, atol=1e-7,
                                       msg=f"{config}")
    assert torch.equal(cpp_ops(cpu).sampling_probs(logits, 0.7, 0, 0.9),
                       cpu.sampling_probs(logits, 0.7, 0, 0.9))


def test_sample_rows_equal_the_reference_draws(cpu) -> None:
    """The same coins give the same tokens: sparse and dense rows, unnormalized ones, a zero
    tail a coin can land on, and coins at 0 and just below 1."""
    g = torch.Generator().manual_seed(0)
    V = 1000
    dense = torch.softmax(torch.randn(4, V, generator=g), -1)
    sparse = reference.sampling_probs(torch.randn(4, V, generator=g) * 3, 0.7, 0, 0.9)
    scaled = dense[:2] * 7.5
    tail = torch.zeros(2, V)
    tail[:, :3] = torch.tensor([0.5, 0.25, 0.25])  # coins past 1 - 2^-24 land in the zeros
    probs = torch.cat([dense, sparse, scaled, tail])  # [12, V]
    for _ in range(50):
        coins = torch.rand(len(probs), generator=g)
        assert torch.equal(cpu.sample_rows(probs, coins), reference.sample_rows(probs, coins))
    edges = torch.tensor([0.0, 0.99999994] * 6)
    assert torch.equal(cpu.sample_rows(probs, edges), reference.sample_rows(probs, edges))


@pytest.mark.parametrize("case", range(len(verify_cases())))
def test_sampled_accept_equals_the_torch_acceptance(cpu, case: int) -> None:
    """The kernel cases' trees with distinct tokens (siblings never repeat one in a drafted
    tree), each draft made likely under its parent's row, three samplers, 20 coin seeds: the
    same accepted path, count and bonus as the torch acceptance (whose distribution is the
    kernel's too: `target_probs` dispatches to it)."""
    name, (_, parents, _, _, _) = verify_cases()[case]
    n, V = parents.numel(), 128
    g = torch.Generator().manual_seed(case)
    tokens = torch.randperm(V, generator=g)[:n]
    vin = _vin(tokens, parents)
    depths = set()
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
                   SamplingParams(temperature=1.2, top_p=0.8)):
        for seed in range(20):
            logits = torch.randn(n, V, generator=g) * 2
            logits[parents[1:], tokens[1:]] += 4
            got = sampled_acceptance(vin, logits, params, torch.Generator().manual_seed(seed),
                                     cpp_ops(cpu))
            want = sampled_acceptance_torch(vin, logits, params,
                                            torch.Generator().manual_seed(seed))
            for field in ("accepted_nodes", "num_accepted", "emitted"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)
            depths.add(int(got.num_accepted))
    assert len(depths) >= 2 or n == 1, (name, depths)  # rejections and acceptances both


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


def test_the_backend_is_the_engines_choice_not_the_process(cpu) -> None:
    """q4 engines hold the C++ ops; a dense CPU engine the definitions, also in a process that
    built the C++ module (an engine loaded earlier does not change a later one's ops)."""
    assert step_ops(torch.device("cpu"), cpp=True).cpp is cpu
    assert step_ops(torch.device("cpu"), cpp=False) is TORCH
    from eagle_engine.engine import EagleEngine
    from eagle_engine.tools.parity import IdTokenizer, tiny_models

    target, _ = tiny_models("cpu")
    engine = EagleEngine(target, IdTokenizer(), {}, EngineConfig(dtype="fp32", max_len=64,
                                                                 weights="dense"))
    assert engine.ops is TORCH
    parents = torch.tensor([-1, 0, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(
        cpp_ops(cpu).build_tree_from_parents(parents, 3),
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
    with pytest.raises(RuntimeError, match="temperature > 0.*got 0, 0, 1"):
        cpu.sampling_probs(torch.zeros(2, 8), 0.0, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"coins must be contiguous float32 \[2\]"):
        cpu.sample_rows(torch.ones(2, 8), torch.rand(3))
    vin = _vin(tokens, torch.tensor([-1, 0, 1]))
    with pytest.raises(RuntimeError, match=r"coins must be float32 \[2\]"):
        cpu.sampled_accept(torch.zeros(3, 8), tokens, vin.parents, vin.depth, vin.retrieve_indices,
                           torch.rand(1), torch.rand(1), 1.0, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"token 9 of node 1 is outside \[0, 8\)"):
        cpu.sampled_accept(torch.zeros(3, 8), torch.tensor([5, 9, 7]), vin.parents, vin.depth,
                           vin.retrieve_indices, torch.rand(2), torch.rand(1), 1.0, 0, 1.0)


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
    if kind == "along the head" and len(tokens) % 2:  # a tail underflowed to 0, shared too
        scores[1:] = [0.0] * (len(scores) - 1)
    return ContextDraft(tokens, scores, match_len=3)


@pytest.mark.parametrize("seed", range(24))
def test_build_tree_equals_merge_then_build(cpu, seed: int) -> None:
    from eagle_engine.config import TreeParams
    from eagle_engine.tree import tree_input

    g = torch.Generator().manual_seed(seed)
    K, S = [(1, 1), (2, 1), (2, 2), (3, 2), (4, 3), (2, 4)][seed % 6]
    drafted = _candidates(g, K, S, with_sources=seed % 4 == 3)
    ctx = _chain(g, drafted, ["none", "random", "along the head"][seed % 3])
    n = int(torch.randint(2, drafted.tokens.numel() + 2, (), generator=g))  # up to capacity
    # thresholds on the scores' grid of quarters (ties at the cut) and between it
    tree = TreeParams(K, S, n, min_score=[0.0, 0.25, 0.1, 0.5625][seed // 6],
                      context_extra=[0, 2, 5][seed // 3 % 3])
    root = torch.tensor([11])
    got = tree_input(drafted, ctx, root, 7, tree, cpp_ops(cpu))
    assert bool((got.scores[1:] >= tree.min_score).all()) and got.tokens.numel() <= tree.max_rows
    want = tree_input(drafted, ctx, root, 7, tree, TORCH)
    for field in ("tokens", "parents", "depth", "ancestors", "retrieve_indices", "scores",
                  "sources"):
        assert torch.equal(getattr(got, field), getattr(want, field).contiguous()), field
    assert got.seq_len == want.seq_len
