"""Inputs for checking the kernels against their references: edge cases (single node, chain,
star, full binary tree, depth truncation; nothing / everything accepted; identity, reversed and
overlapping compactions; pool attention at ragged lengths and at the pool's edge) plus seeded
random trees, and one function that runs any kernel implementation on them. Shared by tests/test_kernels.py (Triton interpreter on CPU) and
`selfcheck` (the real kernels on CUDA). Not here: the kernels or the references themselves.
"""
from __future__ import annotations

import json
from types import ModuleType, SimpleNamespace

import torch

from . import reference


def tree_cases(seed: int = 0) -> list[tuple[str, torch.Tensor, int]]:
    """(name, parents [N], max_depth): edge cases plus random trees (parent < child)."""
    g = torch.Generator().manual_seed(seed)
    cases = [("single node", torch.tensor([-1]), 3), ("chain", torch.arange(-1, 7), 7),
             ("star", torch.tensor([-1] + [0] * 9), 1),
             ("full binary tree", (torch.arange(15) - 1).div(2, rounding_mode="floor"), 3),
             ("chain deeper than max_depth", torch.arange(-1, 9), 4),
             ("fewer nodes than max_depth", torch.tensor([-1, 0, 0]), 6)]
    for i in range(12):
        n = int(torch.randint(2, 70, (), generator=g))
        parents = [-1] + [int(torch.randint(max(0, j - 9), j, (), generator=g))
                          for j in range(1, n)]
        depth = reference.build_tree_from_parents(torch.tensor(parents), n)[0]
        cases.append((f"random N={n}", torch.tensor(parents), int(depth.max()) + i % 3))
    return cases


def verify_cases(seed: int = 0) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """(name, (tokens, parents, ancestors, depth, predict)) incl. nothing / everything accepted."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, parents, _ in tree_cases(seed):
        n = parents.numel()
        depth, ancestors, retrieve = reference.build_tree_from_parents(parents, n)
        tokens = torch.randint(0, 3, (n,), generator=g)  # few ids: many matches, many ties
        predict = torch.randint(0, 3, (n,), generator=g)
        nothing = torch.full((n,), 7)  # 7 is never a token: only the root is accepted
        everything = predict.clone()  # the deepest node's whole path agrees with the target
        path = retrieve[int(depth.argmax())]
        path = path[path >= 0]
        everything[path[:-1]] = tokens[path[1:]]
        for kind, pred in (("random", predict), ("nothing accepted", nothing),
                           ("everything accepted", everything)):
            out.append((f"{name}, {kind}", (tokens, parents, ancestors, depth, pred)))
    return out


def compact_cases(seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, cache [B, H, L, d], src_rows [n], dst_start)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"accepted path": [20, 21, 24, 30], "nothing accepted (root only)": [20],
            "everything accepted (identity)": list(range(20, 27)), "reversed": [26, 23, 20],
            "overlapping shift": [21, 22, 23, 24], "unsorted": [33, 20, 27, 22, 31]}
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, src in rows.items():
            cache = torch.randn(1, 3, 40, 24, generator=g).to(dtype)
            out.append((f"{name} {dtype}", cache, torch.tensor(src), 20))
    return out


ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the Triton interpreter's tl.dot multiplies bf16 operands as their raw bits (2.6e10 off for a
# 16x16 product of unit values): under it the attention is checked in fp32 and fp16 only, and
# in bf16 on the device (`selfcheck`, tests marked cuda)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def pool_cases(seed: int = 0, dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
               ) -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """(name, (q [B, H, T, d], k, v [rows, KVH, L, d] layers of a pool, slots [B], seq_len [B],
    block [B, T, W])): ragged committed lengths (0, across key tiles of 64), trees, causal and
    lone rows, grouped and ungrouped heads, a row ending at the pool's edge, three dtypes."""
    g = torch.Generator().manual_seed(seed)
    shapes = [  # name, H, KVH, T, W, L, seq_lens, d
        ("ragged trees", 6, 2, 5, 5, 160, [0, 37, 64, 130], 32),
        ("decode rows", 4, 4, 1, 1, 96, [1, 63, 65], 16),
        ("extend, causal", 9, 3, 4, 4, 80, [12, 50], 64),
        ("at the pool's edge", 6, 3, 3, 3, 70, [67, 5], 24)]
    out = []
    for dtype in dtypes:
        for name, H, KVH, T, W, L, seqs, d in shapes:
            B = len(seqs)
            data = torch.randn(B + 2, 4, KVH, L, d, generator=g).to(dtype)  # [rows, (layer, k|v)]
            k, v = data[:, 2], data[:, 3]  # one layer's views, strided as a pool's
            q = torch.randn(B, H, T, d, generator=g).to(dtype)
            slots = torch.randperm(B + 2, generator=g)[:B]
            if "causal" in name:
                block = torch.ones(T, W, dtype=torch.bool).tril().expand(B, T, W).clone()
            else:
                parents = [-1] + [int(torch.randint(0, j, (), generator=g)) for j in range(1, T)]
                block = reference.build_tree_from_parents(torch.tensor(parents), T)[1]
                block = block[:, :W].expand(B, T, W).clone()
            out.append((f"{name} {dtype}", (q, k, v, slots, torch.tensor(seqs), block)))
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to float rounding: fp32 to 1e-5 of the largest value, bf16 / fp16 to 2e-2."""
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    scale = want.float().abs().max().clamp_min(1e-6)
    return got.shape == want.shape and bool(
        (got.cpu().float() - want.float()).abs().max() <= tol * scale)


def same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    return len(got) == len(want) and all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


def kernel_mismatches(impl: ModuleType | SimpleNamespace, device: torch.device | str,
                      pool_dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
                      ) -> dict[str, tuple[int, list[str]]]:
    """Run `impl`'s four functions on `device` against the references on CPU (bit-exact, the
    attention to rounding: `close`).
    -> {kernel: (number of cases, failing case names, with the error if one was raised)}."""
    out: dict[str, tuple[int, list[str]]] = {}
    for kernel, cases in (("tree_build", tree_cases()), ("verify_greedy", verify_cases()),
                          ("kv_compact", compact_cases()),
                          ("pool_attention", pool_cases(dtypes=pool_dtypes))):
        failures = []
        for name, *args in cases:
            try:
                ok = check_case(impl, kernel, args, device)
            except Exception as e:  # noqa: BLE001 - report which case broke and how
                failures.append(f"{name}: {e!r}"[:300])
                continue
            if not ok:
                failures.append(name)
        out[kernel] = (len(cases), failures)
    return out


def check_case(impl: ModuleType | SimpleNamespace, kernel: str, args: list,
               device: torch.device | str) -> bool:
    if kernel == "tree_build":
        parents, max_depth = args
        return same(impl.build_tree_from_parents(parents.to(device), max_depth),
                    reference.build_tree_from_parents(parents, max_depth))
    if kernel == "verify_greedy":
        (tensors,) = args
        return same(impl.verify_tree_greedy(*(t.to(device) for t in tensors)),
                    reference.verify_tree_greedy(*tensors))
    if kernel == "pool_attention":
        (tensors,) = args
        return close(impl.pool_attention(*(t.to(device) for t in tensors)),
                     reference.pool_attention(*tensors))
    cache, src, dst = args
    got, want = cache.to(device), cache.clone()
    impl.compact_kv(got, src.to(device), dst)
    reference.compact_kv(want, src, dst)
    return same((got,), (want,))


def triton_kernels() -> SimpleNamespace:
    """Every Triton kernel of the package by its reference's name (imports triton)."""
    from . import kv_compact, pool_attention, tree_build, verify_greedy

    return SimpleNamespace(build_tree_from_parents=tree_build.build_tree_from_parents,
                           verify_tree_greedy=verify_greedy.verify_tree_greedy,
                           compact_kv=kv_compact.compact_kv,
                           pool_attention=pool_attention.pool_attention)


def main() -> None:
    """`TRITON_INTERPRET=1 python -m eagle_engine.kernels.checks`: the Triton kernels through
    the interpreter on CPU, printed as one JSON line (tests/test_kernels.py runs this in a
    subprocess: the flag must be set before triton is first imported)."""
    from . import kv_compact, pool_attention, tree_build, verify_greedy

    jitted = (tree_build._tree_build_kernel, verify_greedy._verify_greedy_kernel,
              kv_compact._kv_compact_kernel, pool_attention._pool_attention_kernel)
    print(json.dumps({"kernel_types": [type(k).__name__ for k in jitted],
                      "results": kernel_mismatches(triton_kernels(), "cpu",
                                                   INTERPRETER_DTYPES)}))


if __name__ == "__main__":
    main()
