"""Configuration: the single source of truth for model shapes and request parameters.

Owns `TargetConfig` (Llama-family and Qwen3 shapes read from an HF config), `DraftConfig`
(EAGLE-3 head config resolution: number of aux states, aux layer ids, widths, vocab),
`SamplingParams` and `TreeParams` (validated in `__post_init__`). Does not own weights, tensors
or any I/O besides parsing a config dict. Widths of hidden-state buffers are answered by
`io_struct`'s `hidden_size_for` / `dtype_for`, which read these classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import hardware

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConfigError(ValueError):
    """A config, checkpoint or request parameter is invalid; the message names it and its value."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(name: str, device: str) -> str:
    """'auto' -> 'bf16' where bf16 is native (`native_bf16`), else 'fp16' on a CUDA GPU (before
    Ampere: fp16 tensor cores, no bf16 ones) and 'fp32' on a CPU; other names checked."""
    if name == "auto":
        if hardware.native_bf16(device):
            return "bf16"
        return "fp16" if device.startswith("cuda") else "fp32"
    parse_dtype(name)
    return name


WEIGHTS = ("auto", "q4", "dense")


def gguf_target(target: str) -> bool:
    """Whether `target` is a GGUF (the bundled one or a .gguf file): only those have q4 weights."""
    return target == "bundled" or target.endswith(".gguf")


def resolve_weights(weights: str, target: str, device: str, dtype: str) -> str:
    """'auto' -> 'q4' for a GGUF target (the bundled one or a .gguf file) on a CPU that can
    build the q4 kernels, unless `dtype` asks for bf16 or fp16; else 'dense'. q4 keeps the
    GGUF's 4-bit codes (exact for Q4_1) and decodes ~2.5x faster than bf16 and ~4x faster than
    fp32 on a 2-core CPU (README, "Results")."""
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; choose one of {list(WEIGHTS)}")
    cpu = torch.device(device).type == "cpu"
    if weights == "auto":
        fp32 = dtype in ("auto", "fp32")
        simd = set(hardware.LOWBIT_CPU_FLAGS) <= set(hardware.cpu_flags())
        return ("q4" if cpu and gguf_target(target) and fp32 and simd and hardware.compiler_available()
                else "dense")
    if weights == "q4" and not cpu:
        raise ConfigError(f"q4 target weights are a CPU path; device is {device!r}")
    if weights == "q4" and dtype not in ("auto", "fp32"):
        raise ConfigError(f"q4 target weights run with float32 activations (quantized to int8 "
                          f"inside each product); dtype {dtype!r} needs "
                          "--weights dense")
    return weights


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers-4 or the transformers-5 layout."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise ConfigError(f"rope scaling type {kind!r} is not supported (llama3, linear, default)")
        if kind == "default":
            scaling = None
    return theta, scaling


@dataclass(frozen=True)
class DecoderShape:
    """The shape a target and a head share: a Llama-family decoder's vocabulary, widths, heads,
    norm epsilon, RoPE and whether its q/k/v projections carry a bias."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool


@dataclass(frozen=True)
class TargetConfig(DecoderShape):
    """Shapes of a Llama-family target model (Llama, SmolLM, Mistral, Qwen2-style attention
    bias) or a Qwen3 dense one (`qk_norm`: a per-head RMSNorm over head_dim on q and k before
    RoPE, with `rms_norm_eps`)."""

    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> TargetConfig:
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"{source}: missing required keys {missing}")
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral", "qwen3") or not (
            arch.endswith("ForCausalLM")
        ):
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r} / model_type "
                f"{cfg.get('model_type')!r}; supported: Llama-family (llama, qwen2, mistral) "
                "and Qwen3 dense (qwen3)"
            )
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true (sliding-window attention, "
                              f"window {cfg.get('sliding_window')}) is not supported")
        theta, scaling = _rope_params(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads
            head_dim=int(cfg.get("head_dim")
                         or (128 if model_type == "qwen3" else cfg["hidden_size"] // heads)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            qk_norm=model_type == "qwen3",
        )

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        """Inputs of layers (2, L//2, L-3): the reference capture points, de-duplicated."""
        L = self.num_layers
        return tuple(sorted({min(2, L - 1), L // 2, max(L - 3, 0)}))


SPECULATORS_KEYS = ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm",
                    "norm_output", "eagle_aux_hidden_state_layer_ids")


def _flatten_speculators(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A vllm-project/speculators Eagle3 config -> the flat HF layout, as vLLM's
    `speculators/algos.py:update_eagle3` does: the draft layer's Llama config
    (`transformer_layer_config`) plus the head keys; `norm_before_residual` defaults to true
    there when absent. `eagle_aux_hidden_state_layer_ids` stay top level (layer INPUT ids)."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigError(f"{source}: speculators_model_type {kind!r} is not supported "
                          "(only 'eagle3')")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: speculators config needs a transformer_layer_config "
                          f"object, got {type(layer).__name__}")
    layer_type = layer.get("model_type", "llama")
    if layer_type != "llama":
        raise ConfigError(f"{source}: transformer_layer_config model_type {layer_type!r} is "
                          "not supported; the head's layer must be a Llama layer ('llama')")
    flat = {k: v for k, v in layer.items() if k not in ("eagle_config", *SPECULATORS_KEYS)}
    flat.update({k: cfg[k] for k in SPECULATORS_KEYS if cfg.get(k) is not None})
    flat["norm_before_residual"] = cfg.get("norm_before_residual", True)
    return flat


@dataclass(frozen=True)
class DraftConfig(DecoderShape):
    """Resolved EAGLE-3 head config. `aux_layer_ids` are target layer INPUT indices.

    Reads the HF layout (SGLang / SpecForge / EAGLE / AngelSlim: shapes at the top level, aux
    ids in `eagle_config` as layer OUTPUT indices) and the vllm-project/speculators layout
    (`speculators_model_type`, see `_flatten_speculators`). `norm_before_residual`,
    `norm_before_fc` and `norm_output` follow vLLM's `llama_eagle3.py`."""

    draft_vocab_size: int
    target_hidden_size: int
    use_aux_hidden_state: bool
    num_aux: int
    aux_layer_ids: tuple[int, ...] | None
    fc_norm: bool
    fc_bias: bool
    norm_before_residual: bool = False  # layer 0's residual is hidden_norm(h), not h
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated aux states
    norm_output: bool = False  # the recycled hidden is norm(h), not the pre-norm h
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DraftConfig:
        speculators = "speculators_model_type" in cfg
        raw = dict(cfg)
        if speculators:
            cfg = _flatten_speculators(cfg, source)
        required = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"{source}: missing required keys {missing}")
        eagle = cfg.get("eagle_config") or {}
        use_aux = bool(eagle.get("use_aux_hidden_state", cfg.get("use_aux_hidden_state", True)))
        out_ids = eagle.get("eagle_aux_hidden_state_layer_ids",
                            cfg.get("eagle_aux_hidden_state_layer_ids"))
        if cfg.get("num_aux_hidden_states") is not None:
            num_aux = int(cfg["num_aux_hidden_states"])
        elif out_ids is not None:
            num_aux = len(out_ids)
        else:
            num_aux = 3
        if not use_aux:
            num_aux = 1
        # HF config ids are 0-indexed layer OUTPUTS (SGLang adds 1); we capture layer INPUTS,
        # hence +1. vLLM, which speculators' training captures with, reads its ids as layer
        # INPUTS (`aux_hidden_state_layers`: the residual stream before layer `idx`).
        offset = 0 if speculators else 1
        aux_ids = (tuple(int(i) + offset for i in out_ids)
                   if (out_ids is not None and use_aux) else None)
        if aux_ids is not None and len(aux_ids) != num_aux:
            raise ConfigError(f"{source}: num_aux_hidden_states={num_aux} but "
                              f"eagle_aux_hidden_state_layer_ids has {len(aux_ids)} entries")
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope_params(cfg)
        hidden = int(cfg["hidden_size"])
        vocab = int(cfg["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg.get("num_hidden_layers", 1)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            use_aux_hidden_state=use_aux,
            num_aux=num_aux,
            aux_layer_ids=aux_ids,
            fc_norm=bool(cfg.get("fc_norm", cfg.get("use_aux_norm", False))),
            fc_bias=bool(cfg.get("bias", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            norm_output=bool(cfg.get("norm_output", False)),
            raw=raw,
        )

    def resolve_aux_layer_ids(self, target: TargetConfig) -> tuple[int, ...]:
        """Target layer-input indices whose hidden states feed this draft (empty when aux is off)."""
        if not self.use_aux_hidden_state:
            return ()
        ids = self.aux_layer_ids or target.default_aux_layer_ids()
        if len(ids) != self.num_aux:
            raise ConfigError(
                f"draft expects {self.num_aux} aux hidden states but the target with "
                f"{target.num_layers} layers gives capture layers {ids}"
            )
        bad = [i for i in ids if not 0 <= i <= target.num_layers]
        if bad:
            raise ConfigError(f"aux layer ids {bad} out of range for a {target.num_layers}-layer target")
        return ids

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a draft that cannot run on this target, naming both values."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")
        if self.draft_vocab_size > target.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target "
                              f"vocab_size {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(f"draft target_hidden_size {self.target_hidden_size} != target "
                              f"hidden_size {target.hidden_size}")
        if not self.use_aux_hidden_state and self.hidden_size != target.hidden_size:
            raise ConfigError(f"aux-off draft needs hidden_size == target hidden_size; got "
                              f"{self.hidden_size} vs {target.hidden_size}")
        self.resolve_aux_layer_ids(target)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ConfigError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if t == 0 and (p < 1 or self.top_k > 0):
            raise ConfigError(f"temperature 0 is greedy; top_p={p} / top_k={self.top_k} would be "
                              "ignored. Set temperature > 0 or leave top_p=1, top_k=0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# whether trees take drafts from the context by default (measured in docs/history.md)
CONTEXT_DRAFTS = True
# how likely a node of the context's chain must be (its calibrated probability) to be verified
# past the tree's `num_draft_tokens` (`TreeParams.context_extra`). A tree row past the fourth
# costs ~0.3 of a token's time on the 2-core CPUs (~0.6 ms against ~1.9 ms a token on the
# AVX-512 EPYC, ~1.8 against ~5.3 on the AVX2 EPYC); such chain nodes scored 0.3-0.4 were
# accepted 0.69 of the time on MT-bench. Thresholds of 0.2-0.5 ran at the same speed there, with
# tau 2.577-2.462; 0.3 keeps a margin where rows cost more
CHAIN_SURE = 0.3


# the short names of a tree's fields, in `TreeParams.spec`'s order
TREE_NAMES = {"k": "topk", "s": "num_steps", "n": "num_draft_tokens", "cut": "min_score",
              "extra": "context_extra", "step": "step_cut", "ctx": "context_drafts"}
TREE_FORMAT = "'k=4,s=3,n=8[,cut=0.1][,extra=8][,step=0.5][,ctx=on|off]'"


@dataclass(frozen=True)
class TreeParams:
    """EAGLE-2 dynamic tree shape: `num_steps` draft levels, `topk` branching, `num_draft_tokens`
    tree nodes including the root. `context_drafts` adds a chain proposed by a suffix match over
    the conversation so far (`context_draft.py`) to the candidates, under the same
    `num_draft_tokens` budget; such a chain may reach deeper than `num_steps` (`max_depth`).
    `context_extra` lets the chain go on past that budget by up to that many nodes, those at
    least `CHAIN_SURE` likely (a copied span verified in one step), so a tree verifies at most
    `max_rows` tokens.
    `min_score` leaves out of the tree every candidate whose path probability (the head's
    calibrated score, or the chain's) is below it, so `num_draft_tokens` becomes a cap and an
    unsure draft costs no verify rows; 0 verifies the full budget every iteration.
    `step_cut` skips the head's draft steps past the first once the best path so far is less
    likely than it: every node such a step adds scores at most that path, so it seldom earns
    a row, and the step's time is saved; 0 runs all `num_steps` every iteration. On a GPU the
    check reads the scores back to the host, and such a tree drafts without its CUDA graph."""

    # defaults = the fastest shape of the measured dense sweep on the 2-core CPU
    topk: int = 4
    num_steps: int = 3
    num_draft_tokens: int = 8
    context_drafts: bool = CONTEXT_DRAFTS
    min_score: float = 0.0
    context_extra: int = 0
    step_cut: float = 0.0

    def __post_init__(self) -> None:
        for name in ("topk", "num_steps", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        extra = self.context_extra
        if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra <= 64:
            raise ConfigError(f"context_extra must be an integer in [0, 64], got {extra!r}")
        if not isinstance(self.context_drafts, bool):
            raise ConfigError(f"context_drafts must be true or false, got "
                              f"{self.context_drafts!r}")
        for name in ("min_score", "step_cut"):
            score = getattr(self, name)
            if (isinstance(score, bool) or not isinstance(score, (int, float))
                    or not 0 <= score < 1):
                raise ConfigError(f"{name} must be a number in [0, 1), got {score!r}")
        if self.num_draft_tokens < 2:
            raise ConfigError(f"num_draft_tokens must be >= 2 (root + one draft), "
                              f"got {self.num_draft_tokens}")
        if self.num_draft_tokens - 1 > self.capacity:
            raise ConfigError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds what topk={self.topk}, "
                f"num_steps={self.num_steps} can hold: at most {self.capacity + 1} "
                f"(root + topk + (num_steps-1)*topk^2)")

    @classmethod
    def parse(cls, text: str, base: TreeParams | None = None) -> TreeParams:
        """A tree from named fields, 'k=3,s=2,n=5,cut=0.1,extra=8,step=0.5,ctx=on': the short
        names of `TREE_NAMES` or the field names, in any order; fields not named keep `base`'s
        (default: `TreeParams()`)."""
        values: dict[str, object] = {}
        for item in text.split(","):
            name, eq, value = item.partition("=")
            name, value = name.strip(), value.strip()
            field_name = TREE_NAMES.get(name, name)
            if not eq or field_name not in TREE_NAMES.values():
                raise ConfigError(f"a tree is named fields {TREE_FORMAT}; {item.strip()!r} in "
                                  f"{text!r} is not one")
            if field_name in values:
                raise ConfigError(f"{name!r} is named twice in the tree {text!r}")
            kind = type(getattr(base or cls(), field_name))
            try:
                if kind is bool:
                    if value not in ("on", "off", "1", "0", "true", "false"):
                        raise ValueError(f"expected on or off, got {value!r}")
                    values[field_name] = value in ("on", "1", "true")
                else:
                    values[field_name] = kind(value)
            except ValueError as e:
                raise ConfigError(f"{name}={value!r} in the tree {text!r}: {e}") from e
        return replace(base or cls(), **values)

    def spec(self) -> str:
        """The tree as `parse` reads it, every field named."""
        parts = []
        for short, name in TREE_NAMES.items():
            v = getattr(self, name)
            parts.append(f"{short}={('on' if v else 'off') if isinstance(v, bool) else f'{v:g}'}")
        return ",".join(parts)

    @property
    def capacity(self) -> int:
        """Number of candidate draft nodes the expansion produces."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def chain_len(self) -> int:
        """The longest chain from the context a tree can hold (0 without context drafts)."""
        return self.num_draft_tokens - 1 + self.context_extra if self.context_drafts else 0

    @property
    def max_rows(self) -> int:
        """The most tokens a tree verifies: its budget, or the root and the longest chain."""
        return max(self.num_draft_tokens, 1 + self.chain_len)

    @property
    def max_depth(self) -> int:
        """The deepest node a tree can hold: the head's `num_steps`, or with context drafts a
        chain that takes the whole budget and its `context_extra`."""
        return max(self.num_steps, self.chain_len)


# q4 target weights on an AVX-512 CPU with VNNI: k3 s2 n5 with a cut of 0.1, up to 8 sure nodes
# of the context's chain past the budget (`CHAIN_SURE`) and a step cut of 0.5. A q4 tree row
# costs a fifth to a third of a one-token step on a 2-core AVX-512 EPYC and the head's second
# step about an eighth, so that step runs only where the head is sure of its first draft (about
# half the iterations); the cut leaves out nearly hopeless drafts. On the AVX-512 EPYC it is
# level with k3 s1 n4 or a little faster on the full MT-bench (docs/history.md).
Q4_TREE = TreeParams(3, 2, 5, min_score=0.1, context_extra=8, step_cut=0.5)
# The static q4 default per CPU class (`hardware.cpu_isa`), each measured on its class
# (docs/history.md, "Tree shape and defaults"); `tools/autotune.py` measures the candidates on
# each machine and keeps its class's default unless another tree is faster beyond the noise.
# - AMX Xeon: k3 s1 n4, cut 0.05 (1.093x vs 1.057x for k2 s1 n3); the second head step and the
#   deeper tree were never measured there, the context's chain costs no head step.
# - AVX2 only: a chain of one head draft and the context's chain. On a Zen 1 EPYC a 4-row verify
#   costs 2.66 one-token steps (1.18 on the AVX-512 EPYC), and k1 s1 n2 was the fastest tree
#   (118.6 tok/s; k3 s2 n5 101.6), though slower than plain decoding (135.7); on a Zen 3 AVX2
#   EPYC, where trees pay, the tuner measures the wider candidates.
Q4_TREES = {"AVX-512": Q4_TREE,
            "AMX": TreeParams(3, 1, 4, min_score=0.05, context_extra=8),
            "AVX2": TreeParams(1, 1, 2, context_extra=8)}


def q4_tree(isa: str | None = None) -> TreeParams:
    """The static q4 default of CPU class `isa` (default: this CPU's, `hardware.cpu_isa`)."""
    return Q4_TREES.get(isa or hardware.cpu_isa(), Q4_TREE)


@dataclass(frozen=True)
class EngineConfig:
    """What to load. `drafts` are names of bundled heads, directories or hub ids;
    `max_len` caps the context (and sizes every cache and RoPE table); `packed_weights` pre-packs
    dense linear weights for oneDNN on CPU (`models/cpu_pack.py`); `weights` is how the target
    holds its linears: `dense` in `dtype`, or `q4` on CPU (`models/cpu_lowbit.py`: the GGUF's
    4-bit codes; float32 activations, quantized to int8 inside each product, so `dtype` is
    fp32); `auto` resolves on construction
    (`resolve_weights`). `max_batch` is how many requests the scheduler steps together
    (`scheduler.py`; 1 answers one at a time); `prefix_cache_mb` bounds the memory that keeps
    finished requests' cache rows for the next chat turn (`prefix_cache.py`; 0 turns reuse
    off); `adapt_threads` lets a CPU engine step on one thread while other processes take the
    cores (`cpu_share.ThreadGovernor`)."""

    target: str = "bundled"
    drafts: tuple[str, ...] = ("bundled",)
    dtype: str = "auto"  # resolved on construction (`resolve_dtype`): always a concrete name
    device: str = "cpu"
    max_len: int = 4096
    allow_pickle: bool = False
    cuda_graphs: bool = True
    packed_weights: bool = True
    weights: str = "auto"
    max_batch: int = 4
    prefix_cache_mb: int = 0
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        weights = resolve_weights(self.weights, self.target, self.device, self.dtype)
        object.__setattr__(self, "weights", weights)
        dtype = "fp32" if weights == "q4" else resolve_dtype(self.dtype, self.device)
        object.__setattr__(self, "dtype", dtype)
        if self.max_len < 16:
            raise ConfigError(f"max_len must be >= 16, got {self.max_len}")
        if not 1 <= self.max_batch <= 64:
            raise ConfigError(f"max_batch must be in [1, 64], got {self.max_batch}")
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")

    @property
    def weights_label(self) -> str:
        """How the target holds its weights: `q4` codes or its dtype."""
        return "q4" if self.weights == "q4" else self.dtype

    def other_weights(self, dtype: str) -> EngineConfig:
        """The same target in the other CPU weight format (q4 <-> dense), a dense target in
        `dtype` as asked ('auto' resolved anew: a q4 config's own dtype is always fp32)."""
        return replace(self, dtype=dtype, weights="dense" if self.weights == "q4" else "q4")

    @property
    def default_tree(self) -> TreeParams:
        """The static default tree for these weights, from the measured sweeps
        (docs/history.md): with q4 weights a tree row costs more compute than a dense one, and
        how much depends on the CPU class (`Q4_TREES`). An engine's `default_tree` replaces it
        with the tree `autotune` chose on this machine."""
        return q4_tree() if self.weights == "q4" else TreeParams()
