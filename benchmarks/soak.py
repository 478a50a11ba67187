"""Does the playground's resident memory stay bounded through many visitors, and does every
answer stay right?

    PYTHONPATH=. python benchmarks/soak.py --answers 10000 --visitors 8 --out docs/figures \
        [-- extra app.py arguments, e.g. --max-batch 1]

Starts `app.py` on a loopback port (its defaults, `--no-tune`) and sends `--answers` answers
from `--visitors` threads, each answer from a new `gradio_client.Client` (a new Gradio
session), as visitors who come once. Of every ten answers, one is cancelled after its first
frames and one is sampled with a seed (checked against the same request's first answer); the
rest are greedy, each checked against the prompt's solo answer (asked first, one at a time).
Prompts are user turns of the bundled conversations, some with an earlier turn and its answer
before them (prefix reuse). The server's resident memory (VmRSS) is sampled every
`--sample-s` seconds. Reports the start-up memory, the samples, the growth over the second
half of the run, the answers checked, wrong and failed, and exits 1 on any wrong or failed
answer. Bounded by `--answers` and `--max-seconds`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.load import CHAT_OUT, FALLBACK, PROMPTS, Server
from eagle_engine.tools.bench import provenance, write_report

GREEDY, SAMPLED, CANCELLED = "greedy", "sampled", "cancelled"


def prompts(n: int) -> list[str]:
    rows = [json.loads(line)["turns"] for line in PROMPTS.read_text().splitlines()
            ] if PROMPTS.is_file() else FALLBACK
    return [turn for row in rows for turn in row][:n]


def answer(server: Server, prompt: str, kind: str, max_new_tokens: int, seed: int
           ) -> str | None:
    """One answer from a new session; None when cancelled."""
    client = server.client()
    sampled = kind == SAMPLED
    job = client.submit(prompt, max_new_tokens=max_new_tokens,
                        temperature=0.7 if sampled else 0.0, top_p=0.9, seed=seed,
                        api_name="/chat")
    if kind == CANCELLED:
        for i, _ in enumerate(job):
            if i >= 2:
                break
        job.cancel()
        return None
    return job.result()[CHAT_OUT["run"]]["text"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", type=int, default=2000)
    p.add_argument("--visitors", type=int, default=8)
    p.add_argument("--prompts", type=int, default=24, help="distinct prompts")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--max-seconds", type=float, default=3600)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("app_args", nargs="*", help="after --: more app.py arguments")
    args = p.parse_args(argv)
    if not (1 <= args.visitors <= 32 and 1 <= args.answers <= 100_000):
        raise SystemExit("--visitors must be in [1, 32] and --answers in [1, 100000]")
    texts = prompts(args.prompts)
    server = Server("soak", ["--no-tune", "--single-weights", *args.app_args], Path("/tmp"),
                    ready_s=600)
    report: dict[str, Any] = {
        "kind": " ".join(["soak", *args.app_args]), "args": vars(args) | {"out": str(args.out)},
        "provenance": provenance()}
    try:
        report["startup_rss_mb"] = server.rss()
        solo = {t: answer(server, t, GREEDY, args.max_new_tokens, 0) for t in texts}
        first_sampled: dict[tuple[str, int], str] = {}
        counts = {"done": 0, "checked": 0, "wrong": 0, "failed": 0, "cancelled": 0, "sampled": 0}
        samples: list[tuple[float, float, int]] = []  # (seconds, VmRSS MB, answers done)
        lock = threading.Lock()
        t0 = time.perf_counter()
        deadline = t0 + args.max_seconds
        todo = iter(range(args.answers))

        def visit(v: int) -> None:
            rng = random.Random(v)
            while time.perf_counter() < deadline:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                text = rng.choice(texts)
                kind = CANCELLED if i % 10 == 3 else SAMPLED if i % 10 == 7 else GREEDY
                seed = i % 5
                try:
                    got = answer(server, text, kind, args.max_new_tokens, seed)
                except Exception as e:  # noqa: BLE001 - counted, the soak goes on
                    print(f"answer {i} failed: {e!r}", file=sys.stderr)
                    with lock:
                        counts["failed"] += 1
                    continue
                with lock:
                    if kind == CANCELLED:
                        counts["cancelled"] += 1
                    elif kind == SAMPLED:
                        counts["sampled"] += 1
                        want = first_sampled.setdefault((text, seed), got)
                        counts["wrong"] += got != want
                    else:
                        counts["checked"] += 1
                        counts["wrong"] += got != solo[text]
                    counts["done"] += 1

        threads = [threading.Thread(target=visit, args=(v,), daemon=True)
                   for v in range(args.visitors)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            samples.append((round(time.perf_counter() - t0, 1), server.rss(),
                            counts["done"]))
            print(f"{samples[-1][0]:8.1f}s  {samples[-1][2]:6d} answers  "
                  f"{samples[-1][1]:7.1f} MB", flush=True)
            time.sleep(args.sample_s)
        samples.append((round(time.perf_counter() - t0, 1), server.rss(), counts["done"]))
        half = [mb for _, mb, done in samples if done >= counts["done"] / 2]
        report |= {"counts": counts, "seconds": samples[-1][0], "rss_samples": samples,
                   "peak_rss_mb": max(mb for _, mb, _ in samples),
                   "second_half_rss_mb": [min(half), max(half)]}
    finally:
        server.stop()
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))
    if args.out:
        print(f"wrote {write_report(args.out, report)}")
    if report["counts"]["wrong"] or report["counts"]["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
