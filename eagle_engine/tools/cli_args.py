"""Shared command-line arguments: engine, tree and sampling flags and their translation into
`EngineConfig` / `TreeParams`, plus picking a loaded head by name. Every subcommand module
(`cli.py`'s own, `bench.py`, `selfcheck.py`) imports them from here; nothing here imports a
subcommand. Not here: the subcommands themselves.
"""
from __future__ import annotations

import argparse

from ..config import (
    CHAIN_SURE,
    CONTEXT_DRAFTS,
    WEIGHTS,
    ConfigError,
    EngineConfig,
    TreeParams,
    q4_tree,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="bundled", help="bundled | HF directory | .gguf | hub id")
    p.add_argument("--draft", default="bundled",
                   help="bundled (default head) | bundled head name | directory | hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto: bf16 on CUDA GPUs from Ampere on and on CPUs with AVX512-BF16/AMX, "
                        "fp16 on older GPUs, else fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-len", type=int, default=4096, help="context window to allocate")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pytorch_model.bin heads (unpickles)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-packed-weights", action="store_true",
                   help="CPU: use plain F.linear instead of oneDNN-packed weights")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="target weights: q4 (CPU: the GGUF's 4-bit codes, int8 activations), "
                   "dense (in --dtype); auto: q4 for a GGUF target on a CPU with AVX2, else "
                   "dense")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    where = "; the tree `tune` chose on this machine once it has run"
    q4 = q4_tree()  # this CPU class's static default
    p.add_argument("--topk", type=int, default=None,
                   help=f"default {TreeParams().topk}, with q4 weights {q4.topk}{where}")
    p.add_argument("--num-steps", type=int, default=None,
                   help=f"default {TreeParams().num_steps}, with q4 weights "
                   f"{q4.num_steps}{where}")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"default {TreeParams().num_draft_tokens}, with q4 weights "
                   f"{q4.num_draft_tokens}{where}")
    p.add_argument("--context-drafts", action=argparse.BooleanOptionalAction, default=None,
                   help="add a chain from a suffix match over the conversation so far to the "
                   "tree, under the same --num-draft-tokens budget (default "
                   f"{'on' if CONTEXT_DRAFTS else 'off'})")
    p.add_argument("--min-score", type=float, default=None,
                   help="verify only draft tokens whose path probability is at least this, so "
                   f"--num-draft-tokens becomes a cap (default {TreeParams().min_score:g}, with "
                   f"q4 weights {q4.min_score:g}{where})")
    p.add_argument("--context-extra", type=int, default=None,
                   help="with context drafts, verify up to this many more of the chain's tokens "
                   f"past --num-draft-tokens, those at least {CHAIN_SURE:g} likely (default "
                   f"{TreeParams().context_extra}, with q4 weights {q4.context_extra}"
                   f"{where})")
    p.add_argument("--step-cut", type=float, default=None,
                   help="run the head's draft steps past the first only while the best path so "
                   f"far is at least this likely (default {TreeParams().step_cut:g}: every "
                   f"step; with q4 weights {q4.step_cut:g}{where})")


def tree_params(args: argparse.Namespace, base: TreeParams) -> TreeParams:
    """The tree flags given, the rest from `base` (an engine's default tree: measured on this
    machine by `autotune` when cached, else `EngineConfig.default_tree`)."""
    return TreeParams(base.topk if args.topk is None else args.topk,
                      base.num_steps if args.num_steps is None else args.num_steps,
                      base.num_draft_tokens if args.num_draft_tokens is None
                      else args.num_draft_tokens,
                      base.context_drafts if args.context_drafts is None
                      else args.context_drafts,
                      base.min_score if args.min_score is None else args.min_score,
                      base.context_extra if args.context_extra is None else args.context_extra,
                      base.step_cut if args.step_cut is None else args.step_cut)


def engine_config(args: argparse.Namespace, need_draft: bool = True) -> EngineConfig:
    drafts: tuple[str, ...] = ("bundled",)
    if need_draft and args.draft not in ("bundled",):
        drafts = (args.draft,)
    return EngineConfig(target=args.target, drafts=drafts if need_draft else (), dtype=args.dtype,
                        device=args.device, max_len=args.max_len,
                        allow_pickle=args.allow_pickle, cuda_graphs=not args.no_cuda_graphs,
                        packed_weights=not args.no_packed_weights,
                        weights=args.weights)


def pick_head(engine, name: str) -> str:  # noqa: ANN001 - EagleEngine, imported lazily
    """'bundled' -> the default bundled head; a bundled name, path or hub id -> the head loaded
    from it (named as `EagleEngine.load` names it)."""
    from ..engine import DEFAULT_HEAD, head_name

    if not engine.heads:
        raise ConfigError("no draft head is loaded; pass --draft DIR or use --no-spec")
    if name == "bundled":
        return DEFAULT_HEAD if DEFAULT_HEAD in engine.heads else next(iter(engine.heads))
    key = head_name(name)
    if key not in engine.heads:
        raise ConfigError(f"draft head {name!r} is not loaded; loaded: {sorted(engine.heads)}")
    return key


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
