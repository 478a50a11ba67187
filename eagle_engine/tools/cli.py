"""Command line: `python -m eagle_engine COMMAND`, COMMAND one of generate, tune, inspect-draft,
export-llamacpp, bench, train, eval-head and selfcheck.

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
from pathlib import Path

from ..config import ConfigError, SamplingParams
from . import autotune
from .cli_args import (
    add_engine_args,
    add_sampling_args,
    add_tree_args,
    engine_config,
    pick_head,
    tree_params,
)


def cmd_generate(args: argparse.Namespace) -> None:
    from ..engine import EagleEngine

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop))
    config = engine_config(args, need_draft=not args.no_spec)
    t0 = time.perf_counter()
    engine = EagleEngine.load(config)
    startup = time.perf_counter() - t0
    head = None if args.no_spec else pick_head(engine, args.draft)
    autotune.use_cached(engine, head)
    tree = tree_params(args, engine.default_tree)
    prompt_ids = engine.encode(args.prompt)
    print(f"[startup] {startup:.2f}s (resolve/convert {engine.load_times['resolve_s']:.2f}s, "
          f"load {engine.load_times['load_s']:.2f}s)", file=sys.stderr)
    result = engine.generate(prompt_ids, params, tree, head, keep_events=args.events)
    s = result.stats
    if args.json:
        if args.events:
            for ev in result.events:
                print(json.dumps({"event": ev.to_dict()}))
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "num_tokens": len(result.token_ids), "tokens_per_s": s.tokens_per_s,
                          "accept_length_mean": s.tau, "num_verify_steps": s.num_steps,
                          "acceptance_per_depth": s.acceptance_per_depth(),
                          "finished": result.finished, "mode": "eagle" if head else "ar",
                          "head": head, "startup_s": startup, "prompt_tokens": len(prompt_ids),
                          "prefill_s": s.prefill_s}))
    else:
        print(result.text)
        print(f"[{len(result.token_ids)} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, "
              f"prefill of {len(prompt_ids)} prompt tokens {s.prefill_s:.2f}s, "
              f"finished: {result.finished}]", file=sys.stderr)


def cmd_tune(args: argparse.Namespace) -> None:
    """Print the fastest weights and tree here (`autotune.tune`): the cached measurement, or
    a new one (with `--refresh`, or when none is cached), cached unless the machine was busy.
    Exits 3 when it was: the figures would rank the load."""
    from dataclasses import asdict

    from ..engine import EagleEngine

    config = engine_config(args)
    engines = [EagleEngine.load(config)]
    if config.device == "cpu" and not args.single_weights:
        engines.append(EagleEngine.load(config.other_weights(args.dtype),
                                        tokenizer=engines[0].tokenizer))
    head = pick_head(engines[0], args.draft)
    tuned = autotune.tune(engines, head, refresh=args.refresh)
    print(json.dumps(asdict(tuned), indent=1))
    print(f"{tuned.order[0]}: {tuned.summary(tuned.order[0])}", file=sys.stderr)
    if tuned.loaded:
        raise SystemExit(3)


def cmd_inspect_draft(args: argparse.Namespace) -> None:
    from .inspect_draft import inspect_draft

    print(inspect_draft(args.path, args.target, args.allow_pickle))


def cmd_export_llamacpp(args: argparse.Namespace) -> None:
    from .export_llamacpp import export_llamacpp

    print(f"wrote {export_llamacpp(args.head, args.out, args.target)}")


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

    t = sub.add_parser("tune", help="the fastest target weights and tree on this machine: "
                       "measured and cached once (the app does this after its first start), "
                       "read from the cache afterwards")
    add_engine_args(t)
    t.add_argument("--refresh", action="store_true",
                   help="measure again even when a measurement is cached")
    t.add_argument("--single-weights", action="store_true",
                   help="measure only --weights, not also the other format")
    t.set_defaults(func=cmd_tune)

    i = sub.add_parser("inspect-draft", help="print the resolved config of an EAGLE-3 head")
    i.add_argument("path", metavar="HEAD", help="head directory, bundled head name "
                   "(e.g. eagle3-aux-1layer) or hub id")
    i.add_argument("--target", default=None, help="check against this target (optional)")
    i.add_argument("--allow-pickle", action="store_true")
    i.set_defaults(func=cmd_inspect_draft)

    x = sub.add_parser("export-llamacpp", help="write a head as llama.cpp's EAGLE-3 GGUF "
                       "(for llama-speculative-simple --spec-type draft-eagle3)")
    x.add_argument("head", metavar="HEAD", nargs="?", default="eagle3-aux-1layer",
                   help="head directory or bundled head name (default: the default head)")
    x.add_argument("--out", type=Path, required=True, help="the .gguf to write")
    x.add_argument("--target", default="bundled",
                   help="'bundled' or the target's .gguf (its tokenizer goes into the file)")
    x.set_defaults(func=cmd_export_llamacpp)

    from ..train.evaluate import add_eval_parser
    from ..train.pipeline import add_train_parser
    from .bench import add_bench_parser
    from .selfcheck import add_selfcheck_parser

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
