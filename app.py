"""EAGLE-3 Playground: a Gradio chat over `eagle_engine` that streams every draft/verify step as
coloured token spans, with sidebar controls, speed tiles, the draft tree and the race of an
answer and plain decoding.

This file starts the app: it loads and warms up the engines (`playground/startup.py`), measures
the verify cost behind the speedup estimate, builds the page (`playground/layout.py`, the
handlers in `playground/handlers.py`) and launches it on GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT. With `--max-batch` B > 1 (the default) up to B visitors are answered at
once: their requests go to the engine's own `Scheduler`, stepped together on the engine thread;
B = 1 answers one request at a time. `python app.py --help` lists the flags.
Not here: the page, the handlers or drawing (`playground/`), decoding (`eagle_engine/`).
"""
from __future__ import annotations

import gc
import logging
import sys
import time

import gradio as gr

from eagle_engine import memory
from eagle_engine.config import ConfigError
from playground import ui_render as ui
from playground.layout import CSS, build_demo
from playground.serving import EngineThread
from playground.speed_estimate import VerifyCost
from playground.startup import fill_cost, load_engines, parse_args

log = logging.getLogger("app")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own startup probes
    args = parse_args(argv)
    memory.tune_malloc()  # before the engines allocate
    worker = EngineThread()
    try:
        engines = worker.call(load_engines, args)
    except ConfigError as e:  # a target or head that cannot serve: one line, as argparse says it
        print(f"app.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.perf_counter()
    first = engines[0].config.weights_label
    head = ui.default_head(engines[0].head_info())
    head = head and head.name
    costs: dict[str, VerifyCost | None] = {}
    worker.call(fill_cost, engines[0], head, costs)
    log.info("verify cost of the %s weights measured in %.1f s (for the speedup estimate)%s",
             first, time.perf_counter() - t0, "; the other weights' is measured on the engine "
             "thread as the UI starts" if len(engines) > 1 else "")
    for engine in engines[1:]:
        worker.submit(fill_cost, engine, head, costs)
    demo = build_demo(engines, worker, costs=costs, max_batch=engines[0].config.max_batch)
    demo.queue(max_size=16, default_concurrency_limit=1)
    # The loaded engines and UI are ~0.5M tracked objects that live as long as the process: a
    # full collection walks them all and stalls a streaming answer for ~0.2 s.
    gc.freeze()
    log.info("%d objects of the loaded engines and UI left out of garbage collection",
             gc.get_freeze_count())
    demo.launch(theme=gr.themes.Soft(), css_paths=[CSS], footer_links=["api", "gradio"],
                state_session_capacity=args.max_sessions)


if __name__ == "__main__":
    main()
