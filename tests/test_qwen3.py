"""Issue 25: Qwen3 dense targets (`Qwen3ForCausalLM`, per-head q/k RMSNorm before RoPE).

Tiny random Qwen3 checkpoints (GQA and MHA, tied and untied embeddings, head_dim != hidden /
heads) are saved with transformers and loaded with `resolve_target` / `load_target`; fp32
logits, aux hidden states and cached greedy decoding must match transformers' own forward. A
Qwen3 GGUF written with the `gguf` package converts and loads to the same logits. EAGLE-3 greedy
decoding with random heads equals plain greedy decoding, with dense and with q4 weights (q4 runs
the Python layers: the fused C++ decoder has no q/k norms and refuses such targets). Bad Qwen3
configs and checkpoints are refused naming the problem.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
from transformers import Qwen3ForCausalLM

from eagle_engine.config import ConfigError, SamplingParams, TargetConfig, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.cpu_lowbit import FusedDecoder, LowBitLinear
from eagle_engine.models.loader import load_target, load_tokenizer, resolve_target
from eagle_engine.models.target import TargetModel
from tests.helpers import make_hf_qwen3_target, tiny_engine
from tests.test_target import (
    assert_cached_greedy_parity,
    hf_greedy,
    prefill_parity,
    prompt,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIGS = {  # head_dim 16 (make_hf_qwen3_target's default) or 12, != hidden / heads (8 or 4)
    "gqa_untied": {},
    "mha_tied_head12": dict(num_key_value_heads=4, head_dim=12, tie_word_embeddings=True,
                            num_hidden_layers=7),
    "gqa4to1_tied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6),
}


@dataclass
class Pair:
    hf: Qwen3ForCausalLM
    ours: TargetModel


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    directory = make_hf_qwen3_target(tmp_path_factory.mktemp(request.param), weight_scale=4.0,
                                     **CONFIGS[request.param])
    hf = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(resolve_target(str(directory)), torch.float32, "cpu", 256)
    return Pair(hf, ours)


def test_config_and_weights_loaded(pair: Pair) -> None:
    hf_cfg, cfg = pair.hf.config, pair.ours.cfg
    assert cfg.qk_norm and not cfg.attention_bias
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (
        hf_cfg.head_dim, hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads,
        hf_cfg.num_hidden_layers)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    tied = pair.ours.lm_head.weight.data_ptr() == pair.ours.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings
    for ours, ref in zip(pair.ours.layers, pair.hf.model.layers):
        assert torch.equal(ours.self_attn.q_norm.weight, ref.self_attn.q_norm.weight)
        assert torch.equal(ours.self_attn.k_norm.weight, ref.self_attn.k_norm.weight)
        assert ours.self_attn.q_norm.eps == ref.self_attn.q_norm.variance_epsilon


def test_prefill_logits_and_aux_match(pair: Pair) -> None:
    """Logits, and the aux states: inputs of the chosen layers, un-normed, ascending. HF's last
    hidden state is the final-normed one, so aux id L is checked through our final norm."""
    ids = prompt()
    L = pair.ours.cfg.num_layers
    aux_ids = (0, 2, L // 2, L - 1, L)
    ref, out = prefill_parity(pair.ours, pair.hf, ids, aux_ids)
    torch.testing.assert_close(out.final_hidden, ref.hidden_states[L], atol=1e-5, rtol=1e-5)
    H = pair.ours.cfg.hidden_size
    aux = out.aux_hidden.split(H, dim=-1)
    assert out.aux_hidden.shape == (1, len(ids), len(aux_ids) * H)
    for got, i in zip(aux[:-1], aux_ids[:-1]):
        torch.testing.assert_close(got, ref.hidden_states[i], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(aux[-1], ref.hidden_states[L], atol=1e-2)  # un-normed
    torch.testing.assert_close(pair.ours.norm(aux[-1]), ref.hidden_states[L], atol=1e-5,
                               rtol=1e-5)


def test_greedy_and_cached_decode_match(pair: Pair) -> None:
    assert_cached_greedy_parity(pair.ours, pair.hf, prompt(seed=2))


def test_qk_norms_change_the_logits(pair: Pair) -> None:
    """The parity above needs the q/k norms: with them switched off the logits move."""
    ids = torch.tensor([prompt()])
    n = ids.shape[1]

    def logits() -> torch.Tensor:
        return pair.ours(ids, torch.arange(n)[None], pair.ours.new_cache(), 0,
                         causal_mask(n, 0, "cpu")).logits

    with_norms = logits()
    attns = [layer.self_attn for layer in pair.ours.layers]
    saved = [(a.q_norm, a.k_norm) for a in attns]
    try:
        for a in attns:
            a.q_norm = a.k_norm = None
        without = logits()
    finally:
        for a, (q, k) in zip(attns, saved):
            a.q_norm, a.k_norm = q, k
    assert (with_norms - without).abs().max() > 0.05 * with_norms.abs().max()


# --- GGUF -------------------------------------------------------------------------------------

def write_qwen3_gguf(hf: Qwen3ForCausalLM, path: Path) -> Path:
    """`hf` as an F32 `qwen3` GGUF the way llama.cpp's converter writes one (no output.weight
    when the embeddings are tied), with a small byte-level BPE vocabulary of vocab_size tokens."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("tiny-qwen3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = ["<pad>", "<s>", "</s>"] + [chr(i) for i in range(33, 33 + c.vocab_size - 4)]
    tokens.append("ab")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3
                           + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, kind = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{kind}", t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied_head12"])
def test_gguf_round_trip(name: str, tmp_path: Path) -> None:
    """A Qwen3 GGUF (head_dim != hidden / heads, which transformers' qwen3 GGUF mapping does not
    read) converts once into a directory that loads to transformers' logits."""
    directory = make_hf_qwen3_target(tmp_path / "hf", weight_scale=4.0, **CONFIGS[name])
    hf = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    path = write_qwen3_gguf(hf, tmp_path / f"tiny-{name}.gguf")
    converted = resolve_target(str(path), cache_dir=tmp_path / "cache")
    assert converted == tmp_path / "cache" / f"tiny-{name}"
    assert json.loads((converted / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]
    ours = load_target(converted, torch.float32, "cpu", 128)
    assert ours.cfg.qk_norm and ours.cfg.head_dim == hf.config.head_dim
    assert ours.cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert load_tokenizer(converted).encode("ab!", add_special_tokens=False) == [95, 3]  # merged
    ids = prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    out = ours(torch.tensor([ids]), torch.arange(len(ids))[None], ours.new_cache(), 0,
               causal_mask(len(ids), 0, "cpu"))
    torch.testing.assert_close(out.logits, ref, atol=2e-5 * ref.abs().max(), rtol=1e-4)


# --- EAGLE-3 on a Qwen3 target ---------------------------------------------------------------

HEADS = {"aux": {}, "noaux": {"use_aux": False, "seed": 1},
         "deep_small_vocab": {"num_layers": 2, "draft_vocab": 40, "seed": 2}}
# prompts whose greedy continuations on this target are varied (>= 10 distinct of 20 tokens)
PROMPTS = ([1, 4, 88, 20, 93, 83, 45, 47, 39, 42, 28], [1, 33, 80, 48, 61, 57, 82, 91, 91])
NEW = 20
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
TREES = [((1, 3, 4), "aux", 0), ((2, 3, 6), "noaux", 1), ((3, 4, 12), "deep_small_vocab", 0),
         ((4, 3, 8), "aux", 1), ((8, 2, 32), "noaux", 0), ((5, 3, 20), "deep_small_vocab", 1)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EagleEngine:
    return tiny_engine(tmp_path_factory.mktemp("qwen3_loop"), HEADS, weight_scale=1.0,
                       family="qwen3")


@pytest.fixture(scope="module")
def baseline(engine: EagleEngine) -> list[list[int]]:
    return [engine.generate(p, GREEDY).token_ids for p in PROMPTS]


def test_baseline_is_transformers_greedy(engine: EagleEngine, baseline: list[list[int]]) -> None:
    assert engine.target.cfg.qk_norm
    hf = Qwen3ForCausalLM.from_pretrained(engine.config.target, dtype=torch.float32).eval()
    for ids, tokens in zip(PROMPTS, baseline):
        assert len(set(tokens)) >= 10  # varied, so a wrong draft shows
        assert tokens == hf_greedy(hf, ids, NEW)


@pytest.mark.parametrize("shape, head, prompt_id", TREES,
                         ids=[f"k{s[0]}-s{s[1]}-n{s[2]}-{h}" for s, h, _ in TREES])
def test_eagle3_greedy_equals_baseline(engine: EagleEngine, baseline: list[list[int]],
                                       shape: tuple[int, int, int], head: str,
                                       prompt_id: int) -> None:
    result = engine.generate(PROMPTS[prompt_id], GREEDY, TreeParams(*shape), head)
    assert result.token_ids == baseline[prompt_id]
    assert result.finished == "length" and result.stats.num_tokens == NEW


def test_q4_weights_run_the_python_layers(tmp_path: Path) -> None:
    """q4 on a Qwen3 target: the linears hold q4 codes, the fused decoder (no q/k norms in the
    kernel) is refused, so every step runs the Python layers; greedy speculative output equals
    the q4 baseline, and q4 logits track the dense ones."""
    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64}}, weights="q4",
                         family="qwen3", hidden_size=64, intermediate_size=96)
    target = engine.target
    assert engine.config.weights == "q4" and target.fused is None
    assert isinstance(target.layers[0].self_attn.qkv_proj, LowBitLinear)
    attns = [layer.self_attn for layer in target.layers]
    norms = [(a.q_norm, a.k_norm) for a in attns]
    assert not FusedDecoder.supports(target)
    for a in attns:  # the q/k norms are the only reason it refuses
        a.q_norm = a.k_norm = None
    assert FusedDecoder.supports(target)
    for a, (q, k) in zip(attns, norms):
        a.q_norm, a.k_norm = q, k
    assert engine.heads["head"].fused is not None  # the head has no q/k norms
    ids = prompt(24, seed=1)
    base = engine.generate(ids, GREEDY).token_ids
    for tree in (TreeParams(4, 3, 8), TreeParams(2, 4, 6)):
        assert engine.generate(ids, GREEDY, tree, "head").token_ids == base
    dense = load_target(Path(engine.config.target), torch.float32, "cpu", 64)
    with torch.no_grad():  # the weights the kernels multiply by: only int8 activations differ
        for name, module in target.named_modules():
            if isinstance(module, LowBitLinear):
                dense.get_submodule(name).weight.copy_(module.dequantized())
    n = len(ids)
    q4_logits, dense_logits = (m(torch.tensor([ids]), torch.arange(n)[None], m.new_cache(), 0,
                                 causal_mask(n, 0, "cpu")).logits for m in (target, dense))
    # int8 activations move the logits ~2% of their range here; dropping the q/k norms ~50%
    torch.testing.assert_close(q4_logits, dense_logits, atol=5e-2 * dense_logits.abs().max(),
                               rtol=0)


# --- refusals --------------------------------------------------------------------------------

QWEN3_DICT = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 4, "num_attention_heads": 2, "model_type": "qwen3",
              "architectures": ["Qwen3ForCausalLM"]}


def test_target_config_from_qwen3_dict() -> None:
    cfg = TargetConfig.from_dict(QWEN3_DICT)
    assert cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == 128  # transformers' Qwen3Config default, not hidden / heads
    assert TargetConfig.from_dict({**QWEN3_DICT, "head_dim": 6}).head_dim == 6
    llama = {**QWEN3_DICT, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert not TargetConfig.from_dict(llama).qk_norm
    assert TargetConfig.from_dict(llama).head_dim == 4


def test_sliding_window_is_refused() -> None:
    with pytest.raises(ConfigError, match="use_sliding_window=true.*window 4096"):
        TargetConfig.from_dict({**QWEN3_DICT, "use_sliding_window": True,
                                "sliding_window": 4096}, "qwen3/config.json")


def test_missing_qk_norm_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = make_hf_qwen3_target(tmp_path / "ckpt", num_hidden_layers=3)
    sd = load_file(directory / "model.safetensors")
    del sd["model.layers.1.self_attn.k_norm.weight"]
    save_file(sd, directory / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing.*layers\.1\.self_attn\.k_norm\.weight"):
        load_target(directory, torch.float32)


def test_qwen3_output_bias_is_refused(tmp_path: Path) -> None:
    """Qwen3 attention_bias=True also biases o_proj, which our attention does not implement."""
    directory = make_hf_qwen3_target(tmp_path / "biased", attention_bias=True,
                                     num_hidden_layers=3)
    with pytest.raises(ConfigError, match=r"self_attn\.o_proj\.bias"):
        load_target(directory, torch.float32)

