"""Issue 2: bad input is refused with a `ConfigError` that names the file / key / limit and the
offending value: target checkpoints (missing, no config, malformed, unsupported, missing or
mis-shaped tensors, unsupported GGUF), requests (prompt over the context window, out-of-vocab
ids) and sampling parameters."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_engine.config import (
    ConfigError,
    EngineConfig,
    SamplingParams,
    TargetConfig,
    TreeParams,
)
from eagle_engine.engine import EagleEngine
from eagle_engine.models.loader import convert_gguf, load_target, resolve_target
from eagle_engine.models.target import TargetModel
from tests.helpers import ByteTokenizer, make_hf_target, random_head

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def ckpt(tiny_target_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny target checkpoint to break."""
    return Path(shutil.copytree(tiny_target_dir, tmp_path / "ckpt"))


def edit_tensors(directory: Path, **changes: torch.Tensor | None) -> None:
    """Rewrite model.safetensors: name -> new tensor, or None to delete it."""
    sd = load_file(directory / "model.safetensors")
    for name, t in changes.items():
        name = name.replace("__", ".")
        if t is None:
            del sd[name]
        else:
            sd[name] = t
    save_file(sd, directory / "model.safetensors")


def edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def load_error(directory: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_target(directory, torch.float32)
    return str(e.value)


def test_good_copy_loads(ckpt: Path) -> None:
    assert load_target(ckpt, torch.float32).cfg.num_layers == 8


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "ckpt"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        resolve_target(str(missing))


def test_directory_without_config(tmp_path: Path) -> None:
    msg = load_error(tmp_path)
    assert str(tmp_path) in msg and "config.json" in msg


def test_malformed_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"hidden_size": 32,')
    msg = load_error(ckpt)
    assert str(ckpt / "config.json") in msg and "malformed JSON" in msg


def test_config_missing_key(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_attention_heads"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = load_error(ckpt)
    assert "config.json" in msg and "num_attention_heads" in msg


@pytest.mark.parametrize("changes, named", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
])
def test_unsupported_config(ckpt: Path, changes: dict, named: str) -> None:
    edit_config(ckpt, **changes)
    assert named in load_error(ckpt)


def test_no_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    msg = load_error(ckpt)
    assert str(ckpt) in msg and "safetensors" in msg


def test_corrupt_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    assert str(ckpt / "model.safetensors") in load_error(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    edit_tensors(ckpt, **{"model.layers.3.mlp.down_proj.weight": None})
    msg = load_error(ckpt)
    assert "layers.3.mlp.down_proj.weight" in msg and "missing" in msg


def test_wrong_tensor_shape(ckpt: Path) -> None:
    edit_tensors(ckpt, **{"model.norm.weight": torch.ones(31)})
    msg = load_error(ckpt)
    assert "norm.weight" in msg and "(31,)" in msg and "(32,)" in msg


def test_wrong_width_of_fused_projection(ckpt: Path) -> None:
    edit_tensors(ckpt, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 30)})
    msg = load_error(ckpt)
    assert "layers.0.self_attn.k_proj.weight (16, 30)" in msg
    assert "layers.0.self_attn.q_proj.weight (32, 32)" in msg


def test_wrong_rows_of_fused_projection(ckpt: Path) -> None:
    edit_tensors(ckpt, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(60, 32)})
    msg = load_error(ckpt)
    assert "layers.2.mlp.gate_up_proj.weight" in msg and "(124, 32)" in msg and "(128, 32)" in msg


def test_llama_output_bias_is_refused(tmp_path: Path) -> None:
    """Llama attention_bias=True also biases o_proj, which our attention does not implement:
    loading must refuse instead of silently dropping the tensors."""
    directory = make_hf_target(tmp_path / "biased", attention_bias=True)
    assert "self_attn.o_proj.bias" in load_error(directory)


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    with pytest.raises(ConfigError) as e:
        convert_gguf(path, tmp_path / "converted")
    assert "'mamba'" in str(e.value) and str(path) in str(e.value)
    with pytest.raises(ConfigError, match="'mamba'"):
        resolve_target(str(path), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "converted").exists() and not (tmp_path / "cache").exists()


def test_gguf_not_readable(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGML garbage")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        resolve_target(str(path), cache_dir=tmp_path / "cache")


@pytest.fixture(scope="module")
def engine(tiny_target: TargetModel) -> EagleEngine:
    """Baseline + one random in-memory head over the shared tiny target, context 64."""
    heads = {"head": random_head(tiny_target.cfg)}
    return EagleEngine(tiny_target, ByteTokenizer(), heads, EngineConfig(target="tiny", max_len=64))


def test_prompt_longer_than_context(engine: EagleEngine) -> None:
    params = SamplingParams(max_new_tokens=4)
    tree = TreeParams(topk=2, num_steps=3, num_draft_tokens=8)
    with pytest.raises(ConfigError) as e:  # the verify tree needs 8 rows after the prompt
        engine.generate([5] * 56, params, tree, "head")
    assert "56 tokens" in str(e.value) and "context window is 64" in str(e.value)
    assert "at most 55" in str(e.value)
    edge = engine.generate([5] * 55, params, tree, "head")  # accepted; the window fills up
    assert edge.finished == "context" and 1 <= len(edge.token_ids) < 4
    assert engine.generate([5] * 40, params, tree, "head").finished == "length"
    with pytest.raises(ConfigError, match="64 tokens but the context window is 64"):
        engine.generate([5] * 64, params)
    assert len(engine.generate([5] * 62, params).token_ids) >= 1


@pytest.mark.parametrize("prompt, named", [([], "empty"), ([5, 96, 7], "[96]"),
                                           ([5, -1], "[-1]")])
def test_bad_prompt_ids(engine: EagleEngine, prompt: list[int], named: str) -> None:
    with pytest.raises(ConfigError) as e:
        engine.generate(prompt, SamplingParams(max_new_tokens=2))
    assert named in str(e.value)


def test_unknown_head(engine: EagleEngine) -> None:
    with pytest.raises(ConfigError, match=r"'nope'.*\['head'\]"):
        engine.generate([5, 6], SamplingParams(max_new_tokens=2), TreeParams(), "nope")


@pytest.mark.parametrize("kwargs, named", [
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    (dict(max_new_tokens=-3), "got -3"),
    (dict(max_new_tokens=2.5), "got 2.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=-0.5), "got -0.5"),
    (dict(temperature=float("inf")), "got inf"),
    (dict(temperature=0.0, top_p=0.9), "top_p=0.9"),
    (dict(temperature=0.0, top_k=5), "top_k=5"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(temperature=1.0, top_p=1.5), "got 1.5"),
    (dict(temperature=1.0, top_p=float("nan")), "got nan"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an integer >= 0"),
])
def test_bad_sampling_params(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kwargs)
    assert named in str(e.value)


def test_good_sampling_params() -> None:
    assert SamplingParams(temperature=0.7, top_p=0.9, top_k=20).greedy is False
    assert SamplingParams().greedy is True


@pytest.mark.parametrize("kwargs, named", [(dict(max_len=8), "max_len must be >= 16, got 8"),
                                           (dict(dtype="int4"), "'int4'")])
def test_bad_engine_config(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert named in str(e.value)


@pytest.mark.parametrize("avx512_bf16, amx, cpu_dtype", [(False, False, "fp32"),
                                                         (True, False, "bf16"),
                                                         (False, True, "bf16")])
def test_auto_dtype_is_bf16_only_where_bf16_is_native(monkeypatch: pytest.MonkeyPatch,
                                                      avx512_bf16: bool, amx: bool,
                                                      cpu_dtype: str) -> None:
    """`dtype="auto"` (the default) resolves on construction for dense weights: fp32 on a CPU
    without AVX512-BF16 or AMX (bf16 products of several tokens are emulated there), bf16 on
    other CPUs and CUDA GPUs from Ampere on, fp16 on older GPUs; q4 weights (the CPU default for
    GGUF targets) run fp32; an explicit dtype is kept."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert EngineConfig(weights="dense").dtype == cpu_dtype
    assert EngineConfig(weights="q4").dtype == "fp32"
    assert EngineConfig(device="cuda").dtype == "bf16"  # a GPU this process cannot see
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    assert EngineConfig(device="cuda").dtype == "fp16"  # a T4: no bf16 tensor cores
    assert EngineConfig(dtype="bf16").dtype == "bf16" and EngineConfig(dtype="fp32").dtype == "fp32"
    # the dense twin of a q4 target (tune, the app) takes the asked dtype, not q4's fp32
    assert EngineConfig(weights="q4").other_weights("auto").dtype == cpu_dtype
    assert EngineConfig(weights="dense").other_weights("auto").weights == "q4"


def test_target_config_from_dict_reads_qwen2_bias_and_eos_list() -> None:
    cfg = TargetConfig.from_dict({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                                  "num_hidden_layers": 7, "num_attention_heads": 2,
                                  "model_type": "qwen2", "eos_token_id": [3, 4],
                                  "architectures": ["Qwen2ForCausalLM"]})
    assert cfg.attention_bias and cfg.eos_token_ids == (3, 4) and cfg.num_kv_heads == 2
    assert cfg.default_aux_layer_ids() == (2, 3, 4)
