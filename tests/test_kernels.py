"""Each Triton kernel against its pure-torch reference, bit for bit.

On CPU the kernels run through the Triton interpreter in a subprocess started with
TRITON_INTERPRET=1: triton reads the flag when it is first imported and when a kernel is
decorated, so it cannot be switched on inside a pytest process that may have imported triton
already (and must not leak into the real-kernel tests). The subprocess runs every case of
`kernels/checks.py` (random trees and the edge cases: chain, star, full tree, nothing and
everything accepted, identity / reversed / overlapping compaction) and reports per case; the
tests below assert case by case. The device tests are marked `cuda` (skipped without it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle_engine import kernels
from eagle_engine.kernels import reference
from eagle_engine.kernels.checks import (
    INTERPRETER_DTYPES,
    compact_cases,
    kernel_mismatches,
    pool_cases,
    tree_cases,
    triton_kernels,
    verify_cases,
)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("torch_single_thread")
CASES = ([("tree_build", c[0]) for c in tree_cases()]
         + [("verify_greedy", c[0]) for c in verify_cases()]
         + [("kv_compact", c[0]) for c in compact_cases()]
         + [("pool_attention", c[0]) for c in pool_cases(dtypes=INTERPRETER_DTYPES)])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """{"kernel_types": [...], "results": {kernel: [cases, failures]}} from the interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "eagle_engine.kernels.checks"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_really_run_in_the_interpreter(interpreted: dict) -> None:
    assert interpreted["kernel_types"] == ["InterpretedFunction"] * 4
    assert {k: v[0] for k, v in interpreted["results"].items()} == {
        "tree_build": len(tree_cases()), "verify_greedy": len(verify_cases()),
        "kv_compact": len(compact_cases()),
        "pool_attention": len(pool_cases(dtypes=INTERPRETER_DTYPES))}


@pytest.mark.parametrize("kernel, case", CASES, ids=[f"{k}: {c}" for k, c in CASES])
def test_kernel_matches_reference(interpreted: dict, kernel: str, case: str) -> None:
    failures = interpreted["results"][kernel][1]
    assert not [f for f in failures if f == case or f.startswith(f"{case}: ")]


def test_edge_cases_mean_what_they_say() -> None:
    """The named verify cases accept what their names claim (so the kernel tests cover them)."""
    for name, args in verify_cases():
        best, length = reference.verify_tree_greedy(*args)
        if name.endswith("nothing accepted"):
            assert (int(best), int(length)) == (0, 0), name
        if name.endswith("everything accepted"):
            assert int(length) == int(args[3].max()), name
    chain = {c[0]: c for c in tree_cases()}["chain"]
    depth, _, retrieve = reference.build_tree_from_parents(chain[1], chain[2])
    assert depth.tolist() == list(range(8)) and retrieve[-1].tolist() == list(range(8))


def test_checks_catch_a_wrong_kernel() -> None:
    """The harness the interpreter run relies on reports a kernel that is off by one."""
    def wrong_tree(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, ...]:
        depth, ancestors, retrieve = reference.build_tree_from_parents(parents, max_depth)
        return depth + 1, ancestors, retrieve

    def wrong_attention(q, k, v, slots, seq_len, block):  # noqa: ANN001, ANN202
        return reference.pool_attention(q, k, v, slots, seq_len + 1, block)  # one row too many

    impl = SimpleNamespace(build_tree_from_parents=wrong_tree, compact_kv=reference.compact_kv,
                           verify_tree_greedy=reference.verify_tree_greedy,
                           pool_attention=wrong_attention)
    results = kernel_mismatches(impl, "cpu")
    assert len(results["tree_build"][1]) == len(tree_cases())
    assert len(results["pool_attention"][1]) == len(pool_cases())
    assert results["verify_greedy"][1] == [] and results["kv_compact"][1] == []


def test_wrappers_refuse_bad_inputs() -> None:
    pytest.importorskip("triton")
    from eagle_engine.kernels import kv_compact, tree_build, verify_greedy

    with pytest.raises(AssertionError):  # int32 parents
        tree_build.build_tree_from_parents(torch.tensor([-1, 0], dtype=torch.int32), 1)
    tokens = torch.zeros(3, dtype=torch.long)
    with pytest.raises(AssertionError):  # ancestors of the wrong size
        verify_greedy.verify_tree_greedy(tokens, tokens, torch.ones(2, 2, dtype=torch.bool),
                                         tokens, tokens)
    with pytest.raises(AssertionError):  # rows past the end of the cache
        kv_compact.compact_kv(torch.zeros(1, 1, 8, 4), torch.tensor([6, 7]), 7)


def test_backends_by_device() -> None:
    assert kernels.step_ops(torch.device("cpu"), cpp=False) is kernels.TORCH
    assert kernels.step_ops(torch.device("meta"), cpp=True) is kernels.TORCH
    parents = torch.tensor([-1, 0, 0, 1])
    got = kernels.TORCH.build_tree_from_parents(parents, 2)
    want = reference.build_tree_from_parents(parents, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
def test_kernels_on_the_device_match_reference() -> None:
    assert kernels.step_ops(torch.device("cuda"), cpp=False) is kernels.TRITON
    results = kernel_mismatches(triton_kernels(), "cuda")
    assert {name: failures for name, (_, failures) in results.items()} == {
        "tree_build": [], "verify_greedy": [], "kv_compact": [], "pool_attention": []}
