"""CPU target weights in the GGUF's own block formats: q4 (Q4_1) decoder linears, q8 (Q8_0) lm_head.

The bundled target is a Q4_1 GGUF: every decoder linear is stored as codes q in 0..15 with a
scale d and a minimum m per block of 32 inputs (w = d*q + m), and its tied embedding / lm_head
as Q8_0 (int8 codes with a scale per 32 inputs). `quantize_q4` takes each block's minimum and
maximum as m and m + 15d; a Q4_1 block always holds both ends (llama.cpp quantizes a block's
minimum to 0 and its maximum to 15), so for the weights dequantized from such a GGUF the codes,
scales and minimums come back exactly (tested on the bundled target); `quantize_q8` likewise
recovers a Q8_0 block (scale = absmax / 127). Scales and minimums are float16, as in the GGUF
(a sixth of a q4 layer's bytes less to read than float32 ones, for the same values). Any other
weight is quantized, lossily.

`quantize_target(model)` swaps the target's linears for `LowBitLinear` modules whose weights
live only as codes (a quarter of fp32's bytes for q4, about a third for q8) and are multiplied
by the C++ kernels of `kernels/cpu_lowbit.py` (activations quantized to int8 per block of
32 inside each call, as llama.cpp does); `quantize_head` does the
same to a head's linears with q8 codes. Not here: the kernels, or choosing this format
(`EngineConfig.weights`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_lowbit
from ..kernels.cpu_lowbit import GROUP


def _half(values: torch.Tensor, what: str) -> torch.Tensor:
    """float32 block scales -> float16, as a GGUF stores them; refuses values float16 cannot
    hold (a weight with blocks past +-65504, or a nonzero scale below float16's smallest)."""
    half = values.half()
    lost = ~torch.isfinite(half) | ((half == 0) & (values != 0))
    if lost.any():
        bad = values[lost]
        raise ValueError(f"{what} out of float16's range ({bad.numel()} values, e.g. "
                         f"{bad[0].item():.3g}); such a weight cannot be held as q4 / q8 blocks")
    return half


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> codes [N, K/2] uint8 (Q4_1 nibble order), scales [N, 2, K/32] float16
    (the scale of each block, then its minimum; float16 as in a Q4_1 block, the codes chosen
    against the rounded values)."""
    N, K = weight.shape
    w = weight.float().view(N, K // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)  # [N, K/32]
    scale = _half((high - low) / 15, "q4 block scales").float()
    low = _half(low, "q4 block minimums").float()
    step = torch.where(scale > 0, scale, 1.0)[..., None]
    q = ((w - low[..., None]) / step).round().clamp(0, 15).to(torch.uint8)  # [N, K/32, 32]
    codes = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)  # [N, K/32, 16]
    return codes.reshape(N, K // 2).contiguous(), torch.stack([scale, low], 1).half().contiguous()


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> codes [N, K] int8, d [N, K/32] float16 (w ~= d * codes)."""
    N, K = weight.shape
    w = weight.float().view(N, K // GROUP, GROUP)
    d = _half(w.abs().amax(-1) / 127, "q8 block scales")  # [N, K/32]
    step = torch.where(d > 0, d.float(), 1.0)[..., None]
    codes = (w / step).round().clamp(-127, 127).to(torch.int8)
    return codes.view(N, K).contiguous(), d.contiguous()


class LowBitLinear(nn.Module):
    """A linear (optional bias) whose weight lives only as q4 or q8 block codes. fp32 only."""

    def __init__(self, linear: nn.Module, kind: str) -> None:
        super().__init__()
        weight = linear.weight.detach()  # [out, in]
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP:
            raise ValueError(f"{kind} weights need in_features % {GROUP} == 0, got "
                             f"{self.out_features}x{self.in_features}")
        self.kind = kind
        if kind == "q4":
            codes, scales = cpu_lowbit.pack_q4(*quantize_q4(weight))
        else:
            codes, scales = cpu_lowbit.pack_q8(*quantize_q8(weight))
        self.register_buffer("codes", codes, persistent=False)  # packed 8 columns together
        self.register_buffer("scales", scales, persistent=False)
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else bias.detach().float()
        self.matmul = cpu_lowbit.q4_linear if kind == "q4" else cpu_lowbit.q8_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out]. Inference only."""
        out = self.matmul(x.reshape(-1, self.in_features).contiguous(), self.codes, self.scales,
                          self.out_features)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32 (the tests' reference)."""
        n = self.out_features
        if self.kind == "q4":
            return cpu_lowbit.q4_dequantize(*cpu_lowbit.unpack_q4(self.codes, self.scales, n))
        return cpu_lowbit.q8_dequantize(*cpu_lowbit.unpack_q8(self.codes, self.scales, n))


def _q8(m: nn.Module) -> bool:
    return isinstance(m, LowBitLinear) and m.kind == "q8" and m.bias is None


def quantize_target(model: nn.Module) -> dict[str, int]:
    """Swap the decoder linears of a float32 target for q4 codes and its lm_head for q8 codes
    (the embedding lookup keeps its dense rows). Returns how many linears of each kind."""
    if model.embed_tokens.weight.dtype != torch.float32:
        raise ValueError(f"q4 weights run with float32 activations; the target is "
                         f"{model.embed_tokens.weight.dtype}")
    swaps = [(parent, name, child) for parent in model.layers.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, LowBitLinear(child, "q4"))
    model.lm_head = LowBitLinear(model.lm_head, "q8")
    if FusedDecoder.supports(model):
        model.fused = FusedDecoder(model)
    return {"q4": len(swaps), "q8": 1, "fused": model.fused is not None}


def quantize_head(model: nn.Module) -> int:
    """Swap an EAGLE-3 head's float32 linears for q8 codes (near-lossless; a draft step then
    reads a quarter of the bytes) and fuse its layers. The embedding it shares with the target
    stays. Returns how many linears were swapped."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear and child.in_features % GROUP == 0
             and child.weight.dtype == torch.float32]
    for parent, name, child in swaps:
        setattr(parent, name, LowBitLinear(child, "q8"))
    if FusedDecoder.supports(model):
        model.fused = FusedDecoder(model)
    return len(swaps)


class FusedDecoder:
    """A model's decoder layers as one C++ call (`fused_decoder` in `kernels/cpu_lowbit.cpp`):
    a one-sequence step dispatches one call from Python, not ~25 small ops per layer. For a target
    with q4 layers, or an EAGLE-3 head with q8 layers (its first layer reads cat(norm(embeds),
    norm(hidden))). It holds references to the layers' tensors; `TargetModel.forward` and
    `Eagle3Draft.forward` call it when it `applies` and run their Python layers (the
    reference) otherwise. A head's whole draft extend (`fc`, the layers, the lm_head, the
    top-k) can run as one call too (`extend`), and so can its whole draft past the first level
    (each decode step's layers, lm_head and top-k, and the expansion to the best paths:
    `draft`). Its KV caches hold `kv_dtype` (float16: a step over a long context reads half
    the bytes of float32 keys and values); the models' `new_cache` asks for it, and their
    Python layers widen what they read."""

    kv_dtype = torch.float16

    def __init__(self, model: nn.Module) -> None:
        cfg = model.cfg
        self.heads, self.kv_heads, self.eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        self.q8 = model.layers[0].self_attn.qkv_proj.kind == "q8"
        self.weights: list[torch.Tensor] = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm.weight.detach()]
            if getattr(layer, "is_input_layer", False):
                norms.append(layer.hidden_norm.weight.detach())
            self.weights += norms + [a.qkv_proj.codes, a.qkv_proj.scales, a.o_proj.codes,
                                     a.o_proj.scales,
                                     layer.post_attention_layernorm.weight.detach(),
                                     m.gate_up_proj.codes, m.gate_up_proj.scales,
                                     m.down_proj.codes, m.down_proj.scales]
        self.final_norm = model.norm.weight.detach()  # [H] the lm_head's input norm
        self.drafts = self.q8 and FusedDecoder.drafts_in_one_call(model)
        self.extends = self.drafts and FusedDecoder.extends_in_one_call(model)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Low-bit layers without biases, of whole groups of 8 outputs, head_dim and
        intermediate size in whole vectors, no per-head q/k norms (Qwen3: the kernel has
        none, so such a target runs its Python layers over the same q4 linears) and, for a
        head, the raw hidden as layer 0's residual (no `norm_before_residual`)."""
        cfg = model.cfg
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj,
                   layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return (all(isinstance(m, LowBitLinear) and m.bias is None and m.out_features % 8 == 0
                    for m in linears)
                and all(layer.self_attn.q_norm is None for layer in model.layers)
                and not getattr(cfg, "norm_before_residual", False)
                and len({m.kind for m in linears}) == 1
                and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
                and cfg.intermediate_size % 8 == 0)

    @staticmethod
    def drafts_in_one_call(model: nn.Module) -> bool:
        """A head whose draft `draft` runs (`head_draft_tree` in
        `kernels/cpu_lowbit.cpp`): q8 codes in the lm_head, float32 embeddings."""
        return _q8(model.lm_head) and model.embed_tokens.weight.dtype == torch.float32

    @staticmethod
    def extends_in_one_call(model: nn.Module) -> bool:
        """A head whose draft extend `extend` runs (`head_extend` in `kernels/cpu_lowbit.cpp`):
        one that `drafts_in_one_call`, with q8 codes in `fc` (when it has aux states), no bias
        on `fc`, no norm over the whole features before `fc` (a norm per aux chunk, `fc_norm`,
        runs in the call)."""
        cfg = model.cfg
        return (FusedDecoder.drafts_in_one_call(model)
                and (not cfg.use_aux_hidden_state or _q8(model.fc))
                and not cfg.norm_before_fc)

    def extend(self, model: nn.Module, tokens: torch.Tensor, features: torch.Tensor,
               start: int, kv: torch.Tensor, topk: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A head's draft extend as one C++ call (heads that `extends`): tokens [T] and their
        target features [T, W] at rows [start, start + T) of the head's one-row cache (`kv` =
        `KVCache.data`) -> (top-k probabilities [k], their target ids [k], the last row's
        recycled hidden [H]). `accept.extend_forward` is the reference, with the same bits."""
        aux = model.cfg.use_aux_hidden_state
        none = torch.empty(0)
        fc_norms = [n.weight for n in model.fc_norm] if aux and model.cfg.fc_norm else []
        return tuple(cpu_lowbit.load().head_extend(
            tokens, features, model.fc.codes if aux else none, model.fc.scales if aux else none,
            fc_norms, model.embed_tokens.weight, model.rope.cos, model.rope.sin, kv, start,
            self.weights, self.heads, self.kv_heads, self.eps, self.final_norm,
            model.cfg.norm_output, model.lm_head.codes, model.lm_head.scales,
            model.lm_head.out_features, model.d2t, topk))

    def draft(self, model: nn.Module, topk_p: torch.Tensor, topk_ids: torch.Tensor,
              hidden: torch.Tensor, seq: int, steps: int, kv: torch.Tensor, step_cut: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A head's whole draft as one C++ call (heads that `drafts`): level 1 is the extend's
        top-k (probabilities topk_p [K], target ids topk_ids [K]) below the root, whose recycled
        hidden [H] each level-1 node carries; then `steps - 1` decode steps over the K best
        paths, at positions seq, seq + 1, ..., written to the head's one-row cache (`kv` =
        `KVCache.data`) from row seq on, and each level's expansion, stopping before a step
        once the best path so far scores below `step_cut` (`draft.going_on`) -> (scores [C],
        tokens [C], parents [C]) of `draft.Frontier`'s candidate layout. `draft.draft`'s Python
        definition (`draft.draft_levels`) is the reference, with the same bits."""
        return tuple(cpu_lowbit.load().head_draft_tree(
            topk_p, topk_ids, hidden, seq, steps, model.embed_tokens.weight, model.rope.cos,
            model.rope.sin, kv, self.weights, self.heads, self.kv_heads, self.eps,
            self.final_norm, model.cfg.norm_output, model.lm_head.codes, model.lm_head.scales,
            model.lm_head.out_features, model.d2t, step_cut))

    def applies(self, ids: torch.Tensor, at: object) -> bool:
        """One sequence, rows written from `start` (decodes, tree verifies, drafts and the
        prefill alike, so a row's numbers never depend on which of them computed it)."""
        return ids.shape[0] == 1 and at is None  # `at`: static-shape writes (`CacheSlots`)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv: torch.Tensor, start: int, mask: torch.Tensor | None,
                 aux_layer_ids: tuple[int, ...] = (), embeds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h [1, T, H]; cos/sin [T, head_dim]; kv = `KVCache.data` of a one-row cache; mask
        [1, T, start+T] bool or None (every row visible); embeds [1, T, H] for a head ->
        (h [1, T, H] after the last layer, that h under the model's final norm [1, T, H],
        aux [1, T, n*H] or None: the inputs of `aux_layer_ids`, ascending)."""
        out, normed, aux = self.many(h[0], cos, sin, [kv], [start], [h.shape[1]],
                                     [None if mask is None else mask[0]], aux_layer_ids,
                                     None if embeds is None else embeds[0])
        return out[None], normed[None], (None if aux is None else aux[None])

    def many(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             kvs: list[torch.Tensor], starts: list[int], lens: list[int],
             masks: list[torch.Tensor | None], aux_layer_ids: tuple[int, ...] = (),
             embeds: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Several sequences in one call: h [R, H] their rows one after the other (R =
        sum(lens)); cos/sin [R, head_dim]; kvs[i] the `KVCache.data` of sequence i's one-row
        cache, written from starts[i]; masks[i] [lens[i], starts[i]+lens[i]] bool or None
        (every row visible); embeds [R, H] for a head -> (h [R, H], h under the final norm
        [R, H], aux [R, n*H] or None).
        Each sequence gets the bits it gets alone (the kernel runs attention per sequence)."""
        visible = [torch.empty(0, dtype=torch.bool) if m is None else m.contiguous()
                   for m in masks]  # [T, S] each
        ids = sorted(set(aux_layer_ids))
        e = torch.empty(0) if embeds is None else embeds
        out, aux, normed = cpu_lowbit.load().fused_decoder(
            h, e, cos, sin, kvs, starts, lens, visible, self.weights, self.heads, self.kv_heads,
            self.eps, ids, self.q8, self.final_norm)
        return out, normed, (aux if ids else None)
