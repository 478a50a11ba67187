"""Is the tree budget where speed is lost? Draft calibration and tree budgets replayed, one process.

    PYTHONPATH=. python benchmarks/tree_budget.py --prompts ../shared/data/prompts/mtbench.jsonl \
        [--limit 10] [--max-new-tokens 128] [--head eagle3-aux-1layer] [--tree k=4,s=3,n=16] [--json OUT]

Runs the first turn of `--limit` prompts greedily with the largest tree (`--tree`), keeping every
verified tree: each node's draft path probability (`TreeNode.score`) and whether the target
accepted it. Then, on those trees:

1. calibration: nodes bucketed by score, the mean score against the fraction accepted (if they
   match, the sum of a tree's scores predicts its accepted drafts);
2. budgets replayed: a budget of n nodes keeps the root and the n-1 best-scored nodes (what
   `build_tree` selects with `num_draft_tokens=n`; a parent always outscores its children, so
   that is a tree), and greedy acceptance keeps the accepted path up to its first dropped node
   (siblings carry distinct tokens, so no other kept node can match), plus the bonus token.
   Fixed budgets and adaptive ones (keep nodes scoring at least a threshold) are priced with the
   target forward of n tree tokens measured here for every n (median over rounds that time each
   n in turn) plus the measured time of an iteration outside that forward.

The replay uses the trees drafted at the positions the `--tree` run visited; a run with another
budget splits the answer at other positions, so its figures are an estimate of that run. Not a
test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_engine.bench import interleaved_medians, load_rows, target_forward
from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.events import TreeNode

BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0001)
THRESHOLDS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def collect_trees(engine: EagleEngine, rows: list[dict], head: str, tree: TreeParams,
                  max_new_tokens: int) -> tuple[list[list[TreeNode]], float]:
    """Verified trees of every iteration, and the mean iteration time (draft + verify forward +
    accept/commit + extend, ms)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    trees, iteration_ms = [], []
    for row in rows:
        prompt = engine.encode(row["turns"][0])
        for ev in engine.stream(prompt, params, tree, head, trace=True):
            if ev.tree:
                trees.append(ev.tree)
                iteration_ms.append(sum(ev.timings_ms.values()))
    return trees, sum(iteration_ms) / len(iteration_ms)


def forward_ms(engine: EagleEngine, head: str, sizes: list[int], context: int,
               rounds: int = 15, warmup: int = 2) -> dict[int, float]:
    """Median target forward time of n chain-shaped tree tokens after `context` tokens, with the
    head's aux layers captured as in verify."""
    draft = engine.heads[head]
    aux = (draft.cfg.resolve_aux_layer_ids(engine.target.cfg)
           if draft.cfg.use_aux_hidden_state else ())
    median = interleaved_medians({n: target_forward(engine, n, context, aux) for n in sizes},
                                 rounds, warmup)
    return {n: s * 1000 for n, s in median.items()}


def calibration(trees: list[list[TreeNode]]) -> list[dict]:
    rows = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        nodes = [n for t in trees for n in t[1:] if lo <= n.score < hi]
        if nodes:
            rows.append({"score": f"[{lo:g}, {min(hi, 1):g})", "nodes": len(nodes),
                         "mean_score": round(sum(n.score for n in nodes) / len(nodes), 3),
                         "accepted": round(sum(n.accepted for n in nodes) / len(nodes), 3)})
    return rows


def tokens_with_budget(tree: list[TreeNode], keep: int) -> int:
    """Tokens the iteration emits when only the root and the `keep` best-scored nodes are
    verified: accepted nodes up to the first dropped one, plus the bonus."""
    ranked = sorted(range(1, len(tree)), key=lambda i: -tree[i].score)  # stable: ties in order
    kept = set(ranked[:keep])
    accepted = sorted((i for i in range(1, len(tree)) if tree[i].accepted),
                      key=lambda i: tree[i].depth)
    n = 0
    for i in accepted:
        if i not in kept:
            break
        n += 1
    return n + 1


def replay(trees: list[list[TreeNode]], fwd: dict[int, float], outside_ms: float,
           budget: int | None = None, threshold: float = 0.0) -> dict:
    """Fixed `budget` nodes per tree, or (budget None) the nodes scoring >= `threshold`."""
    tokens, ms, sizes = 0, 0.0, 0
    for tree in trees:
        keep = (budget - 1 if budget is not None
                else sum(n.score >= threshold for n in tree[1:]))
        tokens += tokens_with_budget(tree, keep)
        ms += outside_ms + fwd[keep + 1]
        sizes += keep + 1
    return {"tau": round(tokens / len(trees), 3), "mean_nodes": round(sizes / len(trees), 1),
            "tokens_per_s": round(tokens / ms * 1000, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--head", default=DEFAULT_HEAD)
    p.add_argument("--tree", default="k=4,s=3,n=16", help="the run's tree (TreeParams.parse)")
    p.add_argument("--default-budget", type=int, default=TreeParams().num_draft_tokens)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tree = TreeParams.parse(args.tree)
    engine = EagleEngine.load(EngineConfig())
    trees, iteration_ms = collect_trees(engine, load_rows(args.prompts, args.limit), args.head,
                                        tree, args.max_new_tokens)
    fwd = forward_ms(engine, args.head, list(range(1, tree.num_draft_tokens + 1)), args.context)
    outside = iteration_ms - fwd[tree.num_draft_tokens]
    budgets = sorted({2, 4, 6, args.default_budget, 10, 12, tree.num_draft_tokens}
                     & set(range(2, tree.num_draft_tokens + 1)))
    default = replay(trees, fwd, outside, args.default_budget)
    report = {"iterations": len(trees), "tree": args.tree, "head": args.head,
              "target_forward_ms": {n: round(v, 2) for n, v in fwd.items()},
              "iteration_outside_forward_ms": round(outside, 2),
              "calibration": calibration(trees),
              "fixed": {n: replay(trees, fwd, outside, n) for n in budgets},
              "threshold": {t: replay(trees, fwd, outside, threshold=t) for t in THRESHOLDS}}
    for table in ("fixed", "threshold"):
        for row in report[table].values():
            row["vs_default"] = round(row["tokens_per_s"] / default["tokens_per_s"], 3)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
