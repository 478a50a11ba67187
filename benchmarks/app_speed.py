"""The app's speed around the engine: which thread steps it, and how often a frame is drawn.

    PYTHONPATH=. python benchmarks/app_speed.py threads [--tokens 128] [--repeats 3]
    PYTHONPATH=. python benchmarks/app_speed.py frames [--tokens 128] [--repeats 3]

`threads`: loads the bundled engine on an `app.EngineThread` and times greedy EAGLE and baseline
answers there, then the same answers stepped from a second thread, as Gradio's worker threads
stepped the engine before the app had an engine thread. (After the second thread has run
OpenMP work, the first is slow too: libgomp throttles every pool once there are more OpenMP
threads than cores, so the order matters and the script keeps it.)
`frames`: launches the app in-process twice on 127.0.0.1, drawing a frame for every engine
event (interval 0) and at most every `app.FRAME_INTERVAL_S`, and sends the same /chat request to
each through `gradio_client`: seconds until the answer is complete on the client, frames
received, and the engine's own tokens/s. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import app
from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD

PROMPT = "Give me three tips for staying productive."


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
    worker = app.EngineThread()
    engine = worker.call(app.load_engines, app.parse_args(["--single-weights"]))[0]
    return {"engine_thread": worker.call(answer_speeds, engine, args.tokens, args.repeats),
            "second_thread": in_new_thread(answer_speeds, engine, args.tokens, args.repeats)}


def frames(args: argparse.Namespace) -> dict:
    from gradio_client import Client

    worker = app.EngineThread()
    engines = worker.call(app.load_engines, app.parse_args(["--single-weights"]))
    clients = {}
    for interval in (0.0, app.FRAME_INTERVAL_S):
        demo = app.build_demo(engines, worker, frame_interval=interval)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["threads", "frames"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(json.dumps(threads(args) if args.mode == "threads" else frames(args), indent=1))


if __name__ == "__main__":
    main()
