"""q4 weights on CPU (`kernels/cpu_lowbit.*`, `models/cpu_lowbit.py`, `EngineConfig.weights`).

The kernels equal a float64 product of the dequantized weight and the dequantized int8
activations for 1 to 16 rows and odd shapes, and their packed layout unpacks to the natural
codes; a row computed with others equals that row computed alone, bit for bit. Quantizing a
weight on a Q4_1 grid gives back its codes, scales and minimums; on the bundled target every
decoder linear and the lm_head come back exactly. The fused decoder equals the Python layers
(its reference); an engine with q4 weights keeps greedy speculative output equal to its greedy
baseline, and its caches equal a fresh prefill after every commit; bad input is refused with
the values named. On a CPU with AVX512-VNNI the `vpdpbusd` products give the bits of the AVX2
products (the same kernels built without VNNI). A build lock left by a killed build is removed
at the next start, and a live build is waited for. A product lets other Python threads run
while it computes.
"""
from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from eagle_engine.config import (
    Q4_TREE,
    ConfigError,
    EngineConfig,
    SamplingParams,
    TreeParams,
)
from eagle_engine.hardware import cpu_flags
from eagle_engine.kernels import cpu_lowbit
from eagle_engine.kernels.cpu_lowbit import GROUP
from eagle_engine.kv_cache import KVCache, causal_mask, tree_mask
from eagle_engine.models.cpu_lowbit import LowBitLinear, quantize_q4, quantize_q8
from eagle_engine.models.loader import load_target
from tests.helpers import tiny_engine


def q4_1_weight(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A weight on a Q4_1 grid, as llama.cpp writes it: float16 scales and minimums, and every
    block of 32 inputs holds code 0 (its minimum) and code 15 (its maximum)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f // GROUP, GROUP), generator=g, dtype=torch.int32)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_f, in_f // GROUP, generator=g) * 0.01 + 1e-3).half().float()
    low = (torch.randn(out_f, in_f // GROUP, generator=g) * 0.05).half().float()
    weight = codes * scale[..., None] + low[..., None]
    return weight.view(out_f, in_f), codes.view(out_f, in_f), scale, low


def test_quantize_recovers_a_q4_1_grid() -> None:
    weight, codes, scale, low = q4_1_weight(48, 96, seed=0)
    packed, dm = quantize_q4(weight)
    assert dm.dtype == torch.float16
    torch.testing.assert_close(dm[:, 0].float(), scale, rtol=1e-5, atol=0)
    assert torch.equal(dm[:, 1].float(), low)
    unpacked = torch.cat([packed.view(48, 3, 16) & 15, packed.view(48, 3, 16) >> 4], -1)
    assert torch.equal(unpacked.view(48, 96).int(), codes)
    torch.testing.assert_close(cpu_lowbit.q4_dequantize(packed, dm), weight, rtol=0, atol=2e-7)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("n, k", [(48, 64), (37, 96), (3, 32), (130, 160)])
def test_kernels_equal_the_dequantized_product(kind: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g)
    codes, scales = quantize_q4(weight) if kind == "q4" else quantize_q8(weight)
    packed = getattr(cpu_lowbit, f"pack_{kind}")(codes, scales)
    unpacked = getattr(cpu_lowbit, f"unpack_{kind}")(*packed, n)
    assert all(torch.equal(a, b) for a, b in zip(unpacked, (codes, scales)))
    kernel = getattr(cpu_lowbit.load(), f"{kind}_linear")
    reference = getattr(cpu_lowbit, f"{kind}_linear_reference")
    x = torch.randn(40, k, generator=g)
    x[3, :32] = 0  # a block of zeros (scale 0)
    for m in [*range(1, 17), 31, 32, 40]:
        got = kernel(x[:m].contiguous(), *packed, n)
        torch.testing.assert_close(got, reference(x[:m], codes, scales), rtol=1e-5, atol=1e-5)
    x = x[:16].contiguous()
    together = kernel(x, *packed, n)
    alone = torch.cat([kernel(x[i:i + 1].contiguous(), *packed, n) for i in range(16)])
    assert torch.equal(together, alone)  # a row's bits do not depend on the other rows


def test_products_let_other_threads_run() -> None:
    """A product lets go of Python's lock while it runs: another thread keeps running Python
    code (the web server streams while the engine computes). Held, that thread would stop for
    the whole call."""
    kernel = cpu_lowbit.load().q8_linear
    g = torch.Generator().manual_seed(7)
    packed = cpu_lowbit.pack_q8(*quantize_q8(torch.randn(16384, 576, generator=g)))
    # a call of ~0.1 s on 2 cores with VNNI, ~0.4 s with AVX2 only: well above a scheduler's
    # time slice (with 512 rows a VNNI call took 27 ms, and a slice could fail the test)
    x = torch.randn(2048, 576, generator=g)
    t0 = time.perf_counter()
    kernel(x, *packed, 16384)
    call_s = time.perf_counter() - t0
    done = threading.Event()

    def products() -> None:
        for _ in range(3):
            kernel(x, *packed, 16384)
        done.set()
    worker = threading.Thread(target=products)
    longest, last = 0.0, time.perf_counter()
    worker.start()
    while not done.is_set():  # this thread's longest pause while the products run
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert call_s > 0.02 and longest < call_s / 2, (call_s, longest)


def test_vnni_products_give_the_avx2_bits() -> None:
    """Where the CPU has AVX512-VNNI the kernels use `vpdpbusd`; built without it they take
    the AVX2 path. Both sum the same integers, so every output has the same bits. A CPU without
    VNNI runs the VNNI path with an exact AVX2 `vpdpbusd` (-DLOWBIT_EMULATE_VNNI). With AVX-512
    the VNNI path takes two groups of 8 columns a tile from 8 rows on (17 groups here: pairs
    and a single), every tile height included."""
    if "avx512_vnni" in cpu_flags():
        vnni, avx2 = cpu_lowbit.load(), cpu_lowbit.load(("-mno-avx512vnni",))
    else:
        vnni, avx2 = cpu_lowbit.load(("-DLOWBIT_EMULATE_VNNI",)), cpu_lowbit.load()
    g = torch.Generator().manual_seed(7)
    for kind, n, k in (("q4", 136, 1536), ("q8", 72, 576)):
        weight = torch.randn(n, k, generator=g)
        codes = quantize_q4(weight) if kind == "q4" else quantize_q8(weight)
        packed = getattr(cpu_lowbit, f"pack_{kind}")(*codes)
        x = torch.randn(16, k, generator=g) * 3
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 15, 16):
            got = getattr(vnni, f"{kind}_linear")(x[:m].contiguous(), *packed, n)
            want = getattr(avx2, f"{kind}_linear")(x[:m].contiguous(), *packed, n)
            assert torch.equal(got, want), (kind, m)
        reference = getattr(cpu_lowbit, f"{kind}_linear_reference")
        torch.testing.assert_close(got[:9], reference(x[:9], *codes), rtol=1e-5, atol=1e-5)


def test_kernels_refuse_bad_input_naming_it() -> None:
    codes, scales = cpu_lowbit.pack_q4(*quantize_q4(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        cpu_lowbit.q4_linear(torch.randn(2, 64, dtype=torch.float64), codes, scales, 16)
    with pytest.raises(RuntimeError, match=r"codes must be contiguous \[2, 3, 128\] for 16 "
                       "outputs and 96 inputs"):
        cpu_lowbit.q4_linear(torch.randn(2, 96), codes, scales, 16)
    with pytest.raises(ValueError, match="48x40"):
        LowBitLinear(nn.Linear(40, 48), "q4")
    huge = torch.zeros(8, 32)
    huge[0, 0] = 1e7  # its block's scale, 1e7 / 127, is past float16's 65504
    with pytest.raises(ValueError, match=r"q8 block scales out of float16's range \(1 values, "
                       r"e\.g\. 7\.87e\+04\)"):
        quantize_q8(huge)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        cpu_lowbit.q4_linear(torch.randn(2, 64), codes, scales.float(), 16)
    with pytest.raises(ConfigError, match="CPU path; device is 'cuda'"):
        EngineConfig(device="cuda", weights="q4")
    with pytest.raises(ConfigError, match="dtype 'bf16' needs --weights dense"):
        EngineConfig(weights="q4", dtype="bf16")
    with pytest.raises(ConfigError, match="unknown weights 'int3'"):
        EngineConfig(weights="int3")


def test_fused_decoder_refuses_a_bad_mask_or_norm_before_writing_the_cache(
        tmp_path: Path) -> None:
    """A float mask or a final norm of the wrong width is refused with the shapes named, and
    the cache is as it was (the checks come before any row is written)."""
    target = tiny_engine(tmp_path, weights="q4", hidden_size=64, intermediate_size=96).target
    fused, cache = target.fused, target.new_cache(max_len=16).data
    hd = cache.shape[-1]
    h, cos, sin = torch.randn(3, 64), torch.ones(3, hd), torch.zeros(3, hd)
    good = torch.ones(3, 5, dtype=torch.bool)
    kernels = cpu_lowbit.load()

    def call(mask: torch.Tensor, norm: torch.Tensor) -> None:
        kernels.fused_decoder(h, torch.empty(0), cos, sin, [cache], [2], [3], [mask],
                              fused.weights, fused.heads, fused.kv_heads, fused.eps, [],
                              fused.q8, norm)

    with pytest.raises(RuntimeError, match=r"mask must be contiguous bool \[T, start \+ T\] = "
                       r"\[3, 5\], got Float"):
        call(good.float(), fused.final_norm)
    with pytest.raises(RuntimeError, match=r"final_norm must be contiguous float32 \[64\]"):
        call(good, fused.final_norm[:32])
    assert not cache.any()


def test_auto_weights_are_q4_for_gguf_targets_on_cpu() -> None:
    assert EngineConfig().weights == "q4" and EngineConfig().dtype == "fp32"
    assert EngineConfig(target="some/model.gguf").weights == "q4"
    assert EngineConfig(target="owner/name").weights == "dense"
    assert EngineConfig(dtype="bf16").weights == "dense"  # an explicit dtype asks for dense
    assert EngineConfig(weights="dense").weights_label == EngineConfig(weights="dense").dtype


def test_bundled_target_codes_come_back_exactly(bundled_dir: Path) -> None:
    """The engine's fp32 copy of the Q4_1 GGUF: every decoder linear is on a 4-bit grid and the
    tied lm_head on an 8-bit one, so q4 / q8 codes rebuild the weights."""
    target = load_target(bundled_dir, torch.float32, "cpu", 64)
    linears = [m for m in target.layers.modules() if type(m) is nn.Linear]
    assert len(linears) == 120  # 30 layers x (qkv, o, gate_up, down)
    for lin in linears:
        w = lin.weight.detach()
        torch.testing.assert_close(LowBitLinear(lin, "q4").dequantized(), w, rtol=0, atol=2e-7)
    w = target.lm_head.weight.detach()
    torch.testing.assert_close(LowBitLinear(target.lm_head, "q8").dequantized(), w,
                               rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("start", [1, 21, 70])
def test_a_tree_row_equals_its_path_decoded_alone(tmp_path: Path, start: int) -> None:
    """The fused q4 forward of a tree gives every row the bits of its path decoded one token at
    a time after the prefix: in the tree its keys sit at other cache rows, with gaps between
    them, yet meet the same operations in the same order (what keeps greedy EAGLE-3 output equal
    to plain decoding). Prefix lengths put the row's last keys inside and outside a vector."""
    engine = tiny_engine(tmp_path, weights="q4", hidden_size=64, intermediate_size=96)
    target = engine.target
    g = torch.Generator().manual_seed(start)
    prefix = torch.randint(3, 96, (1, start), generator=g)
    parents = [-1, 0, 0, 1, 2, 4, 4, 3]  # a root, two branches, leaves at several depths
    tokens = torch.randint(3, 96, (1, len(parents)), generator=g)
    paths = []
    for j in range(len(parents)):
        path = [j]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    ancestors = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for j, path in enumerate(paths):
        ancestors[j, path] = True
    depth = torch.tensor([[len(path) - 1 for path in paths]])

    def after_prefix() -> KVCache:
        cache = target.new_cache()
        target(prefix, torch.arange(start)[None], cache, 0, causal_mask(start, 0, "cpu"))
        return cache

    tree = target(tokens, start + depth, after_prefix(), start, tree_mask(ancestors, start))
    for j, path in enumerate(paths):
        cache = after_prefix()
        for d, node in enumerate(path):
            alone = target(tokens[:, node:node + 1], torch.tensor([[start + d]]), cache,
                           start + d, None)
        assert torch.equal(tree.logits[0, j], alone.logits[0, 0]), (j, path)


@pytest.mark.parametrize("T, start", [(1, 0), (7, 0), (1, 9), (5, 9)])
def test_fused_decoder_equals_the_python_layers(tmp_path: Path, T: int, start: int) -> None:
    """The C++ layer stack against the Python layers with the same q4 linears: logits, aux
    hidden states and every KV row, under a causal mask and under a tree-like mask. Both start
    from the same float16 cache (the fused decoder's `kv_dtype`): a prefix computed by each
    path could round some keys one float16 step apart, which no later tolerance separates from
    a real difference."""
    engine = tiny_engine(tmp_path, weights="q4", hidden_size=64, intermediate_size=96)
    target = engine.target
    fused = target.fused
    assert fused is not None
    g = torch.Generator().manual_seed(T + start)
    ids = torch.randint(3, 96, (1, start + T), generator=g)
    mask = causal_mask(T, start, "cpu")
    if T > 2:
        mask[0, 2, start + 1] = False  # a tree row that does not see its elder sibling
    prefix = target.new_cache(max_len=32)
    assert prefix.data.dtype == torch.float16
    if start:
        target(ids[:, :start], torch.arange(start)[None], prefix, 0, causal_mask(start, 0, "cpu"))
    outs, caches = [], []
    for path in (fused, None):
        cache = target.new_cache(max_len=32)
        cache.data.copy_(prefix.data)
        target.fused = path
        outs.append(target(ids[:, start:], torch.arange(start, start + T)[None], cache, start,
                           mask, (0, 3, 8)))
        caches.append(cache.data)
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0].aux_hidden, outs[1].aux_hidden, rtol=1e-4, atol=1e-4)
    # float16 rows: inputs that differ in the last float32 bits may round one float16 step apart
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-3, atol=1e-5)


def test_engine_q4_greedy_speculative_equals_baseline(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64}}, weights="q4",
                         hidden_size=64, intermediate_size=96)
    assert isinstance(engine.target.lm_head, LowBitLinear) and engine.target.fused is not None
    assert engine.heads["head"].fused is not None
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    base = engine.generate(ids, params).token_ids
    for tree in (TreeParams(4, 3, 8), TreeParams(2, 4, 6)):
        assert engine.generate(ids, params, tree, "head").token_ids == base
    default = engine.generate(ids, params, None, "head", keep_events=True)  # config's tree
    assert default.token_ids == base
    trees = [ev.tree for ev in default.events if ev.tree]  # the config's cut applies
    want = engine.config.default_tree  # this CPU's static q4 tree
    assert max(map(len, trees)) <= want.max_rows
    assert all(node.score >= want.min_score for tree in trees for node in tree)


def test_q4_caches_after_every_commit_equal_a_fresh_prefill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's cache invariant on a q4 target through the fused decoder: with an oracle
    draft (`test_loop.Oracle`, each level right with probability 0.7) accept lengths vary, the
    output equals the greedy baseline, and after every commit both caches equal a fresh
    prefill."""
    from tests.test_loop import GREEDY, PROMPTS, Oracle, step_lengths

    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64}}, weight_scale=1.0,
                         weights="q4", hidden_size=64, intermediate_size=96)
    base = engine.generate(PROMPTS[0], GREEDY).token_ids
    oracle = Oracle(engine, PROMPTS[0], accuracy=0.7, seed=0).install(monkeypatch)
    result = engine.generate(PROMPTS[0], GREEDY, TreeParams(3, 3, 10), "head", keep_events=True)
    lengths = step_lengths(result)
    assert result.token_ids == base
    assert oracle.checks == len(lengths) and len(set(lengths)) >= 2 and max(lengths) >= 3


def test_bundled_q4_greedy_speculative_equals_baseline() -> None:
    """On the real target, rows of a tree verify give the bits of one-token decodes, so the
    q4 engine's greedy EAGLE-3 answer is its greedy baseline answer, token for token."""
    from eagle_engine.engine import EagleEngine

    engine = EagleEngine.load(EngineConfig(drafts=("eagle3-aux-1layer",), max_len=512))
    assert engine.config.weights == "q4"
    ids = engine.encode("Write a haiku about the sea.")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    base = engine.generate(ids, params).token_ids
    for tree in (Q4_TREE, TreeParams(2, 1, 3, min_score=0.05), TreeParams(4, 3, 8)):
        assert engine.generate(ids, params, tree, "eagle3-aux-1layer").token_ids == base


def test_app_status_names_the_target_weights() -> None:
    from playground.ui_render import engine_status

    configs = [EngineConfig(), EngineConfig(weights="dense", dtype="bf16")]
    assert [c.weights_label for c in configs] == ["q4", "bf16"]
    assert "**target weights** q4 / bf16 ·" in engine_status(configs[0], 3, ["q4", "bf16"])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_fused_head_equals_its_python_layers(tmp_path: Path, num_layers: int) -> None:
    """A q8 head's C++ layers against its Python layers: a draft extend over target features,
    then a draft step over recycled hidden states under a tree-like mask."""
    engine = tiny_engine(tmp_path, {"head": {"num_layers": num_layers, "intermediate_size": 64}},
                         weights="q4", hidden_size=64, intermediate_size=96)
    head = engine.heads["head"]
    assert head.fused is not None and head.fused.q8
    g = torch.Generator().manual_seed(num_layers)
    feats = torch.randn(1, 6, head.cfg.num_aux * 64, generator=g)
    ids = torch.randint(3, 96, (1, 6), generator=g)
    step_ids, step_hidden = torch.randint(3, 96, (1, 3), generator=g), torch.randn(1, 3, 64)
    step_mask = torch.ones(1, 3, 9, dtype=torch.bool)
    step_mask[0, 1, 6], step_mask[0, 2, 7] = False, False
    outs, caches, fused = [], [], head.fused
    for f in (fused, None):  # both over float16 caches, the fused decoder's kv_dtype
        cache = head.new_cache(32)
        head.fused = f
        ext = head(ids, feats, torch.arange(6)[None], cache, 0, causal_mask(6, 0, "cpu"),
                   from_target=True)
        step = head(step_ids, step_hidden, torch.full((1, 3), 6), cache, 6, step_mask,
                    from_target=False)
        outs.append(ext + step)
        caches.append(cache.data)
    for got, want in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # float16 rows: inputs that differ in the last float32 bits may round one float16 step apart
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("head_kw", [
    {}, {"use_aux": False}, {"norm_output": True, "num_layers": 2, "draft_vocab": 40},
    {"fc_norm": True, "norm_output": True}])
def test_one_call_extend_equals_its_steps(tmp_path: Path, head_kw: dict) -> None:
    """A q8 head's draft extend as one C++ call (`FusedDecoder.extend`) gives the bits of its
    Python definition over the same kernels (`accept.extend_forward`): the top-k, their target ids,
    the recycled hidden and the cache rows it writes, for one row and for three after a
    prefix; an EAGLE-3.1 head's norm per aux chunk (`fc_norm`) included. A head with one norm
    over all the features before `fc` keeps the steps."""
    from eagle_engine.accept import extend
    from eagle_engine.io_struct import EagleDraftExtendInput

    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64, **head_kw},
                                    "normed": {"intermediate_size": 64, "norm_before_fc": True}},
                         weights="q4", hidden_size=64, intermediate_size=96)
    head = engine.heads["head"]
    assert head.fused.extends and not engine.heads["normed"].fused.extends
    g = torch.Generator().manual_seed(0)
    width = EagleDraftExtendInput.hidden_size_for(head.cfg)  # [T, width] target features
    caches = [head.new_cache(32), head.new_cache(32)]
    prefix = torch.randn(caches[0].data.shape, generator=g).half()
    for c in caches:  # the same rows before `start` in both
        c.data.copy_(prefix)
    for start, T in ((5, 1), (6, 3), (9, 2)):
        ext = EagleDraftExtendInput(torch.randint(3, 96, (T,), generator=g),
                                    torch.randn(T, width, generator=g), start)
        got = extend(head, ext, caches[0], 3)
        head.fused.extends = False  # the one definition, over the same kernels
        want = extend(head, ext, caches[1], 3)
        head.fused.extends = True
        for a, b in ((got.topk_p, want.topk_p), (got.topk_ids, want.topk_ids),
                     (got.hidden, want.hidden), (caches[0].data, caches[1].data)):
            assert a.shape == b.shape and torch.equal(a, b)
        assert got.seq_len == want.seq_len == start + T and torch.equal(got.root, want.root)


@pytest.mark.parametrize("head_kw", [
    {}, {"use_aux": False}, {"norm_output": True, "num_layers": 2, "draft_vocab": 40},
    {"fc_norm": True}])
def test_one_call_draft_equals_its_steps(tmp_path: Path, head_kw: dict) -> None:
    """A q8 head's whole draft as one C++ call (`FusedDecoder.draft`) gives the bits of its
    Python definition over the same kernels (`draft_levels`): every candidate's score,
    token and parent, and the scratch cache rows its decode steps write, for trees of two to
    four levels and one to four nodes a level; with a `step_cut`, both stop after the same
    level (after the first decode step, or before it). A norm inside `fc` does not keep a head
    from the one call."""
    from eagle_engine.draft import draft
    from eagle_engine.io_struct import EagleDraftInput

    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64, **head_kw}},
                         weights="q4", hidden_size=64, intermediate_size=96)
    head = engine.heads["head"]
    fused = head.fused
    assert fused.drafts and fused.extends
    g = torch.Generator().manual_seed(1)
    H = head.cfg.hidden_size
    caches = [head.new_cache(48), head.new_cache(48)]
    prefix = torch.randn(caches[0].data.shape, generator=g).half()
    for K, S, seq in ((3, 4, 7), (1, 3, 9), (2, 2, 5), (4, 3, 12)):
        for c in caches:  # the same committed rows, no scratch rows yet
            c.data.copy_(prefix)
            c.data[:, :, seq:] = 0
        p = torch.rand(K, generator=g).sort(descending=True).values
        state = EagleDraftInput(topk_p=p, topk_ids=torch.randperm(90, generator=g)[:K] + 3,
                                hidden=torch.randn(H, generator=g), root=torch.tensor([4]),
                                seq_len=seq)
        full = None
        for step_cut in (0.0, None, float(p.max()) + 1e-6):
            if step_cut is None:  # between the extend's best and the first level's best path
                step_cut = (float(p.max()) + float(full.scores[K:K + K * K].max())) / 2
            trees = []
            for on, cache in ((True, caches[0]), (False, caches[1])):
                fused.drafts = on
                trees.append(draft(head, state, cache,
                                   TreeParams(K, S, K + 1, step_cut=step_cut)))
            fused.drafts = True
            full = trees[0] if full is None else full
            for a, b in ((trees[0].scores, trees[1].scores), (trees[0].tokens, trees[1].tokens),
                         (trees[0].parents, trees[1].parents),
                         (caches[0].data, caches[1].data)):
                assert a.shape == b.shape and torch.equal(a, b)
            levels = S if step_cut == 0 else 2 if step_cut <= p.max() else 1
            C = K + (levels - 1) * K * K
            assert trees[0].scores.shape == (C,) and trees[0].scores.max() <= p.max()
            assert torch.equal(trees[0].scores, full.scores[:C])  # the same levels, cut short
        written = caches[0].data[:, :, seq:seq + (S - 1) * K]
        assert written.ne(0).any(-1).all()  # every scratch row of every level was written
    with pytest.raises(RuntimeError, match=rf"hidden must be \[{H}\], got \[{H + 1}\]"):
        fused.draft(head, p, state.topk_ids, torch.zeros(H + 1), 5, 2, caches[0].data, 0.0)
    with pytest.raises(RuntimeError, match=r"draft rows up to 56 past the head cache's 48"):
        fused.draft(head, p, state.topk_ids, state.hidden, 44, 4, caches[0].data, 0.0)


def _load_in_a_new_process() -> subprocess.Popen[bytes]:
    code = "from eagle_engine.kernels import cpu_lowbit; cpu_lowbit.load()"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1])


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    cpu_lowbit.load()  # built here, so the new process only loads
    stale = cpu_lowbit.build_dir(cpu_lowbit.FLAGS) / "lock"
    stale.touch()  # what torch's builder leaves when its process is killed mid-build
    try:
        assert _load_in_a_new_process().wait(timeout=120) == 0
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_live_build_is_waited_for() -> None:
    cpu_lowbit.load()
    with open(cpu_lowbit.build_dir(cpu_lowbit.FLAGS) / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another process building
        proc = _load_in_a_new_process()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=8)
    assert proc.wait(timeout=120) == 0
