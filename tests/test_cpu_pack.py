"""Issue 2: oneDNN-packed linear weights on CPU (`models/cpu_pack.py`).

A packed layer equals `F.linear` for every shape the engine uses (one token, a tree, a prefill;
2-D and 3-D inputs; with and without bias; fp32 and bf16); packing a whole target keeps tied
weights shared and leaves its logits and greedy continuation unchanged; an engine loaded with
packing produces the same greedy tokens as one without, baseline and speculative.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.models.cpu_pack import PackedLinear, can_pack, pack_linears
from eagle_engine.models.loader import load_target
from tests.helpers import ByteTokenizer, make_hf_target, random_head, save_head

pytestmark = [pytest.mark.usefixtures("torch_single_thread"),
              pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="no oneDNN")]
DTYPES = [torch.float32] + ([torch.bfloat16] if can_pack("cpu", torch.bfloat16) else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (7, 40), (2, 3, 40), (1, 1, 40), (65, 40)])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, bias: bool, shape: tuple) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(40, 24, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        expected = F.linear(x, lin.weight, lin.bias)
        got = PackedLinear(lin)(x)
    assert got.shape == expected.shape == (*shape[:-1], 24)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_can_pack_only_cpu_float_types() -> None:
    assert not can_pack("cuda", torch.float32)
    assert not can_pack("cpu", torch.float16)
    assert not can_pack("cpu", torch.int8)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_target_same_logits_and_tied_weights(tmp_path: Path, tied: bool) -> None:
    directory = make_hf_target(tmp_path / "t", weight_scale=1.0, tie_word_embeddings=tied)
    plain = load_target(directory, torch.float32, "cpu", 128)
    packed = load_target(directory, torch.float32, "cpu", 128)
    n = pack_linears(packed)
    assert n == 4 * packed.cfg.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    assert not any(type(m) is nn.Linear for m in packed.modules())
    if tied:
        assert packed.lm_head.weight is packed.embed_tokens.weight
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        outs = []
        for model in (plain, packed):
            cache = model.new_cache()
            mask = torch.ones(1, 30, 30, dtype=torch.bool).tril()
            outs.append(model(ids, torch.arange(30)[None], cache, 0, mask).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_engine_packed_equals_unpacked(tmp_path: Path) -> None:
    directory = make_hf_target(tmp_path / "t", weight_scale=1.0)
    target_cfg = load_target(directory, torch.float32, "cpu", 128).cfg
    head = str(save_head(random_head(target_cfg), target_cfg, tmp_path / "head"))
    engines = [EagleEngine.load(EngineConfig(target=str(directory), drafts=(head,),
                                             dtype="fp32", max_len=256, packed_weights=p),
                                ByteTokenizer()) for p in (False, True)]
    assert type(engines[0].target.lm_head) is nn.Linear
    assert type(engines[1].target.lm_head) is PackedLinear
    assert type(engines[1].heads["head"].lm_head) is PackedLinear
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = TreeParams(topk=4, num_steps=3, num_draft_tokens=12)
    runs = [[e.generate(ids, params, *args).token_ids for e in engines]
            for args in ((), (tree, "head"))]
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1]
