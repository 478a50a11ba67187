"""4-bit target weights on CPU (`models/cpu_int4.py`, `EngineConfig.int4_weights`).

Quantizing a weight that lies on a Q4_1 grid gives back its codes, scales and minimums exactly
(random grids, and every decoder linear of the bundled Q4_1 target, whose bf16 load gives the
same codes); the int4 kernel equals a plain product with the dequantized weight for one token,
a tree and a prefill; an engine with int4 weights keeps greedy speculative output equal to its
own greedy baseline and its caches equal to a fresh prefill after every commit; bad shapes and
devices are refused with the values named.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from eagle_engine.config import (INT4_TREE, ConfigError, EngineConfig, SamplingParams,
                                 TreeParams)
from eagle_engine.engine import EagleEngine
from eagle_engine.models.cpu_int4 import GROUP, Int4Linear, quantize_decoder_linears, quantize_int4
from eagle_engine.models.loader import load_target
from tests.helpers import tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")
BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def q4_1_weight(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A weight on a Q4_1 grid, as llama.cpp writes it: every block of 32 inputs holds code 0
    (its minimum) and code 15 (its maximum)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f // GROUP, GROUP), generator=g, dtype=torch.int32)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(out_f, in_f // GROUP, generator=g) * 0.01 + 1e-3
    low = torch.randn(out_f, in_f // GROUP, generator=g) * 0.05
    weight = codes * scale[..., None] + low[..., None]
    return weight.view(out_f, in_f), codes.view(out_f, in_f), scale, low


def dequantized(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """What the kernel multiplies by: (q - 8) * scale + zero with scale and zero in `dtype`."""
    s, zero = scale.to(dtype).double(), (low + 8 * scale).to(dtype).double()
    q = codes.double().view(*scale.shape, GROUP) - 8
    return (q * s[..., None] + zero[..., None]).view(codes.shape)


def test_quantize_recovers_a_q4_1_grid() -> None:
    weight, codes, scale, low = q4_1_weight(48, 96, seed=0)
    got_codes, got_scale, got_low = quantize_int4(weight)
    assert torch.equal(got_codes, codes)
    torch.testing.assert_close(got_scale, scale, rtol=1e-5, atol=0)
    assert torch.equal(got_low, low)


def test_bundled_target_codes_come_back_exactly(bundled_dir: Path) -> None:
    """The engine's fp32 copy of the Q4_1 GGUF: every decoder linear is on a 4-bit grid, and
    the same target loaded in bf16 (as the engine quantizes it) gives the same codes."""
    linears = {dtype: [m for m in load_target(bundled_dir, dtype, "cpu", 64).layers.modules()
                       if type(m) is nn.Linear] for dtype in (torch.float32, torch.bfloat16)}
    assert len(linears[torch.float32]) == 120  # 30 layers x (qkv, o, gate_up, down)
    for lin, lin16 in zip(linears[torch.float32], linears[torch.bfloat16]):
        codes, scale, low = quantize_int4(lin.weight.detach())
        rebuilt = codes.view(*scale.shape, GROUP) * scale[..., None] + low[..., None]
        torch.testing.assert_close(rebuilt.view_as(lin.weight), lin.weight.detach(),
                                   rtol=0, atol=2e-7)
        assert torch.equal(quantize_int4(lin16.weight.detach())[0], codes)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if BF16 else []))
@pytest.mark.parametrize("shape", [(1, 64), (8, 64), (2, 5, 64), (65, 64)])
def test_int4_linear_equals_dequantized_product(dtype: torch.dtype, shape: tuple) -> None:
    weight, codes, scale, low = q4_1_weight(48, 64, seed=1)
    lin = nn.Linear(64, 48, bias=False)
    lin.weight.data = weight.to(dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        got = Int4Linear(lin)(x)
    expected = x.double() @ dequantized(codes, scale, low, dtype).T
    assert got.shape == (*shape[:-1], 48) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_int4_linear_refuses_bias_and_shapes() -> None:
    with pytest.raises(ValueError, match="48x40"):
        Int4Linear(nn.Linear(40, 48, bias=False))
    with pytest.raises(ValueError, match="bias"):
        Int4Linear(nn.Linear(64, 48))


def test_int4_weights_are_a_cpu_path() -> None:
    with pytest.raises(ConfigError, match="CPU path; device is 'cuda'"):
        EngineConfig(device="cuda", int4_weights=True)


def test_engine_int4_greedy_speculative_equals_baseline(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, int4_weights=True)
    quantized = [m for m in engine.target.modules() if isinstance(m, Int4Linear)]
    assert len(quantized) == 4 * engine.target.cfg.num_layers
    assert not isinstance(engine.target.lm_head, Int4Linear)
    assert quantize_decoder_linears(engine.target) == (0, 0)  # nothing left to quantize
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    base = engine.generate(ids, params).token_ids
    for tree in (TreeParams(4, 3, 8), TreeParams(2, 4, 6)):
        assert engine.generate(ids, params, tree, "head").token_ids == base
    default = engine.generate(ids, params, None, "head", keep_events=True)  # config's tree
    assert default.token_ids == base
    assert {len(ev.tree) for ev in default.events if ev.tree} == {INT4_TREE.num_draft_tokens}


def test_int4_copy_shares_the_heads_of_its_twin(tmp_path: Path) -> None:
    """`EagleEngine.load(..., heads_of=engine)` (the app's and `bench --int4-trees`' int4 copy)
    reuses the heads and tokenizer, quantizes only its own target, and its greedy speculation
    equals its own baseline."""
    first = tiny_engine(tmp_path)
    twin = EagleEngine.load(replace(first.config, int4_weights=True), heads_of=first)
    assert twin.heads is first.heads and twin.tokenizer is first.tokenizer
    assert isinstance(twin.target.layers[0].mlp.down_proj, Int4Linear)
    assert not any(isinstance(m, Int4Linear) for m in first.target.modules())
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ids = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert (twin.generate(ids, params, TreeParams(4, 3, 8), "head").token_ids
            == twin.generate(ids, params).token_ids)


def test_int4_caches_after_every_commit_equal_a_fresh_prefill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's cache invariant on an int4 target: with an oracle draft (`test_loop.Oracle`,
    each level right with probability 0.7) accept lengths vary, the output equals the greedy
    baseline, and after every commit both caches equal a fresh prefill."""
    from tests.test_loop import GREEDY, PROMPTS, Oracle, step_lengths

    engine = tiny_engine(tmp_path, weight_scale=1.0, int4_weights=True)
    base = engine.generate(PROMPTS[0], GREEDY).token_ids
    oracle = Oracle(engine, PROMPTS[0], accuracy=0.7, seed=0).install(monkeypatch)
    result = engine.generate(PROMPTS[0], GREEDY, TreeParams(3, 3, 10), "head", keep_events=True)
    lengths = step_lengths(result)
    assert result.token_ids == base
    assert oracle.checks == len(lengths) and len(set(lengths)) >= 2 and max(lengths) >= 3


def test_app_status_names_the_target_weights() -> None:
    from eagle_engine.ui_render import engine_status, weight_label

    configs = [EngineConfig(dtype="bf16"), EngineConfig(dtype="bf16", int4_weights=True)]
    assert [weight_label(c) for c in configs] == ["bf16", "int4"]
    assert "**target weights** bf16 / int4 ·" in engine_status(configs[0], 3, ["bf16", "int4"])
    assert "**target weights** fp32 ·" in engine_status(EngineConfig(dtype="fp32"), 3, ["fp32"])
