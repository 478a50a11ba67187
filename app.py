"""EAGLE-3 Playground: a Gradio chat over `eagle_engine` that streams every draft/verify step as
coloured token spans, with sidebar controls, speed tiles, the draft tree and the race of an
answer and plain decoding.

This file starts the app: it loads and warms up the engines (`playground/startup.py`), builds
the page (`playground/layout.py`, the handlers in `playground/handlers.py`) and launches it on
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT; the measurements behind the speedup estimate and, at a
first start on a CPU, the choice of weights and tree run once it serves, between visitors'
answers (`playground/background.py`). With `--max-batch` B > 1 (the default) up to B visitors
are answered at once: their requests go to the engine's own `Scheduler`, stepped together on
the engine thread; B = 1 answers one request at a time. `python app.py --help` lists the flags.
Not here: the page, the handlers or drawing (`playground/`), decoding (`eagle_engine/`).
"""
from __future__ import annotations

import gc
import logging
import sys

import gradio as gr

from eagle_engine import memory
from eagle_engine.config import ConfigError
from playground import ui_render as ui
from playground.background import StartupWork
from playground.layout import CSS, build_demo
from playground.serving import EngineThread, Visitors
from playground.speed_estimate import VerifyCost
from playground.startup import load_engines, parse_args

log = logging.getLogger("app")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own startup probes
    args = parse_args(argv)
    memory.tune_malloc()  # before the engines allocate
    worker = EngineThread()
    try:
        engines, tune = worker.call(load_engines, args)
    except ConfigError as e:  # a target or head that cannot serve: one line, as argparse says it
        print(f"app.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    head = ui.default_head(engines[0].head_info())
    costs: dict[str, VerifyCost | None] = {}
    visitors = Visitors()
    work = StartupWork(engines, head and head.name, worker, visitors, costs, tune)
    demo = build_demo(engines, worker, costs=costs, max_batch=engines[0].config.max_batch,
                      visitors=visitors, startup=work)
    demo.queue(max_size=16, default_concurrency_limit=1)
    # The loaded engines and UI are ~0.5M tracked objects that live as long as the process: a
    # full collection walks them all and stalls a streaming answer for ~0.2 s.
    gc.freeze()
    log.info("%d objects of the loaded engines and UI left out of garbage collection",
             gc.get_freeze_count())
    demo.launch(theme=gr.themes.Soft(), css_paths=[CSS], footer_links=["api", "gradio"],
                state_session_capacity=args.max_sessions, prevent_thread_lock=True)
    work.start()  # once the page serves
    demo.block_thread()


if __name__ == "__main__":
    main()
