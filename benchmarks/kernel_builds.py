"""Does a build of the q4 CPU kernels with other compiler flags decode faster or slower, end to end?

    PYTHONPATH=. python benchmarks/kernel_builds.py --prompts ../shared/data/prompts/mtbench.jsonl \
        --compare-flags=-DLOWBIT_IN_ORDER=0 [--limit 80] [--sweep "k=3,s=1,n=4,cut=0.05;k=2,s=1,n=3,cut=0.05"] \
        [--max-new-tokens 128]

One process, the bundled q4 target and the default head: plain decoding and each tree of
`--sweep`, once with the default build of `kernels/cpu_lowbit.cpp` and once with the build that
adds `--compare-flags` (`-DLOWBIT_IN_ORDER=0`: the integer sums free to be reassociated;
`-DLOWBIT_PREFETCH_BYTES=0`: no prefetch hints; `-mno-avx512vnni`: the AVX2 products on a VNNI
CPU), through `bench.run_modes` (conversations, the order rotated per question). Before each
answer the engine's kernels are pointed at that system's build, so every system shares the
weights and caches; each EAGLE-3 answer is compared with plain decoding of its own build.
Prints `bench`'s figures per system as JSON, with each system's speedup against plain decoding
of its build (`benchmarks/lowbit_kernels.py --compare-flags` times the products alone). Not a
test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

from eagle_engine.autotune import tree_label
from eagle_engine.bench import Run, load_rows, parse_sweep, run_modes
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.kernels import cpu_lowbit


class WithBuild:
    """The engine, its q4 kernels taken from `module` while it answers."""

    def __init__(self, engine: EagleEngine, module: ModuleType) -> None:
        self.engine, self.module = engine, module

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.engine.encode(messages)

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        default = cpu_lowbit.load, cpu_lowbit.built
        cpu_lowbit.load = lambda extra_flags=(): self.module
        cpu_lowbit.built = lambda: self.module
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            cpu_lowbit.load, cpu_lowbit.built = default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per row")
    ap.add_argument("--compare-flags", required=True,
                    help="space-separated compiler flags of the second build")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--sweep", default="k=3,s=1,n=4,cut=0.05", help="trees, TreeParams.parse;...")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(weights="q4"))
    flags = tuple(args.compare_flags.split())
    builds = {"default": WithBuild(engine, cpu_lowbit.load()),
              args.compare_flags: WithBuild(engine, cpu_lowbit.load(flags))}
    trees = parse_sweep(args.sweep)
    runs = [Run(f"{name}: plain", e, None, trees[0]) for name, e in builds.items()]
    runs += [Run(f"{name}: {tree_label(t)}", e, DEFAULT_HEAD, t)
             for t in trees for name, e in builds.items()]
    for e in builds.values():  # warm-up
        e.generate(engine.encode("Hello"), SamplingParams(max_new_tokens=8), trees[0], DEFAULT_HEAD)
    rows = load_rows(args.prompts, args.limit)
    totals = run_modes(rows, runs, SamplingParams(max_new_tokens=args.max_new_tokens), False)
    modes = {label: t.summary() for label, t in totals.items()}
    for label, m in modes.items():
        plain = modes[label.split(": ")[0] + ": plain"]["tokens_per_s"]
        m["speedup_vs_plain"] = round(m["tokens_per_s"] / plain, 3)
    print(json.dumps({"compare_flags": args.compare_flags, "modes": modes}, indent=2))


if __name__ == "__main__":
    main()
