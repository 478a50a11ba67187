"""The app's speed around the engine: which thread steps it, and how often a frame is drawn.

    PYTHONPATH=. python benchmarks/app_speed.py threads [--tokens 128] [--repeats 3]
    PYTHONPATH=. python benchmarks/app_speed.py frames [--tokens 128] [--repeats 3]
    PYTHONPATH=. python benchmarks/app_speed.py browser [--tokens 160] [--repeats 3] \
        [--intervals 0.1,0.25] [--progress full,minimal] [--panel-intervals 0,1] [--plain]

`threads`: loads the bundled engine on an `serving.EngineThread` and times greedy EAGLE and baseline
answers there, then the same answers stepped from a second thread, as Gradio's worker threads
stepped the engine before the app had an engine thread. (After the second thread has run
OpenMP work, the first is slow too: libgomp throttles every pool once there are more OpenMP
threads than cores, so the order matters and the script keeps it.)
`frames`: launches the app in-process twice on 127.0.0.1, drawing a frame for every engine
event (interval 0) and at most every `handlers.FRAME_INTERVAL_S`, and sends the same /chat request to
each through `gradio_client`: seconds until the answer is complete on the client, frames
received, and the engine's own tokens/s.
`browser`: launches the app in-process once per setting, each frame interval of `--intervals` with
each progress display of `--progress` (Gradio's `show_progress` on the status line) and each
interval of `--panel-intervals` at which the panels under the chat (tiles, step plot, tree,
timing) move while an answer streams (0: in every frame; the estimate's plain-decoding speeds
measured once at start-up, as the app does), and opens them in headless
Chromium (Debian's, as the browser tests do) on the same cores, as a visitor who runs the app on
their own machine does. In rounds that take the settings in turn, it opens a fresh page of the
setting, types each of `BROWSER_PROMPTS`, presses Send, and closes the page: one page at a time,
since an idle page uses CPU too. Per setting: the engine's tokens/s and the seconds until the
answer was on screen, as the status line reports them, and the CPU seconds of Chromium's processes
while each answer streamed, summed over the answers; the mean of the estimates the speedup tile
showed. With `--plain`, each prompt is also asked with speculative decoding off (the two in an
order that alternates by round; a plain answer refreshes the estimate's speed, as in the app), and
each setting reports the speedup of the two engine speeds under the same browser.
Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import threading
import time
from typing import Any

import psutil

from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD
from playground import handlers, layout, serving, startup
from playground.speed_estimate import measure

PROMPT = "Give me three tips for staying productive."
BROWSER_PROMPTS = ["Write a Python function that checks whether a number is prime.",
                   "Give me three tips for staying productive.",
                   "Write a Python function that reverses a string."]
# the status line when an answer is done (handlers.Playground.run)
ESTIMATE = re.compile(r"≈(\d+\.\d+)×")  # the speedup tile's estimate
DONE = re.compile(r"Done · (\d+) tokens in ([\d.]+) s of engine time \(([\d.]+) s on screen\)")
# true once the page shows a new answer as done (the progress text gone from the status line)
DONE_JS = """(answers) => {
  const status = document.querySelector('#status').innerText;
  return status.includes('Done') && !status.includes('processing')
      && document.querySelectorAll('#chat [data-testid=bot]').length > answers; }"""


def answer_speeds(engine: Any, tokens: int, repeats: int) -> dict[str, float]:
    """Median engine tokens/s of `repeats` greedy answers, EAGLE (default tree) and baseline."""
    ids = engine.encode(PROMPT)
    params = SamplingParams(max_new_tokens=tokens)
    out = {}
    for label, head in (("eagle", DEFAULT_HEAD), ("baseline", None)):
        speeds = sorted(engine.generate(ids, params, TreeParams(), head).stats.tokens_per_s
                        for _ in range(repeats))
        out[label] = round(speeds[len(speeds) // 2], 1)
    return out


def in_new_thread(fn: Any, *args: Any) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    return result[0]


def threads(args: argparse.Namespace) -> dict:
    worker = serving.EngineThread()
    engine = worker.call(startup.load_engines, startup.parse_args(["--single-weights"]))[0][0]
    return {"engine_thread": worker.call(answer_speeds, engine, args.tokens, args.repeats),
            "second_thread": in_new_thread(answer_speeds, engine, args.tokens, args.repeats)}


def frames(args: argparse.Namespace) -> dict:
    from gradio_client import Client

    worker = serving.EngineThread()
    engines, _ = worker.call(startup.load_engines, startup.parse_args(["--single-weights"]))
    clients = {}
    for interval in (0.0, handlers.FRAME_INTERVAL_S):
        demo = layout.build_demo(engines, worker, frame_interval=interval)
        demo.queue(max_size=16, default_concurrency_limit=1)
        _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
        clients[interval] = Client(url, verbose=False, analytics_enabled=False)
    runs: dict[float, list[tuple[float, int, float]]] = {i: [] for i in clients}
    for _ in range(args.repeats):
        for interval, client in clients.items():
            t0 = time.perf_counter()
            job = client.submit(PROMPT, max_new_tokens=args.tokens, temperature=0.0,
                                api_name="/chat")
            run = job.result(timeout=300)[-1]
            runs[interval].append((time.perf_counter() - t0, len(job.outputs()),
                                   run["stats"]["tokens_per_s"]))
    report = {}
    for interval, rows in runs.items():
        rows.sort()
        seconds, count, tps = rows[len(rows) // 2]
        report[f"interval_{interval:g}s"] = {"answer_s": round(seconds, 2), "frames": count,
                                             "engine_tokens_per_s": round(tps, 1)}
    return report


def ask_in_page(page: Any, prompt: str, tokens: int) -> tuple[int, float, float]:
    """Type `prompt`, press Send, wait until the answer is done -> (tokens, engine seconds,
    seconds on screen) from the status line."""
    box = page.locator("#max-new-tokens input[type=number]")
    box.fill(str(tokens))
    box.press("Enter")
    answers = page.locator("#chat [data-testid=bot]").count()
    page.fill("#prompt textarea", prompt)
    page.click("#send")
    page.wait_for_function(DONE_JS, arg=answers, timeout=300_000)
    n, engine_s, screen_s = DONE.search(page.locator("#status").inner_text()).groups()
    return int(n), float(engine_s), float(screen_s)


def browser_cpu_s() -> float:
    """CPU seconds used so far by the Chromium processes this process started (via Playwright)."""
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if "chrom" in proc.name():
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # a renderer that has just exited
            pass
    return total


def browser(args: argparse.Namespace) -> dict:
    from playwright.sync_api import sync_playwright

    from tests.app_fixtures import CHROMIUM_ARGS

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("browser needs Debian's chromium (apt-get install -y chromium)")
    worker = serving.EngineThread()
    engines, _ = worker.call(startup.load_engines, startup.parse_args(["--single-weights"]))
    # the estimate's plain speeds, measured at start-up as `app.main` does (one copy a setting)
    rates = {e.config.weights_label: worker.call(measure, e) for e in engines}
    settings = [(float(i), p, float(q)) for i in args.intervals.split(",")
                for p in args.progress.split(",") for q in args.panel_intervals.split(",")]
    urls = {}
    for interval, progress, panels in settings:
        demo = layout.build_demo(engines, worker, frame_interval=interval, progress=progress,
                              panel_interval=panels, rates=copy.deepcopy(rates))
        demo.queue(max_size=16, default_concurrency_limit=1)
        _, urls[interval, progress, panels], _ = demo.launch(prevent_thread_lock=True,
                                                             server_name="127.0.0.1", quiet=True)
    modes = (True, False) if args.plain else (True,)
    # per setting and mode: tokens, engine s, on-screen s, browser CPU s, estimates shown
    totals = {(s, m): [0, 0.0, 0.0, 0.0, []] for s in settings for m in modes}
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        for r in range(args.repeats):
            for setting in settings[r % len(settings):] + settings[:r % len(settings)]:
                context = chromium.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.goto(f"{urls[setting]}?__theme=light", wait_until="load")
                page.locator("#send").wait_for(timeout=60_000)
                ask_in_page(page, "Hello", 8)  # warm-up
                for prompt in BROWSER_PROMPTS:
                    for spec in modes[r % len(modes):] + modes[:r % len(modes)]:
                        page.locator("#spec input").set_checked(spec)
                        cpu = browser_cpu_s()
                        got = (*ask_in_page(page, prompt, args.tokens), browser_cpu_s() - cpu)
                        total = totals[setting, spec]
                        total[:4] = [a + b for a, b in zip(total, got)]
                        if spec and (shown := ESTIMATE.search(
                                page.locator("#tile-speedup").inner_text())):
                            total[4].append(float(shown.group(1)))
                context.close()
        chromium.close()
    report = {}
    for (i, p, q) in settings:
        name = f"interval_{i:g}s_progress_{p}_panels_{q:g}s"
        for spec in modes:
            n, engine_s, screen_s, cpu_s, shown = totals[(i, p, q), spec]
            report[f"{name}_{'eagle' if spec else 'plain'}"] = {
                "tokens": n, "engine_tokens_per_s": round(n / engine_s, 1),
                "on_screen_s": round(screen_s, 2), "browser_cpu_s": round(cpu_s, 1),
                **({"mean_estimate_shown": round(sum(shown) / len(shown), 3)} if shown else {})}
        if args.plain:
            eagle, plain = (report[f"{name}_{m}"]["engine_tokens_per_s"]
                            for m in ("eagle", "plain"))
            report[f"{name}_speedup"] = round(eagle / plain, 3)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["threads", "frames", "browser"])
    p.add_argument("--tokens", type=int, default=None, help="128; 160 for browser")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--intervals", default=f"0.1,{handlers.FRAME_INTERVAL_S}",
                   help="browser: comma-separated frame intervals, seconds")
    p.add_argument("--progress", default=layout.PROGRESS,
                   help="browser: comma-separated show_progress values (full, minimal, hidden)")
    p.add_argument("--panel-intervals", default=f"{handlers.PANEL_INTERVAL_S:g}",
                   help="browser: comma-separated intervals of the panels under the chat, "
                   "seconds")
    p.add_argument("--plain", action="store_true",
                   help="browser: also ask each prompt with speculative decoding off (the "
                   "order alternates by round), and report the speedup under the same load")
    args = p.parse_args()
    args.tokens = args.tokens or (160 if args.mode == "browser" else 128)
    modes = {"threads": threads, "frames": frames, "browser": browser}
    print(json.dumps(modes[args.mode](args), indent=1))


if __name__ == "__main__":
    main()
