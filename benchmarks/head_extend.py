"""Does the head's draft extend as one C++ call pay against its Python steps?

    PYTHONPATH=. python benchmarks/head_extend.py --prompts ../shared/data/prompts/mtbench.jsonl \
        [--limit 80] [--tree 2,1,3,0.05] [--max-new-tokens 128]

One process, the bundled q4 target and the default head. Every conversation (both turns, the
second on plain decoding's own first answer, as in MT-bench) is answered by plain decoding and
by EAGLE-3 twice: the head's extend as one C++ call (`FusedDecoder.extend`) and as its Python
steps (`accept.extend_steps`), switched on the head between requests, in an order that rotates
from question to question. Both give the same bits, so the answers must be identical (checked)
and tau equal; the speed is decoding time only (each request's time less its prefill). Prints
tokens/s, tau and the ratio to plain decoding per system. Not a test: timings depend on the
machine and its load.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_engine.bench import load_rows, parse_sweep
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine

SYSTEMS = ("plain", "one call", "steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per row")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tree", default="2,1,3,0.05", help="topk,steps,tokens[,min_score]")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(weights="q4"))
    fused = engine.heads[DEFAULT_HEAD].fused
    if fused is None or not fused.extends:
        raise SystemExit("the default head does not extend in one call on this machine")
    tree, = parse_sweep(args.tree)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = load_rows(args.prompts, args.limit)
    engine.generate(engine.encode("Hello"), params, tree, DEFAULT_HEAD)  # warm-up
    tokens = dict.fromkeys(SYSTEMS, 0)
    seconds = dict.fromkeys(SYSTEMS, 0.0)
    steps = dict.fromkeys(SYSTEMS, 0)
    step_tokens = dict.fromkeys(SYSTEMS, 0)
    for q, row in enumerate(rows):
        first = [{"role": "user", "content": row["turns"][0]}]
        answer = engine.generate(engine.encode(first), params).text
        second = first + [{"role": "assistant", "content": answer},
                          {"role": "user", "content": row["turns"][1]}]
        for ids in (engine.encode(first), engine.encode(second)):
            answers = {}
            for system in SYSTEMS[q % 3:] + SYSTEMS[:q % 3]:
                fused.extends = system == "one call"
                eagle = system != "plain"
                res = engine.generate(ids, params, tree if eagle else None,
                                      DEFAULT_HEAD if eagle else None)
                answers[system] = res.token_ids
                tokens[system] += res.stats.num_tokens
                seconds[system] += res.stats.elapsed_s - res.stats.prefill_s
                steps[system] += res.stats.num_steps
                step_tokens[system] += res.stats.step_tokens
            if not answers["plain"] == answers["one call"] == answers["steps"]:
                raise SystemExit(f"question {q + 1}: the answers differ")
    fused.extends = True
    plain = tokens["plain"] / seconds["plain"]
    report = {s: {"tok_s": round(tokens[s] / seconds[s], 2),
                  "tau": round(step_tokens[s] / steps[s], 3),
                  "vs_plain": round(tokens[s] / seconds[s] / plain, 3)} for s in SYSTEMS}
    for s, r in report.items():
        print(f"{s:9s} {r['tok_s']:8.2f} tok/s  tau {r['tau']:.3f}  {r['vs_plain']:.3f}x plain")
    print(json.dumps({"tree": args.tree, "conversations": len(rows), "systems": report}))


if __name__ == "__main__":
    main()
