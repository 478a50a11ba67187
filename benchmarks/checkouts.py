"""Is one checkout of the engine faster than another? Both measured in one run, interleaved.

    git worktree add /tmp/before <commit>
    PYTHONPATH=. python benchmarks/checkouts.py --before /tmp/before --after . \
        --prompts data/prompts/mtbench.jsonl [--rounds 6] [--max-new-tokens 64] [--weights q4] \
        [--tree k=1,s=1,n=2]

Starts one worker process per checkout (each imports its own `eagle_engine`, loads the bundled
target in `--weights` with the default head and warms up), then hands them the same workloads
in turn, `--rounds` times, the order of the two flipped every round, so that a slow spell of
the machine falls on both alike: EAGLE-3 and plain decoding of 8 first turns as 8 visitors
with `max_batch` 4 (one scheduler), and of 3 first turns one at a time (`generate`). Greedy,
EOS ignored. Prints tokens/s per checkout, the ratio after / before, and how many answers the
two checkouts gave token for token alike. The workers use only the engine's public calls
(`EagleEngine.load`, `encode`, `generate`, `scheduler`), so older checkouts run too. Not a
test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = ("eagle, 8 visitors", "plain, 8 visitors", "eagle, alone", "plain, alone")
WORKER = '''
import json, sys, time
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()][:8]
dense = sys.argv[3] != "q4"
engine = EagleEngine.load(EngineConfig(drafts=(DEFAULT_HEAD,), weights="dense" if dense else "q4",
                                       dtype=sys.argv[3] if dense else "fp32"))
prompts = [engine.encode(r["turns"][0]) for r in rows]
params = SamplingParams(max_new_tokens=int(sys.argv[2]), ignore_eos=True)
tree = TreeParams.parse(sys.argv[4]) if sys.argv[4] else None  # None: the engine's default


def together(head):
    scheduler = engine.scheduler  # max_batch 4, the config's default
    handles = [scheduler.submit(p, params, tree, head) for p in prompts]
    scheduler.run_until_idle()
    return [[t.token_id for ev in h.events() for t in ev.tokens] for h in handles]


def alone(head):
    return [engine.generate(p, params, tree, head).token_ids for p in prompts[:3]]


work = {"eagle, 8 visitors": lambda: together(DEFAULT_HEAD), "plain, 8 visitors":
        lambda: together(None), "eagle, alone": lambda: alone(DEFAULT_HEAD),
        "plain, alone": lambda: alone(None)}
for fn in work.values():
    fn()
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    answers = work[line.strip()]()
    print(json.dumps([time.perf_counter() - t0, answers]), flush=True)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of the repository")
    p.add_argument("--after", type=Path, required=True, help="another checkout")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL rows with 'turns'")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--weights", choices=("q4", "bf16", "fp32"), default="q4")
    p.add_argument("--tree", default="", help="EAGLE-3's tree (TreeParams.parse); default: "
                   "the engine's default tree")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    procs = {side: subprocess.Popen(
        [sys.executable, f.name, str(args.prompts.resolve()), str(args.max_new_tokens),
         args.weights, args.tree],
        cwd=path, env={**os.environ, "PYTHONPATH": str(path)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for side, path in sides.items()}
    try:
        for side, proc in procs.items():
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the {side} worker ({sides[side]}) did not start")
        totals = {(w, s): [0, 0.0] for w in WORKLOADS for s in sides}
        same = {w: [0, 0] for w in WORKLOADS}  # answers equal between the sides, of all
        for r in range(args.rounds):
            for w in WORKLOADS:
                answers = {}
                for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    procs[side].stdin.write(w + "\n")
                    procs[side].stdin.flush()
                    seconds, answers[side] = json.loads(procs[side].stdout.readline())
                    totals[(w, side)][0] += sum(map(len, answers[side]))
                    totals[(w, side)][1] += seconds
                same[w][0] += sum(a == b for a, b in zip(answers["before"], answers["after"]))
                same[w][1] += len(answers["after"])
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
        os.unlink(f.name)
    report = {"before": str(sides["before"]), "after": str(sides["after"]),
              "weights": args.weights, "tree": args.tree or "default", "rounds": args.rounds,
              "tokens_per_s": {}}
    for w in WORKLOADS:
        rate = {s: totals[(w, s)][0] / totals[(w, s)][1] for s in sides}
        report["tokens_per_s"][w] = {**{s: round(v, 1) for s, v in rate.items()},
                                     "after / before": round(rate["after"] / rate["before"], 3),
                                     "same answers": f"{same[w][0]}/{same[w][1]}"}
        print(f"{w:18s} before {rate['before']:7.1f} tok/s  after {rate['after']:7.1f} tok/s  "
              f"after / before {rate['after'] / rate['before']:.3f}  "
              f"same answers {same[w][0]}/{same[w][1]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
