"""Issue 2: the target runtime against transformers.

Tiny random Llama/Qwen2 checkpoints of several shapes (GQA and MHA, tied and untied embeddings,
explicit head_dim, llama3 and linear RoPE scaling, Qwen2 q/k/v biases) are saved with
transformers and loaded with `load_target`; logits, aux hidden states and greedy continuations
must match transformers' own forward in fp32. Also: ragged batched decoding equals per-prompt
decoding, and the bundled SmolLM2 answers a chat prompt exactly like transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle_engine.baseline import generate_batch
from eagle_engine.chat import encode_chat
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import EagleEngine
from eagle_engine.kernels.attention import attend, score_bias
from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.loader import load_target
from eagle_engine.models.target import TargetModel, TargetOutput
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "llama_gqa": ("llama", {}),
    "llama_mha_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                     num_hidden_layers=7)),
    "llama3_rope_head_dim": ("llama", dict(rope_scaling=LLAMA3_ROPE, head_dim=16,
                                           num_hidden_layers=9)),
    "linear_rope_wide": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0},
                                       hidden_size=48, num_attention_heads=6,
                                       num_key_value_heads=3, rope_theta=500.0)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2, num_hidden_layers=10)),
}
PROMPT_LEN = 40  # long enough that every RoPE scaling regime changes the logits
GREEDY_STEPS = 20


@dataclass
class Pair:
    hf: torch.nn.Module
    ours: TargetModel


def save_random_hf(directory: Path, family: str, overrides: dict, seed: int = 0) -> torch.nn.Module:
    """A random transformers model with non-trivial norms and biases, saved to `directory`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if family == "qwen2":
        kw.pop("rope_scaling", None)
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.mul_(2.0)
    model.eval().save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    family, overrides = CONFIGS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf(directory, family, overrides)
    return Pair(hf=hf, ours=load_target(directory, torch.float32, "cpu", 256))


def prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()


def hf_greedy(hf: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """Reference greedy decoding: a full transformers forward per step, no cache."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def our_greedy_logits(model: TargetModel, ids: list[int], steps: int
                      ) -> tuple[list[int], torch.Tensor]:
    """Prefill then one cached decode step per token -> (tokens, logits [steps, V])."""
    cache = model.new_cache()
    n = len(ids)
    out = model(torch.tensor([ids]), torch.arange(n)[None], cache, 0, causal_mask(n, 0, "cpu"))
    tokens, logits = [], [out.logits[0, -1]]
    for step in range(steps - 1):
        tokens.append(int(logits[-1].argmax()))
        pos = n + step
        out = model(torch.tensor([[tokens[-1]]]), torch.tensor([[pos]]), cache, pos, None)
        logits.append(out.logits[0, -1])
    tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def test_config_parsed(pair: Pair) -> None:
    hf_cfg, cfg = pair.hf.config, pair.ours.cfg
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    default_head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert cfg.head_dim == getattr(hf_cfg, "head_dim", default_head_dim)
    assert cfg.tie_word_embeddings == bool(hf_cfg.tie_word_embeddings)
    assert cfg.attention_bias == (hf_cfg.model_type == "qwen2")
    if cfg.tie_word_embeddings:
        assert pair.ours.lm_head.weight.data_ptr() == pair.ours.embed_tokens.weight.data_ptr()


def test_rope_inverse_frequencies_match(pair: Pair) -> None:
    hf_inv = pair.hf.model.rotary_emb.inv_freq.float()
    ours = pair.ours.rope
    hd = pair.ours.cfg.head_dim
    positions = torch.arange(0, 256, 17)
    freqs = torch.outer(positions.float(), hf_inv)
    expected = torch.cat([freqs, freqs], dim=-1)
    torch.testing.assert_close(ours.cos[positions], expected.cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin[positions], expected.sin(), atol=1e-5, rtol=0)
    assert ours.cos.shape[-1] == hd


def prefill_parity(ours: TargetModel, hf: torch.nn.Module, ids: list[int],
                   aux_ids: tuple[int, ...]) -> tuple[Any, TargetOutput]:
    """Transformers' forward (with hidden states) and our prefill over `ids`, logits asserted
    equal; returns both outputs for the caller's aux checks."""
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    out = ours(torch.tensor([ids]), torch.arange(len(ids))[None], ours.new_cache(), 0,
               causal_mask(len(ids), 0, "cpu"), aux_ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-5 * ref.logits.abs().max(),
                               rtol=1e-4)
    return ref, out


def test_prefill_logits_and_aux_match(pair: Pair) -> None:
    ids = prompt()
    L = pair.ours.cfg.num_layers
    aux_ids = (2, L // 2, L - 3)
    ref, out = prefill_parity(pair.ours, pair.hf, ids, aux_ids)
    expected_aux = torch.cat([ref.hidden_states[i] for i in aux_ids], dim=-1)
    assert out.aux_hidden.shape == (1, len(ids), 3 * pair.ours.cfg.hidden_size)
    torch.testing.assert_close(out.aux_hidden, expected_aux, atol=1e-4, rtol=1e-4)


def assert_cached_greedy_parity(ours: TargetModel, hf: torch.nn.Module, ids: list[int]
                                ) -> list[int]:
    """Our cached greedy decode gives transformers' greedy tokens and its logits at every step;
    returns those tokens."""
    ref_tokens = hf_greedy(hf, ids, GREEDY_STEPS)
    tokens, logits = our_greedy_logits(ours, ids, GREEDY_STEPS)
    assert tokens == ref_tokens
    with torch.no_grad():  # one full forward over the final sequence scores every step
        ref_logits = hf(torch.tensor([ids + ref_tokens])).logits[0, len(ids) - 1:-1]
    torch.testing.assert_close(logits, ref_logits, atol=2e-5 * ref_logits.abs().max(), rtol=1e-4)
    return ref_tokens


def test_greedy_and_cached_decode_match(pair: Pair) -> None:
    ids = prompt(seed=2)
    ref_tokens = assert_cached_greedy_parity(pair.ours, pair.hf, ids)
    batch_tokens = generate_batch(pair.ours, [ids], SamplingParams(max_new_tokens=GREEDY_STEPS), ())
    assert batch_tokens == [ref_tokens]


def test_ragged_batch_equals_single_prompts(tiny_target: TargetModel) -> None:
    prompts = [prompt(n, seed=n) for n in (3, 11, 6, 17, 1)]
    params = SamplingParams(max_new_tokens=12)
    singles = [generate_batch(tiny_target, [p], params, ())[0] for p in prompts]
    assert all(len(s) == 12 for s in singles)
    assert len({tuple(s) for s in singles}) == len(prompts)  # rows really differ
    assert generate_batch(tiny_target, prompts, params, ()) == singles
    # a stop token cuts each row at its own first occurrence, the others keep going
    first_new = next(i for i in range(2, 12) if singles[1][i] not in singles[1][:i])
    stop = singles[1][first_new]
    cut = [s[:s.index(stop)] if stop in s else s for s in singles]
    assert any(len(c) == 12 for c in cut) and len(cut[1]) == first_new
    assert generate_batch(tiny_target, prompts, params, (stop,)) == cut


def test_smollm2_greedy_matches_transformers(bundled_dir: Path, smol_tokenizer: object) -> None:
    """fp32 SmolLM2-135M-Instruct: our engine's baseline == transformers generate, 32 tokens."""
    from transformers import AutoModelForCausalLM

    messages = [{"role": "user", "content": "Write a short poem about the sea and the moon."}]
    ids = encode_chat(smol_tokenizer, messages)
    assert ids == smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        seq = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                          do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
        ref_logits = hf(torch.tensor([ids])).logits[0, -1]
    engine = EagleEngine.load(EngineConfig(target="bundled", drafts=(), dtype="fp32",
                                           weights="dense", max_len=256), smol_tokenizer)
    out = engine.target(torch.tensor([ids]), torch.arange(len(ids))[None],
                        engine.target.new_cache(max_len=len(ids)), 0,
                        causal_mask(len(ids), 0, "cpu"), last_only=True)
    torch.testing.assert_close(out.logits[0, -1], ref_logits, atol=1e-3, rtol=1e-4)
    result = engine.generate(ids, SamplingParams(max_new_tokens=32))
    assert len(seq) == 32 and smol_tokenizer.eos_token_id not in seq
    assert result.token_ids == seq
    assert result.finished == "length"
    assert result.text == smol_tokenizer.decode(seq, skip_special_tokens=True)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Plain fp64 softmax attention, each query head reading its KV head h // g."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("T", [1, 5, 80])  # decode, tree verify, prefill (SDPA on CPU past 64)
@pytest.mark.parametrize("mask_batch", [1, 2])  # one mask for the batch, or one per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # CPU: grouped fp32 / SDPA
def test_attend_equals_reference(device: str, T: int, mask_batch: int,
                                 dtype: torch.dtype) -> None:
    """Every branch of `attend` (grouped fp32 matmuls, SDPA with GQA, grouped SDPA on GPU) reads
    the right KV head for each query head and applies the mask row of each query."""
    gen = torch.Generator().manual_seed(T)
    B, H, kvh, d, S = 2, 6, 2, 16, T + 7
    q, k, v = (torch.randn(B, n, L, d, generator=gen).to(dtype)
               for n, L in ((H, T), (kvh, S), (kvh, S)))
    mask = torch.rand(mask_batch, T, S, generator=gen) > 0.4
    mask[..., 0] = True  # every query sees at least one key
    q, k, v, mask = (x.to(device) for x in (q, k, v, mask))
    out = attend(q, k, v, score_bias(mask, H, kvh, dtype))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    want = reference_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu())
    torch.testing.assert_close(out.cpu().double(), want, **tol)
