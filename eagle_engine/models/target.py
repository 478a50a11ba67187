"""The target model: a compact Llama-family decoder (Llama, SmolLM, Mistral, Qwen2-style bias)
that also runs Qwen3 dense targets (per-head q/k RMSNorm before RoPE, `TargetConfig.qk_norm`).

`TargetModel.forward` takes token ids, explicit RoPE positions, a KV cache, the cache row to
write at, and an explicit mask (causal, ragged or tree), and returns logits together with the
aux hidden states EAGLE-3 consumes (inputs of the chosen layers, un-normalized, concatenated in
ascending layer order) and the final normed hidden state. No state lives on the model between
calls. Not here: loading weights (`loader.py`), decoding loops (`baseline.py`, `scheduler.py`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TargetConfig
from ..kv_cache import CacheSlots, KVCache, KVPool
from ..kernels.attention import score_bias
from .layers import MLP, Attention, RMSNorm, Rope, RopeTable


@dataclass(slots=True)
class TargetOutput:
    logits: torch.Tensor  # [B, T or 1, vocab] float32
    aux_hidden: torch.Tensor | None  # [B, T, num_aux * hidden] (None when nothing is captured)
    final_hidden: torch.Tensor  # [B, T, hidden] after the final norm (what lm_head reads)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads,
                                   cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias,
                                   cfg.rms_norm_eps if cfg.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, rope: RopeTable,
                kv: tuple[torch.Tensor, torch.Tensor], start: int,
                bias: torch.Tensor | None, at: CacheSlots | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv, start, bias, at)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_many(self, h: torch.Tensor, rope: RopeTable,
                     kvs: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int],
                     biases: list[torch.Tensor | None], lens: list[int]) -> torch.Tensor:
        """Several sequences' rows, h [1, R, H], each attending over its own cache
        (`Attention.forward_many`)."""
        h = h + self.self_attn.forward_many(self.input_layernorm(h), rope, kvs, starts, biases,
                                            lens)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_len = max_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)
        self.fused = None  # models/cpu_lowbit.FusedDecoder once the layers hold q4 codes

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """A cache in the model's dtype, or in the fused decoder's `kv_dtype` when it has one."""
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, max_len or self.max_len, c.head_dim,
                       self._kv_dtype, self.device)

    def new_pool(self, slots: int, max_len: int) -> KVPool:
        """`slots` request caches (and a scratch one) like `new_cache`'s, batch-major."""
        c = self.cfg
        return KVPool(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, self._kv_dtype,
                      self.device)

    @property
    def _kv_dtype(self) -> torch.dtype:
        return self.dtype if self.fused is None else self.fused.kv_dtype

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor | None, aux_layer_ids: tuple[int, ...] = (),
                last_only: bool = False, at: CacheSlots | None = None) -> TargetOutput:
        """ids/positions [B, T]; writes KV rows [start, start+T). `aux_layer_ids` are layer INPUT
        indices (0..num_layers; num_layers = the un-normed output of the last layer).
        With `at`, `cache` is a `KVPool` and each sequence writes and attends where `at` says
        (`Attention.forward`; `mask` is then [B, T, max_len])."""
        h = self.embed_tokens(ids)  # [B, T, H]
        rope = self.rope.table(positions, h.dtype)
        if self.fused is not None and self.fused.applies(ids, at):
            _, h, aux = self.fused(h, rope.cos[0, 0], rope.sin[0, 0], cache.data, start, mask,
                                   aux_layer_ids)  # models/cpu_lowbit.FusedDecoder, h normed
        else:
            bias = score_bias(mask, self.cfg.num_heads, self.cfg.num_kv_heads, h.dtype)
            h, aux = self.decode_layers(h, aux_layer_ids, lambda i, layer, x: layer(
                x, rope, cache.layers[i], start, bias, at))
        logits = self.lm_head(h[:, -1:] if last_only else h).float()
        return TargetOutput(logits=logits, aux_hidden=aux, final_hidden=h)

    def decode_layers(self, h: torch.Tensor, aux_layer_ids: tuple[int, ...],
                      run: Callable[[int, DecoderLayer, torch.Tensor], torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack of the eager forwards: `run(i, layer, h)` applies layer i ->
        (the final normed hidden [.., H], the inputs of the `aux_layer_ids` layers
        concatenated [.., len * H], or None)."""
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                captured.append(h)
            h = run(i, layer, h)
        if self.cfg.num_layers in aux_layer_ids:
            captured.append(h)
        return self.norm(h), torch.cat(captured, dim=-1) if captured else None
