"""EAGLE-3 head checkpoints: read every published naming convention, write the standard HF one.

Reads a directory (or hub id) with config.json and model.safetensors (`pytorch_model.bin` only
with `allow_pickle=True`, since it unpickles). Accepted names: `midlayer.*` (official single
layer: EAGLE, AngelSlim, Tengyunw), `midlayer.{i}.*` and `layers.{i}.*` (multi-layer exports,
vllm-project/speculators), optional `model.` prefix, legacy `aux_norm_{low,mid,high}`,
`input_norm` (norm_before_fc); q/k/v and gate/up are fused on load. Configs: the HF layout and
the speculators one (`DraftConfig.from_dict`). A head's own `embed_tokens.weight` is used when
present (speculators saves it); `tie_word_embeddings` of a head's config is not read: AngelSlim's
Qwen3-1.7B/4B heads set it true beside a `draft_vocab_size`-row `lm_head.weight`, which is the
head's output layer. Writes our heads as `LlamaForCausalLMEagle3` with `midlayer.*` (one layer)
or `layers.{i}.*` names, `d2t` and `t2d`, so SGLang and vLLM load them unchanged (SGLang reads
neither `norm_before_residual` nor `norm_output`). Not here: the network (`draft_model.py`).
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ConfigError, DraftConfig, TargetConfig
from .draft_model import Eagle3Draft
from .layers import Rope
from .loader import fuse_rows, load_state, read_config, read_tensors, safetensors_files

log = logging.getLogger(__name__)

LEGACY_AUX_NORMS = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                    "aux_norm_high": "fc_norm.2"}
IGNORED = {"t2d"}


def resolve_draft(spec: str | Path) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(spec).startswith((".", "/", "~")) or str(spec).count("/") != 1:
        raise ConfigError(f"draft {str(spec)!r} is neither a directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(spec), allow_patterns=["*.json", "*.safetensors"]))


def normalize_names(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map any accepted convention to `layers.{i}.*` / `fc_norm.{j}` with fused projections."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        name = re.sub(r"^midlayer\.(\d+)\.", r"layers.\1.", name)
        name = re.sub(r"^midlayer\.", "layers.0.", name)
        for old, new in LEGACY_AUX_NORMS.items():
            if name.startswith(old + "."):
                name = new + name[len(old):]
        m = re.match(r"^layers\.(\d+)\.hidden_norm\.(.*)$", name)
        if m and int(m.group(1)) > 0:  # SGLang names later layers' pre-norm `hidden_norm`
            name = f"layers.{m.group(1)}.input_layernorm.{m.group(2)}"
        sd[name] = t
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if re.search(r"\.self_attn\.[kv]_proj\.|\.mlp\.up_proj\.", name):
            continue
        if ".self_attn.q_proj." in name:
            base, kind = name.rsplit(".q_proj.", 1)
            parts = {f"{base}.{p}_proj.{kind}": sd.get(f"{base}.{p}_proj.{kind}") for p in "qkv"}
            if any(p is None for p in parts.values()):
                raise ConfigError(f"{base}: q_proj.{kind} present but k_proj/v_proj missing")
            out[f"{base}.qkv_proj.{kind}"] = fuse_rows(parts)
        elif ".mlp.gate_proj." in name:
            base = name.rsplit(".gate_proj.", 1)[0]
            up = sd.get(f"{base}.up_proj.weight")
            if up is None:
                raise ConfigError(f"{base}: gate_proj present but up_proj missing")
            out[f"{base}.gate_up_proj.weight"] = fuse_rows({f"{base}.gate_proj.weight": t,
                                                             f"{base}.up_proj.weight": up})
        else:
            out[name] = t
    return out


def weight_files(directory: Path, allow_pickle: bool) -> list[Path]:
    """A head's weights: its safetensors files (single or sharded), else `pytorch_model.bin`,
    which is unpickled only with `allow_pickle`."""
    if (directory / "model.safetensors").is_file() or (
            directory / "model.safetensors.index.json").is_file():
        return safetensors_files(directory)
    binary = directory / "pytorch_model.bin"
    if not binary.is_file():
        raise ConfigError(f"{directory}: no model.safetensors or pytorch_model.bin")
    if not allow_pickle:
        raise ConfigError(f"{directory}: only pytorch_model.bin found; loading it unpickles "
                          "arbitrary code, pass allow_pickle=True (--allow-pickle) to accept")
    return [binary]


def load_draft(spec: str | Path, target_cfg: TargetConfig, target_embed: torch.nn.Embedding,
               target_lm_head: torch.nn.Linear, max_len: int, dtype: torch.dtype,
               device: str | torch.device = "cpu", allow_pickle: bool = False) -> Eagle3Draft:
    """Load an EAGLE-3 head for `target_cfg`; the embedding is shared with the target unless the
    checkpoint carries its own, the lm_head is copied from the target when absent."""
    directory = resolve_draft(spec)
    cfg = DraftConfig.from_dict(read_config(directory), str(directory / "config.json"))
    cfg.check_target(target_cfg)
    files = weight_files(directory, allow_pickle)
    raw = (torch.load(files[0], map_location="cpu", weights_only=True)
           if files[0].suffix == ".bin" else read_tensors(files))
    sd = normalize_names(raw)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, max_len)
    expected = set(model.state_dict())
    unknown = sorted(k for k in sd if k not in expected and k not in IGNORED)
    if unknown:
        log.warning("%s: ignoring unknown tensors %s", directory, unknown)
    if "embed_tokens.weight" not in sd:
        sd["embed_tokens.weight"] = target_embed.weight
    if "lm_head.weight" not in sd:
        if cfg.draft_vocab_size != target_cfg.vocab_size:
            raise ConfigError(f"{directory}: no lm_head.weight and draft_vocab_size "
                              f"{cfg.draft_vocab_size} != target vocab {target_cfg.vocab_size}")
        sd["lm_head.weight"] = target_lm_head.weight
    if "d2t" not in sd:
        sd["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    load_state(model, sd, dtype, device, str(directory))
    if sd["embed_tokens.weight"] is target_embed.weight:
        model.share_embedding(target_embed)
    model.rope = Rope(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling).to(device)
    hot = model.hot_ids
    if hot.min() < 0 or hot.max() >= cfg.vocab_size or hot.unique().numel() != hot.numel():
        raise ConfigError(f"{directory}: d2t maps draft ids outside the target vocab or twice")
    return model.eval()


def export_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """Our module -> standard checkpoint tensors (unfused, `midlayer.` for one layer). The
    embedding is written only when the head has its own (not shared with the target)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in model.state_dict().items():
        if name.startswith("embed_tokens.") and model.embedding_shared or name == "d2t":
            continue
        if cfg.num_layers == 1:
            name = name.replace("layers.0.", "midlayer.")
        if ".qkv_proj." in name:
            base, kind = name.rsplit(".qkv_proj.", 1)
            q, k, v = t.split([q_out, kv_out, kv_out])
            out.update({f"{base}.q_proj.{kind}": q, f"{base}.k_proj.{kind}": k,
                        f"{base}.v_proj.{kind}": v})
        elif ".gate_up_proj." in name:
            base = name.rsplit(".gate_up_proj.", 1)[0]
            gate, up = t.chunk(2)
            out.update({f"{base}.gate_proj.weight": gate, f"{base}.up_proj.weight": up})
        else:
            out[name] = t
    out["d2t"] = model.d2t.clone()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[model.hot_ids.cpu()] = True
    out["t2d"] = t2d
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def draft_config_dict(cfg: DraftConfig, target: TargetConfig, max_len: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict:
    """The HF EAGLE-3 config.json for a head we trained, stored in `dtype`."""
    aux = cfg.resolve_aux_layer_ids(target)
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "attention_bias": cfg.attention_bias,
        "max_position_embeddings": max_len, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "bias": cfg.fc_bias,
        "fc_norm": cfg.fc_norm,
        "norm_before_fc": cfg.norm_before_fc,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_output": cfg.norm_output,
        "eagle_config": {"use_aux_hidden_state": cfg.use_aux_hidden_state,
                         **({"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
                            if aux else {})},
    }


def save_draft(model: Eagle3Draft, target: TargetConfig, out_dir: Path, max_len: int,
               dtype: torch.dtype = torch.bfloat16) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v)
             for k, v in export_state(model).items()}
    save_file(state, str(out_dir / "model.safetensors"))
    cfg = draft_config_dict(model.cfg, target, max_len, dtype)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
