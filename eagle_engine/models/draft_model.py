"""The EAGLE-3 draft network (multi-layer, configurable aux states, reduced draft vocabulary).

    a      = input_norm(cat_i aux_i)            # only with norm_before_fc   [.., A*Ht]
    h      = fc(cat_i fc_norm_i(a_i))   # target features -> draft width (skipped when aux off)
    layer0 : n = hidden_norm(h); res = n if norm_before_residual else h
             x = cat(input_layernorm(embed(ids)), n)    # [.., 2*Hd]
             h = res + attn(x); h = h + mlp(post_attention_layernorm(h))
    layer i: ordinary pre-norm decoder layers on Hd
    pre    = h; logits = lm_head(norm(pre))     # [.., Vd]
    recycled hidden (the next decode step's input) = pre, or norm(pre) with norm_output

Draft ids map to target ids with `hot_ids = arange(Vd) + d2t` (offsets; zeros = identity).
Not here: checkpoint IO (`draft_io.py`), tree logic (`draft.py`, `tree.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import DraftConfig
from ..kv_cache import CacheSlots, KVCache, KVPool
from ..kernels.attention import score_bias
from .layers import MLP, Attention, RMSNorm, Rope, RopeTable


class DraftLayer(nn.Module):
    """Layer 0 (`is_input_layer`) reads cat(norm(embeds), norm(hidden)); its residual is the
    raw hidden, or the normed one with `norm_before_residual` (vLLM `llama_eagle3.py`
    `_norm_before_residual`, speculators' first layer). Later layers are plain."""

    def __init__(self, cfg: DraftConfig, is_input_layer: bool) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.is_input_layer = is_input_layer
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if is_input_layer:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        in_dim = 2 * H if is_input_layer else H
        self.self_attn = Attention(in_dim, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, embeds: torch.Tensor, rope: RopeTable,
                kv: tuple[torch.Tensor, torch.Tensor], start: int,
                bias: torch.Tensor | None, at: CacheSlots | None = None) -> torch.Tensor:
        x, h = self._input(h, embeds)
        h = h + self.self_attn(x, rope, kv, start, bias, at)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_many(self, h: torch.Tensor, embeds: torch.Tensor, rope: RopeTable,
                     kvs: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int],
                     biases: list[torch.Tensor | None], lens: list[int]) -> torch.Tensor:
        """Several sequences' rows, h [1, R, H], each attending over its own cache
        (`Attention.forward_many`)."""
        x, h = self._input(h, embeds)
        h = h + self.self_attn.forward_many(x, rope, kvs, starts, biases, lens)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _input(self, h: torch.Tensor, embeds: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the attention's input [B, T, 2H or H], the residual [B, T, H])."""
        if not self.is_input_layer:
            return self.input_layernorm(h), h
        normed = self.hidden_norm(h)  # [B, T, H]
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        return x, normed if self.norm_before_residual else h


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_len = max_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embedding_shared = False  # True once `share_embedding` uses the target's own
        if cfg.use_aux_hidden_state:
            width = cfg.num_aux * cfg.target_hidden_size
            if cfg.norm_before_fc:
                self.input_norm = RMSNorm(width, cfg.rms_norm_eps)
            self.fc = nn.Linear(width, cfg.hidden_size, bias=cfg.fc_bias)
            if cfg.fc_norm:
                self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                             for _ in range(cfg.num_aux))
        self.layers = nn.ModuleList(DraftLayer(cfg, i == 0) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rope = Rope(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)
        self.fused = None  # models/cpu_lowbit.FusedDecoder once the layers hold q8 codes

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids [...] -> their target ids [...] (`d2t` holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]

    @property
    def hot_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id (the whole map; a draft step maps only its top-k)."""
        return self.target_ids(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))

    def share_embedding(self, target_embed: nn.Embedding) -> None:
        """Use the target's embedding module (the common case: checkpoints omit it, and a
        saved head then omits it too)."""
        self.embed_tokens = target_embed
        self.embedding_shared = True

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, 1, c.num_kv_heads, max_len or self.max_len, c.head_dim,
                       self._kv_dtype, self.norm.weight.device)

    def new_pool(self, slots: int, max_len: int) -> KVPool:
        """`slots` request caches (and a scratch one) like `new_cache`'s, batch-major."""
        c = self.cfg
        return KVPool(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, self._kv_dtype,
                      self.norm.weight.device)

    @property
    def _kv_dtype(self) -> torch.dtype:
        w = self.norm.weight  # float even when the linears hold codes
        return w.dtype if self.fused is None else self.fused.kv_dtype

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., EagleDraftExtendInput.hidden_size_for] -> [.., hidden_size]."""
        if not self.cfg.use_aux_hidden_state:
            return features
        if self.cfg.norm_before_fc:
            features = self.input_norm(features)
        if self.cfg.fc_norm:
            chunks = features.chunk(self.cfg.num_aux, dim=-1)
            features = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, start: int, mask: torch.Tensor | None,
                from_target: bool, last_only: bool = False,
                at: CacheSlots | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids/positions [B, T]; hidden [B, T, W] (target features when `from_target`, else the
        recycled draft hidden). Returns (logits [B, T|1, Vd] float32, recycled hidden [B, T, Hd]:
        pre-norm, or normed with `norm_output`). `at`: static-shape writes into a `KVPool`
        (see `Attention.forward`)."""
        h = self.project(hidden) if from_target else hidden
        embeds = self.embed_tokens(ids).to(h.dtype)
        rope = self.rope.table(positions, h.dtype)
        if self.fused is not None and self.fused.applies(ids, at):
            h, normed, _ = self.fused(h, rope.cos[0, 0], rope.sin[0, 0], cache.data, start, mask,
                                      embeds=embeds)  # [B, T, Hd] each
        else:
            bias = score_bias(mask, self.cfg.num_heads, self.cfg.num_kv_heads, h.dtype)
            for i, layer in enumerate(self.layers):
                h = layer(h, embeds, rope, cache.layers[i], start, bias, at)
            normed = self.norm(h)  # [B, T, Hd]
        if self.cfg.norm_output:
            h = normed  # recycled and read by the lm_head
        logits = self.lm_head(normed[:, -1:] if last_only else normed).float()
        return logits, h
