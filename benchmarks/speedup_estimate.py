"""How close is the app's estimated speedup (eagle_engine/speed_estimate.py) to the measured one?

    PYTHONPATH=. python benchmarks/speedup_estimate.py [--tokens 128] [--repeats 2]

Loads the app's engines as `python app.py` does (the measured weights and tree, the target's
plain speed measured at warm-up), then answers three prompts (prose, code, a rewrite) through
`app.Playground` with "compare with baseline" on, `--repeats` times in turn: each answer's
estimate (made before its baseline ran) against the speedup measured by that baseline, and the
relative error. Not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json

import app
from eagle_engine import ui_render as ui
from eagle_engine.speed_estimate import measure

PROMPTS = ["Give me three tips for staying productive.",
           "Write a Python function that checks whether a number is prime.",
           "Rewrite this sentence in a formal tone: hey, the meeting got moved to friday, "
           "so don't forget to bring the slides."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    worker = app.EngineThread()
    engines = worker.call(app.load_engines, app.parse_args(["--single-weights"]))
    weights = engines[0].config.weights_label
    pg = app.Playground(engines, worker, 0.0, {weights: worker.call(measure, engines[0])})
    head = ui.default_head(pg.heads)
    tree = engines[0].default_tree
    rows = []
    for rep in range(args.repeats):
        for prompt in PROMPTS:
            settings = ui.Settings(True, head.use_aux, head.num_layers, tree.topk,
                                   tree.num_steps, tree.num_draft_tokens, 0.0, 1.0, args.tokens,
                                   0, True, weights, tree.context_drafts)
            record = list(pg.run([], prompt, settings))[-1][app.OUTPUTS.index("run")]
            est, measured = record["speedup_estimate"], record["speedup"]
            rows.append({"repeat": rep, "prompt": prompt[:40], "tokens":
                         record["stats"]["num_tokens"], "estimate": round(est, 3),
                         "measured": round(measured, 3),
                         "error": round(est / measured - 1, 3)})
            print(json.dumps(rows[-1]), flush=True)
    errors = [abs(r["error"]) for r in rows]
    print(json.dumps({"weights": weights, "tree": str(tree), "head": head.name,
                      "mean_abs_error": round(sum(errors) / len(errors), 3),
                      "max_abs_error": round(max(errors), 3)}))


if __name__ == "__main__":
    main()
