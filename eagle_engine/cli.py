"""Command line: `python -m eagle_engine {generate,inspect-draft,bench,train,selfcheck} ...`.

Parses arguments into `EngineConfig` / `SamplingParams` / `TreeParams` and hands them to the
library; bad input becomes one readable line on stderr and exit code 2, never a traceback.
Each subcommand's work lives in its own module; this file only wires arguments.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .config import Q4_TREE, WEIGHTS, ConfigError, EngineConfig, SamplingParams, TreeParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="bundled", help="bundled | HF directory | .gguf | hub id")
    p.add_argument("--draft", default="bundled",
                   help="bundled (default head) | bundled head name | directory | hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto: bf16 on CUDA and on CPUs with AVX512-BF16/AMX, else fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-len", type=int, default=4096, help="context window to allocate")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pytorch_model.bin heads (unpickles)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-packed-weights", action="store_true",
                   help="CPU: use plain F.linear instead of oneDNN-packed weights")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="target weights: q4 (CPU: the GGUF's 4-bit codes, fp32 activations), "
                   "dense (in --dtype); auto: q4 for a GGUF target on CPU, else dense")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topk", type=int, default=None,
                   help=f"default {TreeParams().topk}")
    p.add_argument("--num-steps", type=int, default=None,
                   help=f"default {TreeParams().num_steps}")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"default {TreeParams().num_draft_tokens}, with q4 weights "
                   f"{Q4_TREE.num_draft_tokens}")


def tree_params(args: argparse.Namespace, config: EngineConfig) -> TreeParams:
    """The tree flags given, the rest from `config.default_tree`."""
    base = config.default_tree
    return TreeParams(base.topk if args.topk is None else args.topk,
                      base.num_steps if args.num_steps is None else args.num_steps,
                      base.num_draft_tokens if args.num_draft_tokens is None
                      else args.num_draft_tokens)


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
    from .engine import DEFAULT_HEAD, head_name

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


def cmd_generate(args: argparse.Namespace) -> None:
    from .engine import EagleEngine

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop))
    config = engine_config(args, need_draft=not args.no_spec)
    tree = tree_params(args, config)
    t0 = time.perf_counter()
    engine = EagleEngine.load(config)
    startup = time.perf_counter() - t0
    head = None if args.no_spec else pick_head(engine, args.draft)
    prompt_ids = engine.encode(args.prompt)
    print(f"[startup] {startup:.2f}s (resolve/convert {engine.load_times['resolve_s']:.2f}s, "
          f"load {engine.load_times['load_s']:.2f}s)", file=sys.stderr)
    result = engine.generate(prompt_ids, params, tree, head, keep_events=args.events)
    if args.json:
        if args.events:
            for ev in result.events:
                print(json.dumps({"event": ev.to_dict()}))
        s = result.stats
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "num_tokens": len(result.token_ids), "tokens_per_s": s.tokens_per_s,
                          "accept_length_mean": s.tau, "num_verify_steps": s.num_steps,
                          "acceptance_per_depth": s.acceptance_per_depth(),
                          "finished": result.finished, "mode": "eagle" if head else "ar",
                          "head": head, "startup_s": startup}))
    else:
        print(result.text)
        print(f"[{len(result.token_ids)} tokens, {result.stats.tokens_per_s:.1f} tok/s, "
              f"tau {result.stats.tau:.2f}, finished: {result.finished}]", file=sys.stderr)


def cmd_inspect_draft(args: argparse.Namespace) -> None:
    from .inspect_draft import inspect_draft

    print(inspect_draft(args.path, args.target, args.allow_pickle))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle_engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (EAGLE-3 or baseline)")
    g.add_argument("--prompt", required=True)
    add_engine_args(g)
    add_tree_args(g)
    g.add_argument("--no-spec", action="store_true", help="baseline: target only")
    g.add_argument("--max-new-tokens", type=int, default=256)
    add_sampling_args(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    g.add_argument("--events", action="store_true", help="with --json: one line per step")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect-draft", help="print the resolved config of an EAGLE-3 head")
    i.add_argument("path")
    i.add_argument("--target", default=None, help="check against this target (optional)")
    i.add_argument("--allow-pickle", action="store_true")
    i.set_defaults(func=cmd_inspect_draft)

    from .bench import add_bench_parser
    from .selfcheck import add_selfcheck_parser
    from .train.evaluate import add_eval_parser
    from .train.pipeline import add_train_parser

    add_bench_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_selfcheck_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        args.func(args)
    except ConfigError as e:
        one_line = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
        print(f"error: {one_line}", file=sys.stderr)
        return 2
    return 0
