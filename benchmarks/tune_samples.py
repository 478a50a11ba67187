"""How steady is `tune`'s choice of tree? Its stage-2 samples, with more rounds, per turn.

    PYTHONPATH=. python benchmarks/tune_samples.py [--rounds 4] [--first-turns-only] [--json OUT]

One process, the bundled q4 target and the default head: `autotune.speeds` on q4's candidate
trees over `autotune.CONVERSATIONS` (both turns, the second on the engine's own first answer,
as `tune` measures them; `--first-turns-only`: the first turns alone), `--rounds` rounds
instead of `tune`'s `ROUNDS`. Per tree and turn: decoding tokens/s (after the prefill), and the
mean log speed ratio to q4's static default tree on this CPU with its standard error over the
paired samples (the quantities `autotune.choose` weighs), then the tree `choose` picks from all
the samples. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json

from eagle_engine import autotune
from eagle_engine.config import EngineConfig, TreeParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--first-turns-only", action="store_true")
    ap.add_argument("--json", help="write the samples and the summary here")
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(target="bundled", drafts=("bundled",), weights="q4"))
    trees = [TreeParams(k, s, n, min_score=cut) for k, s, n, cut in autotune.CANDIDATES["q4"]]
    if args.first_turns_only:
        prompts = [engine.encode(first) for first, _ in autotune.CONVERSATIONS]
    else:
        prompts = autotune.conversation_prompts(engine)
    plain, samples, wrong = autotune.speeds(engine, DEFAULT_HEAD, trees, prompts, args.rounds)
    default = autotune.tree_label(engine.config.default_tree)
    turns = 1 if args.first_turns_only else 2
    # sample j: round j // len(prompts), prompt j % len(prompts); turn = prompt % turns
    summary = {}
    print(f"static default: {default}; {args.rounds} rounds x {len(prompts)} prompts")
    print(f"{'system':24} {'turn':>5} {'tok/s':>7} {'gain vs default':>16}")
    for label, rates in {"plain": plain, **samples}.items():
        rows = {}
        for turn in range(turns):
            pick = [j for j in range(len(rates)) if j % len(prompts) % turns == turn]
            part, base = [rates[j] for j in pick], [samples[default][j] for j in pick]
            rows[turn + 1] = (autotune.mean_rate(part), *autotune.paired_gain(part, base))
        if turns > 1:
            rows["all"] = (autotune.mean_rate(rates),
                           *autotune.paired_gain(rates, samples[default]))
        for turn, (rate, mean, se) in rows.items():
            print(f"{label:24} {turn!s:>5} {rate:7.1f} {100 * mean:+7.1f}% +- {100 * se:4.1f}")
        summary[label] = {str(t): {"tok_s": r, "gain": m, "se": s} for t, (r, m, s) in rows.items()}
    correct = {t: v for t, v in samples.items() if t not in wrong}
    chosen = autotune.choose(default, correct)
    print(f"incorrect: {wrong}; choose() picks: {chosen}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"default": default, "chosen": chosen, "incorrect": wrong,
                       "plain": plain, "samples": samples, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
