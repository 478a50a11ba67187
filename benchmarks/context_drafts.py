"""Do drafts from the context (a suffix match over the conversation, merged into the EAGLE-3
tree under the same budget) raise tau and speed?

    PYTHONPATH=. python benchmarks/context_drafts.py \
        --prompts ../shared/data/prompts/mtbench.jsonl --limit 20 [--max-new-tokens 128] \
        [--trees "k=1,s=3,n=4"]

One process, the bundled q4 target and the default head, the tree `tune` measured fastest here
(cached) plus any `--trees`: for every prompt, plain decoding, EAGLE-3 with context drafts off
and on, greedy, in an order that rotates from prompt to prompt, so the systems share the
machine's load. Prompts: MT-bench first turns and a few code and rewriting prompts defined
here (where an answer copies its prompt). Per group and system: tokens, seconds, tokens/s,
tau (tokens per target forward, bonus included), speedup against plain decoding in this run,
greedy answers identical to plain decoding, and the share of emitted tokens drafted by the
context alone. Then the hit rate of the context's proposal per match length over the plain
answers (`context_draft.PRIOR_HIT_RATE` comes from it). Not a test: timings depend on the
machine and its load; report tau first.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from eagle_engine import autotune
from eagle_engine.bench import load_rows
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.context_draft import MAX_MATCH, ContextIndex
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine

EDIT_PROMPTS = [
    "Rewrite this paragraph formally: hey team, so the launch got pushed to next week because "
    "the payment service kept timing out during the load test. we think it's the database "
    "pool size but nobody's sure yet. can everyone check their tickets and update the board "
    "by thursday? thanks, and sorry for the late notice.",
    "Add type hints to this function:\n\ndef merge_counts(a, b):\n    out = dict(a)\n    for key, "
    "value in b.items():\n        out[key] = out.get(key, 0) + value\n    return out\n",
    "Fix the bug in this Python code and return the corrected code:\n\ndef average(values):\n"
    "    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
    "Rewrite this paragraph in simpler words: The committee has determined that, owing to "
    "unforeseen budgetary constraints, the renovation of the library will be postponed until "
    "the subsequent fiscal year, at which point the proposal shall be reconsidered.",
    "Add docstrings to this class:\n\nclass Stack:\n    def __init__(self):\n        self.items "
    "= []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        return self.items.pop()\n\n    def is_empty(self):\n        return not self.items\n",
    "Translate this JavaScript function to Python:\n\nfunction countWords(text) {\n  const counts "
    "= {};\n  for (const word of text.split(' ')) {\n    counts[word] = (counts[word] || 0) + 1;\n"
    "  }\n  return counts;\n}\n",
]


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0
    from_context: int = 0
    same: int = 0
    answers: int = 0

    def row(self, plain_tok_s: float | None) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        return {"tokens": self.tokens, "seconds": round(self.seconds, 2),
                "tokens_per_s": round(tps, 2),
                "tau": round(self.step_tokens / self.steps, 3) if self.steps else 1.0,
                "speedup_vs_plain": round(tps / plain_tok_s, 3) if plain_tok_s else None,
                "greedy_same_as_plain": f"{self.same}/{self.answers}",
                "context_token_share": round(self.from_context / self.tokens, 3)
                if self.tokens else 0.0}


def label(tree: TreeParams | None) -> str:
    return "plain" if tree is None else f"eagle {autotune.tree_label(tree)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trees", default="", help="more trees 'k=1,s=3,n=4;...' (TreeParams.parse)")
    p.add_argument("--groups", default="mtbench,code+rewrite", help="prompt groups to run")
    args = p.parse_args()
    engine = EagleEngine.load(EngineConfig())
    autotune.use_cached(engine, DEFAULT_HEAD)
    shapes = [engine.default_tree] + [TreeParams.parse(t) for t in args.trees.split(";") if t]
    systems: list[TreeParams | None] = [None] + [replace(t, context_drafts=on)
                                                 for t in shapes for on in (False, True)]
    groups = {"mtbench": [row["turns"][0] for row in load_rows(args.prompts, args.limit)],
              "code+rewrite": EDIT_PROMPTS}
    groups = {name: groups[name] for name in args.groups.split(",")}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine.generate(engine.encode("Hello"), params, shapes[0], DEFAULT_HEAD)  # warm-up
    report: dict = {"weights": engine.config.weights_label, "head": DEFAULT_HEAD,
                    "max_new_tokens": args.max_new_tokens, "groups": {}}
    hits, trials = [0] * MAX_MATCH, [0] * MAX_MATCH
    turn = 0
    for group, prompts in groups.items():
        totals = {label(s): Totals() for s in systems}
        for i, prompt in enumerate(prompts):
            ids = engine.encode(prompt)
            order = systems[turn % len(systems):] + systems[:turn % len(systems)]
            turn += 1
            answers = {}
            for system in order:
                t, tokens, last = totals[label(system)], [], None
                for last in engine.stream(ids, params, system, DEFAULT_HEAD if system else None,
                                          trace=False):
                    tokens += [s.token_id for s in last.tokens]
                    t.from_context += sum(s.kind == "context" for s in last.tokens)
                answers[label(system)] = tokens
                t.tokens += len(tokens)
                t.seconds += last.stats["elapsed_s"]
                t.steps += last.stats["num_steps"]
                t.step_tokens += last.stats["step_tokens"]
            plain = answers["plain"]
            for name, tokens in answers.items():
                if name != "plain":
                    totals[name].answers += 1
                    totals[name].same += tokens == plain
            index = ContextIndex(ids + plain[:1])
            index.extend(plain[1:])
            for m, (h, n) in enumerate(index.hit_rates()):
                hits[m] += h
                trials[m] += n
            print(f"[{group} {i + 1}/{len(prompts)}] " + "  ".join(
                f"{k}: tau {v.row(None)['tau']}" for k, v in totals.items()), flush=True)
        plain_tps = totals["plain"].row(None)["tokens_per_s"]
        report["groups"][group] = {k: v.row(plain_tps) for k, v in totals.items()}
    report["hit_rate_by_match_length"] = {
        m + 1: {"hits": hits[m], "trials": trials[m],
                "rate": round(hits[m] / trials[m], 3) if trials[m] else None}
        for m in range(MAX_MATCH)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
