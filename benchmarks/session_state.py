"""How much memory does Gradio keep per page session of the playground, and does the app's cap
bound it?

    PYTHONPATH=. python benchmarks/session_state.py [--sessions 400] [--cap 256]

Builds the real page over a stand-in engine (a fixed answer: no model), launches it in-process
on loopback with `state_session_capacity` = `--cap`, and sends one chat answer from each of
`--sessions` new `gradio_client` sessions. Reports the Python heap that `tracemalloc` sees per
session (before the cap is reached), the sessions Gradio holds at the end, and the heap then.
"""
from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import app  # noqa: E402
from tests.app_fixtures import fixed_events  # noqa: E402
from tests.test_app_api import FakeEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--cap", type=int, default=app.MAX_SESSIONS)
    args = p.parse_args()
    from gradio_client import Client

    demo = app.build_demo([FakeEngine(fixed_events.__wrapped__())])
    demo.queue(max_size=16, default_concurrency_limit=1)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True,
                            state_session_capacity=args.cap)
    try:
        Client(url, analytics_enabled=False, verbose=False).predict("hi", api_name="/chat")
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        at_cap = None
        for i in range(args.sessions):
            Client(url, analytics_enabled=False, verbose=False).predict("hi", api_name="/chat")
            if i + 2 == args.cap:
                at_cap = tracemalloc.get_traced_memory()[0] - base
        end = tracemalloc.get_traced_memory()[0] - base
        report = {"sessions": args.sessions, "cap": args.cap,
                  "held_at_end": len(demo.state_holder.session_data),
                  "heap_mb_per_session_below_cap":
                      round(at_cap / (args.cap - 1) / 2 ** 20, 3) if at_cap else None,
                  "heap_mb_at_end": round(end / 2 ** 20, 1)}
    finally:
        demo.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
