"""`python -m eagle_engine inspect-draft HEAD [--target T]`: what an EAGLE-3 head resolves to.

HEAD is a directory, a bundled head's name (as the app and `bench --heads` name it) or a hub id.

Reads the head's config.json and only the tensor headers (names, shapes, dtypes) of its weights:
no tensor data is loaded and no target is needed. The tensors go through the loader's own name
normalization on the meta device, so the report shows exactly what `load_draft` would build, and
a checkpoint `load_draft` would refuse is refused here with the same kind of message. With a
target, the head is also checked against it and default aux layers are resolved. The report
names the published convention the config follows (`config_convention`: speculators, AngelSlim,
SGLang / SpecForge, EAGLE) and the naming of its tensors.
Not here: loading a head for inference (`models/draft_io.py`).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ConfigError, DraftConfig, TargetConfig
from ..engine import head_source
from ..io_struct import EagleDraftExtendInput, EagleDraftInput
from ..models.draft_io import IGNORED, normalize_names, resolve_draft, weight_files
from ..models.draft_model import Eagle3Draft
from ..models.loader import read_config, resolve_target

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
FROM_TARGET = {"embed_tokens.weight", "lm_head.weight", "d2t"}  # optional in a checkpoint


def read_tensor_headers(directory: Path, allow_pickle: bool
                        ) -> tuple[str, dict[str, torch.Tensor]]:
    """-> (weights file names, name -> meta tensor with the stored shape and dtype)."""
    files = weight_files(directory, allow_pickle)
    names = ", ".join(f.name for f in files)
    if files[0].suffix == ".bin":
        return names, torch.load(files[0], map_location="meta", weights_only=True)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    info = sf.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(info.get_dtype(), torch.float32)
                    out[name] = torch.empty(info.get_shape(), dtype=dtype, device="meta")
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types
            raise ConfigError(f"{f}: cannot read safetensors file ({e})") from e
    return names, out


def config_convention(cfg: DraftConfig) -> str:
    """Which published config layout the head's config.json follows."""
    if "speculators_model_type" in cfg.raw:
        return ("vllm-project/speculators (transformer_layer_config; aux ids are layer inputs, "
                "as vLLM reads them)")
    arch = (cfg.raw.get("architectures") or ["unknown"])[0]
    if arch == "Eagle3LlamaForCausalLM":
        return "AngelSlim Eagle3LlamaForCausalLM (HF layout; aux ids are layer outputs)"
    if arch == "LlamaForCausalLMEagle3":
        return "SGLang / SpecForge LlamaForCausalLMEagle3 (HF layout; aux ids are layer outputs)"
    return f"EAGLE HF layout, architecture {arch} (aux ids are layer outputs)"


def naming_convention(names: list[str]) -> str:
    bare = [n.removeprefix("model.") for n in names]
    if any(re.match(r"midlayer\.\d+\.", n) for n in bare):
        kind = "midlayer.{i}.*"
    elif any(n.startswith("midlayer.") for n in bare):
        kind = "midlayer.*"
    else:
        kind = "layers.{i}.*"
    if any(n.startswith("model.") for n in names):
        kind += " with model. prefix"
    if any(n.startswith("aux_norm_") for n in bare):
        kind += ", legacy aux_norm_{low,mid,high}"
    return kind


def check_tensors(model: Eagle3Draft, sd: dict[str, torch.Tensor], cfg: DraftConfig,
                  directory: Path) -> list[str]:
    """Refuse what `load_draft` would refuse; -> names it would ignore."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd and k not in FROM_TARGET]
    if missing:
        raise ConfigError(f"{directory}: missing tensors {missing}")
    for k, v in sd.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise ConfigError(f"{directory}: tensor {k} has shape {tuple(v.shape)}, "
                              f"expected {tuple(expected[k].shape)}")
    if "lm_head.weight" not in sd and cfg.draft_vocab_size != cfg.vocab_size:
        raise ConfigError(f"{directory}: no lm_head.weight and draft_vocab_size "
                          f"{cfg.draft_vocab_size} != target vocab {cfg.vocab_size}")
    return sorted(k for k in sd if k not in expected and k not in IGNORED)


def parameter_counts(model: Eagle3Draft) -> dict[str, int]:
    counts = {"fc": 0, "layers": 0, "lm_head": 0, "norm": 0}
    for name, p in model.named_parameters():
        group = name.split(".", 1)[0]
        if group == "embed_tokens":
            continue
        key = "fc" if group in ("fc_norm", "input_norm") else group
        counts[key] = counts.get(key, 0) + p.numel()
    counts["total"] = sum(counts.values())
    return counts


def aux_lines(cfg: DraftConfig, target_cfg: TargetConfig | None) -> list[str]:
    if not cfg.use_aux_hidden_state:
        return ["aux layer ids: none (aux hidden states off: the target's final hidden is fed)"]
    if target_cfg is not None:
        captured: tuple[int, ...] | None = cfg.resolve_aux_layer_ids(target_cfg)
    else:
        captured = cfg.aux_layer_ids
    if captured is None:
        return ["aux layer ids (config, layer outputs): not set",
                "aux layer ids (captured target layer inputs): target default (2, L//2, L-3)"]
    source = "config" if cfg.aux_layer_ids is not None else "target default"
    return [f"aux layer ids ({source}, layer outputs): {[i - 1 for i in captured]}",
            f"aux layer ids (captured target layer inputs): {list(captured)}"]


def inspect_draft(path: str | Path, target: str | None = None, allow_pickle: bool = False) -> str:
    """A human-readable report of the resolved head config (one `key: value` per line)."""
    directory = resolve_draft(head_source(str(path)))
    cfg = DraftConfig.from_dict(read_config(directory), str(directory / "config.json"))
    target_cfg = None
    if target is not None:
        target_dir = resolve_target(target)
        target_cfg = TargetConfig.from_dict(read_config(target_dir),
                                            str(target_dir / "config.json"))
        cfg.check_target(target_cfg)
    files, raw = read_tensor_headers(directory, allow_pickle)
    sd = normalize_names(raw)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, 1)
    ignored = check_tensors(model, sd, cfg, directory)
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in raw.values()
                     if t.is_floating_point()})
    counts = parameter_counts(model)
    scaling = cfg.rope_scaling or {}

    def source(name: str, otherwise: str) -> str:
        return "in checkpoint" if name in sd else otherwise

    lines = [
        f"EAGLE-3 draft head: {directory}",
        f"architecture: {(cfg.raw.get('architectures') or ['unknown'])[0]}",
        f"convention: {config_convention(cfg)}",
        f"weights: {files} (names: {naming_convention(list(raw))}; dtype: {', '.join(stored)})",
        f"layers: {cfg.num_layers}",
        f"hidden_size: {cfg.hidden_size}, intermediate_size: {cfg.intermediate_size}, "
        f"heads: {cfg.num_heads} (kv {cfg.num_kv_heads}, head_dim {cfg.head_dim})",
        f"rope: theta {cfg.rope_theta:g}, scaling "
        f"{scaling.get('rope_type', scaling.get('type', 'none'))}",
        f"use_aux_hidden_state: {str(cfg.use_aux_hidden_state).lower()}",
        f"num_aux: {cfg.num_aux if cfg.use_aux_hidden_state else 0}",
        *aux_lines(cfg, target_cfg),
        f"fc_norm: {str(cfg.fc_norm and cfg.use_aux_hidden_state).lower()}",
        f"fc bias: {str(cfg.fc_bias and cfg.use_aux_hidden_state).lower()}",
        f"norm_before_fc: {str(cfg.norm_before_fc and cfg.use_aux_hidden_state).lower()}",
        f"norm_before_residual: {str(cfg.norm_before_residual).lower()}",
        f"norm_output (recycled hidden is normed): {str(cfg.norm_output).lower()}",
        f"target_hidden_size: {cfg.target_hidden_size}",
        f"vocab: target {cfg.vocab_size}, draft {cfg.draft_vocab_size} "
        f"(d2t: {'in checkpoint' if 'd2t' in sd else 'absent, identity'})",
        f"embed_tokens: {source('embed_tokens.weight', 'shared with the target')}",
        f"lm_head: {source('lm_head.weight', 'copied from the target')}",
        f"width EagleDraftExtendInput.hidden_size_for (target features): "
        f"{EagleDraftExtendInput.hidden_size_for(cfg)}",
        f"width EagleDraftInput.hidden_size_for (recycled draft hidden): "
        f"{EagleDraftInput.hidden_size_for(cfg)}",
        f"parameters fc: {counts['fc']:,}",
        f"parameters layers: {counts['layers']:,}",
        f"parameters lm_head: {counts['lm_head']:,}",
        f"parameters total (excluding embedding): {counts['total']:,}",
        f"ignored tensors: {', '.join(ignored) if ignored else 'none'}",
    ]
    if target_cfg is not None:
        lines.append(f"target: {target} ({target_cfg.num_layers} layers, hidden "
                     f"{target_cfg.hidden_size}, vocab {target_cfg.vocab_size}): compatible")
    return "\n".join(lines)
