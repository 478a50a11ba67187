"""How close is the app's estimated speedup (playground/speed_estimate.py) to the measured one,
on a quiet machine and under load?

    PYTHONPATH=. python benchmarks/speedup_estimate.py [--load none,busy,browser] \
        [--tokens 128] [--repeats 2] [--prompts 5] [--json docs/figures]

Loads the app's engines as `python app.py` does (the measured weights and tree) and measures
the target's verify cost at warm-up, on the quiet machine, as the app does. Then, per load of
`--load`, answers each of the first `--prompts` of `PROMPTS` `--repeats` times in turn with
"compare" on: the answer's estimate (made from its own verify forwards, before its plain
decoding ran) against the speedup its plain decoding measured, and the relative error.
Loads: `none` answers through `handlers.Playground` in-process; `busy` does the same with one
`while True: pass` process per core running; `browser` launches the app in-process and asks in
headless Chromium (Debian's, as the browser tests use) on the same cores, reading both figures
from the speedup tile (two decimals). Prints a JSON line per answer, then a table per load and
the mean and largest absolute error. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from eagle_engine.tools.bench import provenance, write_report
from playground import handlers, layout, serving, startup
from playground import ui_render as ui
from playground.speed_estimate import measure

LOADS = ("none", "busy", "browser")
PROMPTS = ["Write a Python function that checks whether a string is a palindrome, ignoring "
           "punctuation and case, and explain it briefly.",
           "Give me three tips for staying productive.",
           "Rewrite this sentence in a formal tone: hey, the meeting got moved to friday, "
           "so don't forget to bring the slides.",
           "Explain photosynthesis in two sentences.",
           "List five countries in Europe and their capitals."]
# the speedup tile with "compare" on: the measured value, the estimate in its label
TILE = re.compile(r"(\d+\.\d+)×\s*this answer, raced; estimated ≈(\d+\.\d+)×")


@contextmanager
def busy_cores() -> Iterator[None]:
    """One busy-looping process per core while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def in_process(pg: handlers.Playground, settings: Callable[[str], ui.Settings]
               ) -> Callable[[str], tuple[int, float, float]]:
    def ask(prompt: str) -> tuple[int, float, float]:
        record = list(pg.run([], prompt, settings(prompt)))[-1][handlers.OUTPUTS.index("run")]
        return record["stats"]["num_tokens"], record["speedup_estimate"], record["speedup"]
    return ask


@contextmanager
def in_browser(engines: list[Any], worker: serving.EngineThread, costs: dict, tokens: int
               ) -> Iterator[Callable[[str], tuple[int, float, float]]]:
    """The app launched in-process, asked in headless Chromium: a fresh page per answer."""
    from playwright.sync_api import sync_playwright

    from benchmarks.app_speed import ask_in_page
    from tests.app_fixtures import CHROMIUM_ARGS

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("--load browser needs Debian's chromium (apt-get install -y chromium)")
    demo = layout.build_demo(engines, worker, costs=costs)
    demo.queue(max_size=16, default_concurrency_limit=1)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)

        def ask(prompt: str) -> tuple[int, float, float]:
            context = chromium.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.goto(f"{url}?__theme=light", wait_until="load")
            page.locator("#send").wait_for(timeout=60_000)
            page.locator("#compare input").set_checked(True)
            n, _, _ = ask_in_page(page, prompt, tokens)
            shown = TILE.search(page.locator("#tile-speedup").inner_text().replace("\n", " "))
            context.close()
            if shown is None:
                raise RuntimeError("the speedup tile shows no measured speedup and estimate")
            return n, float(shown.group(2)), float(shown.group(1))
        try:
            yield ask
        finally:
            chromium.close()
            demo.close()


def table(rows: list[dict]) -> str:
    lines = ["| load | prompt | tokens | estimate | measured | error |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['load']} | {r['prompt']} | {r['tokens']} | {r['estimate']:.3f} | "
              f"{r['measured']:.3f} | {100 * r['error']:+.1f}% |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default="none", help=f"comma-separated loads of {LOADS}")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"the first this many prompts (1..{len(PROMPTS)})")
    p.add_argument("--json", type=Path, default=None, help="a file, or a folder for "
                   "speedup-estimate-{class}.json (rendered by benchmarks/report.py)")
    args = p.parse_args()
    loads = args.load.split(",")
    if bad := [x for x in loads if x not in LOADS]:
        p.error(f"--load: unknown {bad}; choose from {LOADS}")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    worker = serving.EngineThread()
    engines, _ = worker.call(startup.load_engines, startup.parse_args(["--single-weights"]))
    weights = engines[0].config.weights_label
    head = ui.default_head(engines[0].head_info())
    costs: dict = {}
    costs[weights] = worker.call(measure, engines[0], head.name)  # quiet, as the app measures
    tree = engines[0].default_tree

    def settings(prompt: str) -> ui.Settings:
        return ui.Settings(True, head.use_aux, head.num_layers, tree.topk, tree.num_steps,
                           tree.num_draft_tokens, 0.0, 1.0, args.tokens, 0, True, weights,
                           tree.context_drafts, tree.min_score, tree.context_extra,
                           tree.step_cut)
    rows, summary = [], {}
    for load in loads:
        pg = handlers.Playground(engines, worker, handlers.FRAME_INTERVAL_S, costs)
        with (busy_cores() if load == "busy" else nullcontext(),
              in_browser(engines, worker, costs, args.tokens) if load == "browser"
              else nullcontext(in_process(pg, settings)) as ask):
            for rep in range(args.repeats):
                for prompt in PROMPTS[:args.prompts]:
                    n, est, measured = ask(prompt)
                    rows.append({"load": load, "repeat": rep, "prompt": prompt[:40],
                                 "tokens": n, "estimate": est, "measured": measured,
                                 "error": est / measured - 1})
                    print(json.dumps(rows[-1]), flush=True)
        errors = [abs(r["error"]) for r in rows if r["load"] == load]
        summary[load] = {"mean_abs_error": round(sum(errors) / len(errors), 3),
                         "max_abs_error": round(max(errors), 3)}
    print(table(rows))
    report = {"kind": "speedup_estimate", "weights": weights, "tree": tree.spec(),
              "head": head.name, "tokens": args.tokens, "summary": summary, "rows": rows,
              "provenance": provenance()}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.json:
        print(f"wrote {write_report(args.json, report)}")


if __name__ == "__main__":
    main()
