"""How soon does the app serve, and answer, after `python app.py`?

    PYTHONPATH=. python benchmarks/startup.py [--cache warm|first|cold] [--busy N] [--json DIR]

Starts `python app.py` as `make app` does (host and port from the Gradio env vars), beside
`--busy` N processes that spin on a core each, and times from the start: when the page serves
(HTTP 200), the first token of a chat message sent the moment it serves (streamed through
`gradio_client`, as a browser sees frames), that answer's end, and when the log says the
start-up measurements ended. `--cache`: `warm` (the caches as they are), `first` (a first
start's measurement: an empty autotune cache, the converted target and built kernels kept),
`cold` (an empty cache: the GGUF conversion and the kernel build too). Prints one JSON object.
Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from benchmarks.contention import busy
from eagle_engine import hardware
from eagle_engine.tools.bench import provenance, write_report
from tests.app_fixtures import free_port

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that reverses a string."
MEASURED = re.compile(r"start-up measurements done in ([\d.]+) s")
TUNE = {"stopped measuring": "stopped: the machine was busy", "cached in": "measured and cached"}


def cache_home(mode: str, stack: ExitStack) -> str | None:
    """XDG_CACHE_HOME for `mode` (None: the user's own)."""
    if mode == "warm":
        return None
    home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="startup-cache-")))
    if mode == "first":  # everything but the autotune measurement
        real = hardware.cache_root().parent
        for entry in real.iterdir():
            (home / entry.name).symlink_to(entry)
        (home / "eagle_engine").unlink()
        (home / "eagle_engine").mkdir()
        for entry in hardware.cache_root().iterdir():
            if entry.name != "autotune":
                (home / "eagle_engine" / entry.name).symlink_to(entry)
    return str(home)


def first_answer(url: str, t0: float) -> tuple[float, float]:
    """Seconds from `t0` to the first frame with answer text, and to the answer's end."""
    from gradio_client import Client

    job = Client(url, verbose=False).submit(PROMPT, max_new_tokens=128, api_name="/chat")
    first = None
    for frame in job:
        chat = frame[1] or []
        if first is None and chat and chat[-1].get("content"):
            first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def run(mode: str, n_busy: int, timeout: float, log_path: Path) -> dict:
    with ExitStack() as stack:
        env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1",
               "GRADIO_SERVER_PORT": str(port := free_port()), "GRADIO_ANALYTICS_ENABLED": "False"}
        if (home := cache_home(mode, stack)) is not None:
            env["XDG_CACHE_HOME"] = home
        stack.enter_context(busy(n_busy))
        url = f"http://127.0.0.1:{port}/"
        t0 = time.perf_counter()
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, "app.py"], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        try:
            served = None
            while served is None and time.perf_counter() - t0 < timeout:
                if proc.poll() is not None:
                    raise SystemExit(f"app.py exited: {log_path.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(url, timeout=2):
                        served = time.perf_counter() - t0
                except OSError:
                    time.sleep(0.2)
            if served is None:
                raise SystemExit(f"not served after {timeout} s")
            token, done = first_answer(url, t0)
            measured = None
            while measured is None and time.perf_counter() - t0 < timeout:
                if MEASURED.search(log_path.read_text()) is not None:
                    measured = time.perf_counter() - t0
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"cache": mode, "busy": n_busy, "served_s": round(served, 1),
            "first_token_s": round(token, 1), "first_token_after_serving_s":
            round(token - served, 2), "answer_done_s": round(done, 1),
            "measurements_done_s": measured and round(measured, 1),
            "tune": next((v for k, v in TUNE.items() if k in log_path.read_text()), "none")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=["warm", "first", "cold"], default="warm")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on a core each")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None,
                   help="a file, or a folder for startup-{class}.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.cache, args.busy, args.timeout, Path(tmp) / "app.log")
    report = {"kind": "startup", "provenance": provenance(), **result}
    print(json.dumps(report, indent=1))
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
