"""Tiny random models for tests: an HF Llama or Qwen3 target saved to disk, our own modules
built from it, random EAGLE-3 heads in any checkpoint convention, and the acceptance rules read
back on the host (the scheduler reads them in its one packed read, `accept.readback_parts`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_engine.config import DraftConfig, EngineConfig, SamplingParams, TargetConfig
from eagle_engine.engine import EagleEngine
from eagle_engine.io_struct import EagleVerifyInput, EagleVerifyOutput
from eagle_engine.kernels import TORCH, StepOps
from eagle_engine.models.draft_io import draft_config_dict, export_state
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.loader import load_target
from eagle_engine.verify import greedy_acceptance, sampled_acceptance

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


class ByteTokenizer:
    """Minimal tokenizer: id = byte + 3 (0 pad, 1 bos, 2 eos), decode skips specials."""

    eos_token_id = 2
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(i - 3 for i in ids if 3 <= i < 259)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else "")
        return [1] + [b + 3 for b in text.encode()][:40]

    def convert_tokens_to_ids(self, toks):
        return [2 for _ in toks]


def make_hf_target(directory: Path, seed: int = 0, weight_scale: float = 3.0,
                   **overrides) -> Path:
    """Save a random transformers LlamaForCausalLM (safetensors) into `directory`.
    `weight_scale` multiplies every matrix: the default 3.0 makes logits peaky (no greedy
    near-ties) but greedy text collapses into repeats; 1.0 gives varied greedy continuations."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(weight_scale if p.dim() > 1 else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def random_head(target_cfg: TargetConfig, seed: int = 0, num_layers: int = 1,
                use_aux: bool = True, num_aux: int = 3, draft_vocab: int | None = None,
                fc_norm: bool = False, aux_ids: list[int] | None = None,
                intermediate_size: int = 48, norm_output: bool = False,
                norm_before_fc: bool = False) -> Eagle3Draft:
    torch.manual_seed(seed)
    raw = {"hidden_size": target_cfg.hidden_size, "intermediate_size": intermediate_size,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": num_layers,
           "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab,
           "rms_norm_eps": 1e-6, "fc_norm": fc_norm, "norm_output": norm_output,
           "norm_before_fc": norm_before_fc,
           "eagle_config": {"use_aux_hidden_state": use_aux}}
    if num_aux != 3 or aux_ids:
        ids = aux_ids or list(range(1, 1 + num_aux))
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    cfg = DraftConfig.from_dict(raw)
    model = Eagle3Draft(cfg, 1024)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        if draft_vocab:
            used = torch.randperm(target_cfg.vocab_size)[:draft_vocab].sort().values
            model.d2t.copy_(used - torch.arange(draft_vocab))
    return model.eval()


def save_head(model: Eagle3Draft, target_cfg: TargetConfig, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = export_state(model)
    state.pop("embed_tokens.weight")  # random heads draft with the target's embedding
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(draft_config_dict(model.cfg, target_cfg,
                                                                        1024)))
    return directory


def make_hf_qwen3_target(directory: Path, seed: int = 0, weight_scale: float = 3.0,
                         **overrides) -> Path:
    """Save a random transformers Qwen3ForCausalLM (safetensors) into `directory`: `TINY`
    shapes with head_dim 16 (not hidden / heads = 8) unless overridden, every norm weight
    (q_norm and k_norm included) random around 1, matrices times `weight_scale` (see
    `make_hf_target`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 16, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.mul_(weight_scale)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def tiny_engine(tmp: Path, heads: dict[str, dict] | None = None, dtype: str = "fp32",
                max_len: int = 256, seed: int = 0, weight_scale: float = 3.0,
                weights: str = "auto", family: str = "llama",
                **target_overrides) -> EagleEngine:
    """Engine over a tiny random target (`family` llama: `make_hf_target`, qwen3:
    `make_hf_qwen3_target`) with random heads (name -> random_head kwargs)."""
    make = {"llama": make_hf_target, "qwen3": make_hf_qwen3_target}[family]
    target_dir = make(tmp / "target", seed, weight_scale, **target_overrides)
    target = load_target(target_dir, torch.float32, "cpu", max_len)
    paths = []
    for name, kw in (heads or {"head": {}}).items():
        paths.append(str(save_head(random_head(target.cfg, **kw), target.cfg, tmp / name)))
    engine = EagleEngine.load(EngineConfig(target=str(target_dir), drafts=tuple(paths),
                                           dtype=dtype, max_len=max_len, weights=weights),
                               ByteTokenizer())
    return engine


def accept_on_host(vout: EagleVerifyOutput) -> tuple[torch.Tensor, int]:
    """-> (accepted node path [num_accepted + 1] root first, bonus token), read on the host."""
    n = int(vout.num_accepted)
    return vout.accepted_nodes[:n + 1], int(vout.emitted[n])


def accept_greedy(vin: EagleVerifyInput, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`verify.greedy_acceptance`, read back: (accepted node path root first, bonus token)."""
    return accept_on_host(greedy_acceptance(vin, logits))


def accept_sampled(vin: EagleVerifyInput, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None, ops: StepOps = TORCH
                   ) -> tuple[torch.Tensor, int]:
    """`verify.sampled_acceptance` with the step backend `ops`, read back: (accepted node path
    root first, bonus token)."""
    return accept_on_host(sampled_acceptance(vin, logits, params, generator, ops))
