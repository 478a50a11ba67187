"""Would drafts from the context below the head's candidates raise tau?

    PYTHONPATH=. python benchmarks/context_under_candidates.py \
        --prompts ../shared/data/prompts/mtbench.jsonl [--limit 80] [--tree k=3,s=1,n=4,cut=0.05]

The tree merges one chain from the context, the tokens that followed the longest earlier match
of the conversation's suffix, hung below the root (`context_draft.py`, `tree.merge_context`).
SAM-Decoding and Graft also look up the suffix that ends in each of the head's candidates. This
script measures what such a node would add before anyone builds it: the bundled q4 target and
the default head answer each conversation greedily (MT-bench turns, 128 tokens, the tree
`--tree`), with the verified tree traced. At every iteration whose accepted path ends at depth
1, at a head candidate c, the target's bonus token is the token after c; the script looks up
the suffix of the conversation + c in the context's index, as it stood before the iteration,
and counts a hit when the token it proposes is that bonus token. Each hit would have been one
more accepted token, for one more node in the tree (a chain past it could add more, at most as
often as its first token is right). Prints, as JSON: iterations, tau, iterations that stopped at
depth 1, and the hits below the top head candidate and below any head candidate, split by
whether the tree already held a child of c (the context's own chain along c), so tau's upper
gain is hits / iterations; and, per rank of the head's candidates, the share of iterations
whose path went through it (what a candidate the new node displaced was worth). Not a timing:
tau and hits do not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_engine.bench import load_rows, parse_sweep
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.context_draft import MAX_MATCH, ContextIndex
from eagle_engine.engine import DEFAULT_HEAD, EagleEngine
from eagle_engine.events import StepEvent, TreeNode


def proposal_after(index: ContextIndex, token: int) -> tuple[int, int | None]:
    """What `index.match()` would find had `token` been appended: (match length, the token
    proposed after it), or (0, None) without a match. Appending registers the n-grams that end
    at the last token, with `token` as their follower; those are the latest occurrences."""
    T = len(index.tokens)
    seq = index.tokens[-MAX_MATCH:] + [token]
    for n in range(min(MAX_MATCH, T), 0, -1):
        key = tuple(seq[-n:])
        if key == tuple(index.tokens[T - n:]):  # registered by the append itself
            return n, token
        start = index.after.get(key)
        if start is not None:
            return n, index.tokens[start]
    return 0, None


def score_iteration(index: ContextIndex, ev: StepEvent, counts: dict) -> None:
    """Count one iteration (its traced tree, its emitted tokens) against the index as it stood
    before it."""
    accepted = [t for t in ev.tokens if t.kind != "bonus"]
    nodes: list[TreeNode] = ev.tree  # root first
    heads = sorted((i for i, n in enumerate(nodes) if n.depth == 1 and n.source != "context"),
                   key=lambda i: -nodes[i].score)  # the head's candidates, the likeliest first
    c = accepted[0].token_id if accepted else None
    at = next((i for i in heads if nodes[i].token_id == c), None)
    if at is not None:  # what a head candidate of each rank is worth at depth 1
        rank = heads.index(at) + 1
        counts["depth_1_by_head_rank"][rank] = counts["depth_1_by_head_rank"].get(rank, 0) + 1
    if len(accepted) != 1 or len(ev.tokens) != 2:
        return  # the path did not end at depth 1, or the answer ended here
    counts["stopped_at_depth_1"] += 1
    if at is None:
        return  # the context's chain alone drafted it
    match_len, token = proposal_after(index, c)
    hit = token == ev.tokens[1].token_id
    had_child = any(n.parent == at for n in nodes)
    key = "with a child in the tree" if had_child else "without a child"
    for where in (["below the top candidate"] if at == heads[0] else []) + ["below any"]:
        counts["hits"][where][key] += hit
    counts["by_match_length"].setdefault(match_len, [0, 0])
    counts["by_match_length"][match_len][0] += hit
    counts["by_match_length"][match_len][1] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'turns' list per row")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tree", default="k=3,s=1,n=4,cut=0.05", help="a tree, TreeParams.parse")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig(weights="q4"))
    tree, = parse_sweep(args.tree)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    empty = {"with a child in the tree": 0, "without a child": 0}
    counts = {"iterations": 0, "tokens": 0, "stopped_at_depth_1": 0,
              "hits": {"below the top candidate": dict(empty), "below any": dict(empty)},
              "by_match_length": {}, "depth_1_by_head_rank": {}}
    for i, row in enumerate(load_rows(args.prompts, args.limit)):
        messages: list[dict[str, str]] = []
        for turn in row["turns"]:
            messages.append({"role": "user", "content": turn})
            prompt = engine.encode(messages)
            index, text = ContextIndex(prompt), ""
            for ev in engine.stream(prompt, params, tree, DEFAULT_HEAD, trace=True):
                if ev.tree:  # an iteration (the prefill's event has no tree)
                    score_iteration(index, ev, counts)
                index.extend([t.token_id for t in ev.tokens], calibrate=False)
                text += ev.text
            counts["iterations"] += ev.stats["num_steps"]
            counts["tokens"] += ev.stats["step_tokens"]
            messages.append({"role": "assistant", "content": text})
        print(f"[{i + 1}] iterations {counts['iterations']}", flush=True)
    n = counts["iterations"]
    counts["tau"] = round(counts.pop("tokens") / n, 3)
    counts["tau_gain_at_most"] = {where: round(sum(h.values()) / n, 3)
                                  for where, h in counts["hits"].items()}
    counts["depth_1_by_head_rank"] = {r: round(k / n, 3) for r, k
                                      in sorted(counts["depth_1_by_head_rank"].items())}
    counts["by_match_length"] = {m: {"hits": h, "trials": t}
                                 for m, (h, t) in sorted(counts["by_match_length"].items())}
    print(json.dumps({"tree": args.tree, **counts}, indent=1))


if __name__ == "__main__":
    main()
