"""Issue 25: EAGLE-3 heads published in other conventions than SGLang's load into a network whose
outputs equal a reference head built from the same tensors, and `inspect-draft` names the
convention it recognised.

Each fixture writes a tiny random reference head (`test_draft_io.make_reference`, for the
8-layer Llama tiny target) the way its publisher does, config keys and tensor names included:
- AngelSlim's Qwen3 heads (Tencent/AngelSlim `train/configs/qwen3-*-eagle3.json`):
  `Eagle3LlamaForCausalLM`, `tie_word_embeddings: true` beside a draft-vocab `lm_head`, explicit
  `head_dim` != hidden / heads, no `target_hidden_size`, official names in `pytorch_model.bin`;
- EAGLE's own training output, as Tengyunw's Qwen3-8B head was made (SafeAILab/EAGLE
  `traineagle3/config.json`, `save_16bit_model`: `pytorch_model.bin` with `midlayer.*`);
- vllm-project/speculators (RedHatAI's heads): `speculators_model_type`, the layer config nested
  in `transformer_layer_config`, `norm_before_residual` (true when absent, as vLLM's
  `speculators/algos.py` reads it), top-level aux ids that vLLM reads as layer INPUT indices,
  `layers.{i}.*` names and the head's own `embed_tokens.weight`; a wider head than its target,
  two layers, `norm_before_fc` (`input_norm.weight`) and `norm_output`;
- NVIDIA ModelOpt's `norm_before_fc` nested in `eagle_config` with `input_norm.weight` (vLLM and
  SGLang read it there).
Layouts the engine cannot run (a Qwen3 draft layer, other speculator types) are refused.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle_engine.config import ConfigError, DraftConfig
from eagle_engine.models.draft_io import export_state, save_draft
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.target import TargetModel
from eagle_engine.tools.inspect_draft import inspect_draft
from tests.test_draft_io import (
    Layout,
    assert_same_outputs,
    load,
    make_reference,
    outputs,
    report,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def layer_config(cfg: DraftConfig) -> dict:
    """The draft layer's Llama config, as transformers' LlamaConfig writes its keys."""
    return {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": None, "max_position_embeddings": 256,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}


def angelslim_config(cfg: DraftConfig) -> dict:
    """Tencent/AngelSlim `qwen3-1.7b-eagle3.json`, with the tiny head's shapes."""
    return {"architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama",
            "target_model_type": "qwen3", "torch_dtype": "bfloat16", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size,
            "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": 40960, "max_window_layers": 8,
            "num_attention_heads": cfg.num_heads, "num_hidden_layers": 1,
            "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
            "tie_word_embeddings": True, "transformers_version": "4.51.0", "use_cache": True,
            "use_sliding_window": False, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size}


def traineagle3_config(cfg: DraftConfig) -> dict:
    """SafeAILab/EAGLE `eagle/traineagle3/config.json` (with a Qwen3 target's rope_theta)."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
            "intermediate_size": cfg.intermediate_size, "max_position_embeddings": 2048,
            "model_type": "llama", "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": 1, "pad_token_id": 0,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size}


def speculators_config(cfg: DraftConfig, **head: object) -> dict:
    """An `Eagle3SpeculatorConfig` as speculators serializes it; `head` sets its head keys."""
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": None,
            "embed_requires_grad": False, "transformer_layer_config": layer_config(cfg),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]}},
            **head}


def modelopt_config(cfg: DraftConfig) -> dict:
    """The HF layout with `norm_before_fc` nested in `eagle_config` (vLLM PR #42143)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(cfg),
            "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": 32,
            "eagle_config": {"use_aux_hidden_state": True, "norm_before_fc": True,
                             "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}


def speculators_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}


@dataclass(frozen=True)
class Convention:
    reference: Layout  # the head in our own terms (DraftConfig.from_dict keys)
    config: Callable[[DraftConfig], dict]
    names: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = dict
    weights_file: str = "model.safetensors"
    with_target_embedding: bool = False  # write the target's embedding as the head's own
    aux_inputs: tuple[int, ...] = (2, 4, 5)  # target layer inputs fed to fc (8-layer target)
    recognised: str = ""  # what inspect-draft's `convention` line names


CONVENTIONS = {
    "angelslim_qwen3": Convention(
        Layout(dict(head_dim=16, rope_theta=1e6)), angelslim_config,
        weights_file="pytorch_model.bin", recognised="AngelSlim Eagle3LlamaForCausalLM"),
    "eagle_traineagle3_tengyunw": Convention(
        Layout(dict(rope_theta=1e6, rms_norm_eps=1e-5)), traineagle3_config,
        weights_file="pytorch_model.bin", recognised="architecture LlamaForCausalLM"),
    "speculators_llama": Convention(
        Layout(dict(norm_before_residual=True)),
        lambda cfg: speculators_config(cfg, norm_before_residual=True),
        speculators_names, with_target_embedding=True, recognised="vllm-project/speculators"),
    "speculators_wide_two_layers_norm_before_fc_norm_output": Convention(
        Layout(dict(hidden_size=48, target_hidden_size=32, num_hidden_layers=2, norm_output=True,
                    eagle_config={"norm_before_fc": True,
                                  "eagle_aux_hidden_state_layer_ids": [0, 2, 5]}),
               own_embed=True),
        lambda cfg: speculators_config(cfg, norm_before_residual=False, target_hidden_size=32,
                                       norm_before_fc=True, norm_output=True,
                                       eagle_aux_hidden_state_layer_ids=[1, 3, 6]),
        speculators_names, aux_inputs=(1, 3, 6), recognised="vllm-project/speculators"),
    "modelopt_norm_before_fc_in_eagle_config": Convention(
        Layout(dict(eagle_config={"norm_before_fc": True,
                                  "eagle_aux_hidden_state_layer_ids": [1, 3, 4]})),
        modelopt_config, recognised="SGLang / SpecForge LlamaForCausalLMEagle3"),
}


def write_head(ref: Eagle3Draft, target: TargetModel, convention: Convention,
               directory: Path) -> Path:
    state = export_state(ref)
    if convention.with_target_embedding:
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    state = convention.names(state)
    directory.mkdir(parents=True)
    if convention.weights_file.endswith(".bin"):
        torch.save(state, directory / convention.weights_file)
    else:
        save_file(state, str(directory / convention.weights_file))
    (directory / "config.json").write_text(json.dumps(convention.config(ref.cfg)))
    return directory


@dataclass
class Case:
    convention: Convention
    ref: Eagle3Draft
    path: Path
    loaded: Eagle3Draft


@pytest.fixture(scope="module", params=sorted(CONVENTIONS))
def case(request: pytest.FixtureRequest, tiny_target: TargetModel,
         tmp_path_factory: pytest.TempPathFactory) -> Case:
    convention = CONVENTIONS[request.param]
    ref = make_reference(tiny_target, convention.reference, seed=3)
    path = write_head(ref, tiny_target, convention, tmp_path_factory.mktemp(request.param) / "h")
    pickled = convention.weights_file.endswith(".bin")
    return Case(convention, ref, path, load(path, tiny_target, allow_pickle=pickled))


def test_loaded_head_equals_reference(case: Case, tiny_target: TargetModel) -> None:
    assert_same_outputs(case.loaded, case.ref)
    assert torch.equal(case.loaded.lm_head.weight, case.ref.lm_head.weight)
    got, want = case.loaded.cfg, case.ref.cfg
    for name in ("hidden_size", "target_hidden_size", "head_dim", "num_layers", "num_aux",
                 "draft_vocab_size", "rope_theta", "norm_before_residual", "norm_before_fc",
                 "norm_output", "fc_norm"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.resolve_aux_layer_ids(tiny_target.cfg) == case.convention.aux_inputs


def test_inspect_draft_names_the_convention(case: Case) -> None:
    r = report(inspect_draft(case.path, allow_pickle=True))
    assert case.convention.recognised in r["convention"], r["convention"]
    cfg = case.ref.cfg
    assert r["norm_before_residual"] == str(cfg.norm_before_residual).lower()
    assert r["norm_before_fc"] == str(cfg.norm_before_fc).lower()
    assert r["norm_output (recycled hidden is normed)"] == str(cfg.norm_output).lower()
    if case.ref.cfg.aux_layer_ids is None:  # the target's default, unknown without it
        assert r["aux layer ids (config, layer outputs)"] == "not set"
    else:
        inputs = r["aux layer ids (captured target layer inputs)"]
        assert inputs == str(list(case.convention.aux_inputs))
    assert r["ignored tensors"] == "none"
    own = case.convention.with_target_embedding or case.convention.reference.own_embed
    assert r["embed_tokens"] == ("in checkpoint" if own else "shared with the target")


def test_saved_in_our_format_loads_the_same(case: Case, tiny_target: TargetModel,
                                            tmp_path: Path) -> None:
    """`save_draft` writes the flags into the HF layout (aux ids back as layer outputs)."""
    save_draft(case.loaded, tiny_target.cfg, tmp_path / "ours", 256, dtype=torch.float32)
    again = load(tmp_path / "ours", tiny_target)
    for a, b in zip(outputs(again), outputs(case.ref)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert again.cfg.resolve_aux_layer_ids(tiny_target.cfg) == case.convention.aux_inputs


def test_angelslim_tied_flag_keeps_the_draft_vocab_lm_head(tiny_target: TargetModel,
                                                          tmp_path: Path) -> None:
    """`tie_word_embeddings: true` in AngelSlim's config is not a tie: its lm_head has
    draft_vocab_size rows and differs from the embedding."""
    convention = CONVENTIONS["angelslim_qwen3"]
    ref = make_reference(tiny_target, convention.reference, seed=3)
    loaded = load(write_head(ref, tiny_target, convention, tmp_path / "h"), tiny_target,
                  allow_pickle=True)
    assert loaded.cfg.raw["tie_word_embeddings"] is True
    assert tuple(loaded.lm_head.weight.shape) == (40, 32)
    assert loaded.cfg.head_dim == 16 != loaded.cfg.hidden_size // loaded.cfg.num_heads


def test_speculators_norm_before_residual_defaults_true_as_vllm_reads_it() -> None:
    cfg = speculators_config(DraftConfig.from_dict({
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "vocab_size": 96, "draft_vocab_size": 40}))
    assert DraftConfig.from_dict(cfg).norm_before_residual
    assert not DraftConfig.from_dict({**cfg, "norm_before_residual": False}).norm_before_residual
    hf = cfg["transformer_layer_config"]
    assert not DraftConfig.from_dict(hf).norm_before_residual  # HF layout: false when absent


@pytest.mark.parametrize("edit, named", [
    (dict(speculators_model_type="dflash"), ["speculators_model_type 'dflash'", "eagle3"]),
    (dict(transformer_layer_config=None), ["transformer_layer_config", "NoneType"]),
    ("qwen3", ["model_type 'qwen3'", "Llama layer"]),
])
def test_speculators_layouts_we_cannot_run_are_refused(edit: dict | str,
                                                       named: list[str]) -> None:
    cfg = speculators_config(DraftConfig.from_dict({
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "vocab_size": 96}))
    if edit == "qwen3":
        cfg["transformer_layer_config"]["model_type"] = "qwen3"
    else:
        cfg.update(edit)
    with pytest.raises(ConfigError) as e:
        DraftConfig.from_dict(cfg, "head/config.json")
    assert all(n in str(e.value) for n in named + ["head/config.json"]), str(e.value)
