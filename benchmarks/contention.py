"""Decoding speed while other processes take the cores: ours against llama.cpp's binary.

    PYTHONPATH=. python benchmarks/contention.py [--rounds 10] [--tokens 128] \
        [--llama-cpp-bin "$LLAMA_CPP_BIN"] [--json docs/figures]

One process, the bundled q4 target and its default head with this CPU class's tree. For each
load (quiet, one process spinning on a core, one per core of `--threads`), `--rounds` rounds
of: ours plain and EAGLE-3 as the engine runs (its thread governor on,
`eagle_engine/cpu_share.py`), the same with the governor off (every step on `--threads`
threads, as before it existed), and with `--llama-cpp-bin` llama.cpp's `llama-bench` (decoding
only, one repetition a round), all on the same `--threads`. Each round's figure is decoding
tokens/s (ours: the answer's tokens after the first over the time after its prefill). Prints,
per load and system, every round's figure, the median, and the lowest round as a share of the
system's quiet median: the check is that under load every round of ours keeps at least
llama.cpp's share and 20% of its quiet speed. Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.models.loader import bundled_gguf_path
from eagle_engine.tools.bench import provenance, write_report

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
FLOOR = 0.2  # no round below this share of its system's quiet speed


@contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` processes spinning on a core each."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def ours(engine: EagleEngine, ids: list[int], tokens: int, head: str | None, governed: bool,
         threads: int) -> float:
    """Decoding tokens/s of one answer; `governed`: the engine's thread governor on."""
    scheduler = engine.scheduler
    governor = scheduler.governor
    if not governed:
        scheduler.governor = None
        torch.set_num_threads(threads)
    try:
        out = engine.generate(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                              None, head)
    finally:
        scheduler.governor = governor
    return (len(out.token_ids) - 1) / (out.stats.elapsed_s - out.stats.prefill_s)


def llama_bench(bin_dir: Path, tokens: int, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(bundled_gguf_path()),
                          "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
                          "-fa", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--llama-cpp-bin", type=Path, default=None,
                   help="folder with llama.cpp's llama-bench")
    p.add_argument("--json", type=Path, default=None,
                   help="a file, or a folder for contention-{class}.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = EagleEngine.load(EngineConfig(drafts=(DEFAULT_HEAD,)))
    ids = engine.encode(PROMPT)
    systems: dict[str, Callable[[], float]] = {
        "ours plain": lambda: ours(engine, ids, args.tokens, None, True, args.threads),
        "ours EAGLE-3": lambda: ours(engine, ids, args.tokens, DEFAULT_HEAD, True, args.threads),
        "ours plain, no governor": lambda: ours(engine, ids, args.tokens, None, False,
                                                args.threads),
        "ours EAGLE-3, no governor": lambda: ours(engine, ids, args.tokens, DEFAULT_HEAD, False,
                                                  args.threads)}
    if args.llama_cpp_bin:
        systems["llama.cpp llama-bench"] = lambda: llama_bench(args.llama_cpp_bin, args.tokens,
                                                               args.threads)
    for run in systems.values():  # warm-up: kernels, caches, the page cache of the GGUF
        run()
    loads = {"quiet": 0, "1 busy process": 1, f"{args.threads} busy processes": args.threads}
    rates: dict[str, dict[str, list[float]]] = {}
    for load, n in loads.items():
        with busy(n):
            rates[load] = {name: [] for name in systems}
            for r in range(args.rounds):
                names = list(systems)
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotated
                    rates[load][name].append(round(systems[name](), 1))
        print(load, {k: statistics.median(v) for k, v in rates[load].items()}, file=sys.stderr)
    quiet = {name: statistics.median(rates["quiet"][name]) for name in systems}
    table = {load: {name: {"rounds": v, "median": statistics.median(v),
                           "median_share": round(statistics.median(v) / quiet[name], 3),
                           "lowest_share": round(min(v) / quiet[name], 3)}
                    for name, v in by_system.items()} for load, by_system in rates.items()}
    report = {"kind": "contention", "provenance": provenance(), "tokens": args.tokens,
              "threads": args.threads, "loads": table, "floor": FLOOR,
              "tree": engine.default_tree.spec()}
    print(json.dumps(report, indent=1))
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
