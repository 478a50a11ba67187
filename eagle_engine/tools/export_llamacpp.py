"""`python -m eagle_engine export-llamacpp`: an EAGLE-3 head as llama.cpp's EAGLE-3 GGUF.

Writes, with the `gguf` package, what llama.cpp's own converter (`convert_hf_to_gguf.py HEAD
--target-model-dir TARGET --outtype bf16`, llama.cpp as vendored by llama-cpp-python 0.3.36)
writes for the same head: architecture `eagle3`, its hyperparameters, `eagle3.target_layers`
(the target layers whose INPUTS feed the head), the target's tokenizer (copied from the
target's GGUF), 2-D weights in bf16 with q/k rows in llama.cpp's RoPE order, norms in f32, and
`d2t` as absolute target ids in int64. `tests/test_export_llamacpp.py` checks the keys, shapes
and bytes against a file that converter wrote.

llama.cpp's EAGLE-3 runs one draft layer over exactly three aux states, with neither per-chunk
`fc_norm`, nor a recycled normed state (`norm_output`), nor biases; a head outside that is
refused with its values named. The head is read through the engine's own loader, so every
convention `inspect-draft` recognises exports alike.
Not here: running llama.cpp (`benchmarks/peers.py`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, DraftConfig, TargetConfig
from ..engine import head_source
from ..models.draft_io import export_state, load_draft, read_config, resolve_draft
from ..models.loader import bundled_gguf_path, load_target, resolve_target

ARCH = "eagle3"
LAYER = "midlayer."
NAMES = {  # standard EAGLE-3 tensor -> llama.cpp's
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_norm.weight": "enc.output_norm.weight",
    LAYER + "input_layernorm.weight": "blk.0.attn_norm.weight",
    LAYER + "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    LAYER + "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    LAYER + "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    LAYER + "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    LAYER + "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    LAYER + "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    LAYER + "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    LAYER + "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    LAYER + "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
SKIPPED = ("t2d", "d2t")  # t2d is unused by llama.cpp; d2t is written as absolute ids
FILE_TYPE_BF16 = 32  # llama.cpp's LLAMA_FTYPE_MOSTLY_BF16


def check_exportable(cfg: DraftConfig, source: str) -> None:
    """Refuse what llama.cpp's EAGLE-3 cannot run, naming the key and its value."""
    problems = [f"{key}={value}" for key, value, ok in (
        ("num_hidden_layers", cfg.num_layers, cfg.num_layers == 1),
        ("use_aux_hidden_state", cfg.use_aux_hidden_state, cfg.use_aux_hidden_state),
        ("aux hidden states", cfg.num_aux, cfg.num_aux == 3),
        ("fc_norm", cfg.fc_norm, not cfg.fc_norm),
        ("norm_output", cfg.norm_output, not cfg.norm_output),
        ("bias", cfg.fc_bias, not cfg.fc_bias),
        ("attention_bias", cfg.attention_bias, not cfg.attention_bias),
        ("rope_scaling", cfg.rope_scaling, cfg.rope_scaling is None)) if not ok]
    if problems:
        raise ConfigError(
            f"{source}: llama.cpp's EAGLE-3 takes one layer over three aux states, without "
            f"fc_norm, norm_output, biases or rope scaling; this head has {', '.join(problems)}")


def rope_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows [heads * d, in] from HF's half-split RoPE layout to llama.cpp's interleaved
    one (its converter's `LlamaModel.permute`)."""
    halves = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])  # [h, 2, d/2, in]
    return halves.swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict[str, torch.Tensor], cfg: DraftConfig
                 ) -> list[tuple[str, np.ndarray, object]]:
    """(llama.cpp name, array, ggml type) in the converter's order: bf16 bits for 2-D weights,
    f32 for norms, then d2t as int64 target ids."""
    from gguf import GGMLQuantizationType as Q

    unknown = sorted(set(state) - set(NAMES) - set(SKIPPED))
    if unknown:
        raise ConfigError(f"tensors llama.cpp's EAGLE-3 has no place for: {unknown}")
    out = []
    for name, t in state.items():
        if name in SKIPPED:
            continue
        if name.endswith("q_proj.weight"):
            t = rope_order(t, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            t = rope_order(t, cfg.num_kv_heads)
        if t.dim() == 1:
            out.append((NAMES[name], t.float().numpy(), Q.F32))
        else:
            out.append((NAMES[name], t.to(torch.bfloat16).view(torch.int16).numpy(), Q.BF16))
    ids = state["d2t"].long() + torch.arange(state["d2t"].numel())  # [Vd] target ids
    out.append(("d2t", ids.numpy(), Q.I64))
    return out


def export_llamacpp(head: str | Path, out: Path, target: str = "bundled") -> Path:
    """Write `head` (a bundled head's name or a directory) as llama.cpp's EAGLE-3 GGUF for
    `target` ("bundled" or a .gguf file: its tokenizer is copied)."""
    import gguf

    gguf_path = bundled_gguf_path() if target == "bundled" else Path(target)
    if gguf_path.suffix != ".gguf" or not gguf_path.is_file():
        raise ConfigError(f"--target {target!r}: export-llamacpp needs 'bundled' or a .gguf "
                          "file, whose tokenizer the head's GGUF carries")
    directory = resolve_draft(head_source(str(head)))
    cfg = DraftConfig.from_dict(read_config(directory), str(directory / "config.json"))
    check_exportable(cfg, str(directory))
    tmodel = load_target(resolve_target(target if target == "bundled" else str(gguf_path)),
                         torch.float32)
    tcfg: TargetConfig = tmodel.cfg
    draft = load_draft(directory, tcfg, tmodel.embed_tokens, tmodel.lm_head, 16, torch.bfloat16)
    state = export_state(draft)
    reader = gguf.GGUFReader(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, ARCH)
    w.add_array(f"{ARCH}.target_layers", list(cfg.resolve_aux_layer_ids(tcfg)))
    w.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", cfg.norm_before_residual)
    w.add_bool(f"{ARCH}.norm_before_fc", cfg.norm_before_fc)
    w.add_string("general.type", "model")
    w.add_string("general.name", directory.name)
    for key, value in (("block_count", cfg.num_layers),
                       ("context_length", int(cfg.raw.get("max_position_embeddings", 2048))),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_heads),
                       ("attention.head_count_kv", cfg.num_kv_heads)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{ARCH}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{ARCH}.attention.value_length", cfg.head_dim)
    w.add_uint32("general.file_type", FILE_TYPE_BF16)
    w.add_uint32(f"{ARCH}.vocab_size", cfg.vocab_size)
    w.add_uint32(f"{ARCH}.rope.dimension_count", cfg.head_dim)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, value, field.types[0], sub)
    for name, array, qtype in gguf_tensors(state, cfg):
        w.add_tensor(name, array, raw_shape=list(array.shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
