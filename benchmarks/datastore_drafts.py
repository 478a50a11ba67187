"""Would drafts from a datastore of the target's own past answers (a REST-style n-gram index)
do better than drafts from the conversation itself? Measured on plain greedy answers, no
engine change.

    PYTHONPATH=. python benchmarks/datastore_drafts.py --prompts ../shared/data/prompts/mtbench.jsonl \
        [--answers data/answers/smollm2-135m-instruct.jsonl.gz] [--limit N] [--max-new-tokens 128]

The datastore indexes every answer token of `--answers`: for each n-gram of 1..MAX_N tokens,
its most frequent follower and that follower's share of its occurrences (numpy, n-grams hashed
to 64-bit keys). The bundled q4 target answers the prompts greedily, both turns as one
conversation. At every answer position after the first token, each source drafts a chain of
CHAIN tokens from the conversation so far: the datastore with its longest matching n-gram (the
chain goes on from its own drafts), the conversation with `context_draft.ContextIndex` (what
the engine merges into its tree). Per group of positions: how often the first draft is right,
the first two, and the mean number of leading drafts right; then how often the datastore's
first draft is right by its follower's share (its calibration). Not a test: the figures depend
on the answers, not on the machine.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from eagle_engine.bench import load_rows
from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.context_draft import ContextIndex
from eagle_engine.engine import EagleEngine

MAX_N, CHAIN = 6, 3
PRIME = np.uint64(1_000_003)
SHARE_BINS = (0.0, 0.25, 0.5, 0.75, 0.95, 1.01)


def ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] a 64-bit hash of each n-gram (wrapping arithmetic), the same for equal
    n-grams wherever they lie; n is mixed in, so n-grams of different lengths do not meet."""
    key = np.full(len(tokens) - n + 1, np.uint64(n))
    for i in range(n):
        key = key * PRIME + tokens[i:len(tokens) - n + 1 + i].astype(np.uint64)
    return key


class Datastore:
    """n-gram (1..MAX_N tokens) -> (most frequent follower, its share), over many answers."""

    def __init__(self, answers: list[list[int]]) -> None:
        keys, followers = [], []
        for n in range(1, MAX_N + 1):
            for ans in answers:
                if len(ans) > n:
                    t = np.asarray(ans, dtype=np.int64)
                    keys.append(ngram_keys(t[:-1], n))  # n-grams that have a follower
                    followers.append(t[n:])
        k, f = np.concatenate(keys), np.concatenate(followers).astype(np.uint64)
        order = np.lexsort((f, k))
        k, f = k[order], f[order]
        new_pair = np.r_[True, (k[1:] != k[:-1]) | (f[1:] != f[:-1])]
        pair_k, pair_f = k[new_pair], f[new_pair]
        pair_n = np.diff(np.r_[np.flatnonzero(new_pair), len(k)])  # count of each (key, follower)
        new_key = np.r_[True, pair_k[1:] != pair_k[:-1]]
        group = np.cumsum(new_key) - 1
        totals = np.bincount(group, weights=pair_n)
        order = np.lexsort((pair_n, group))  # per key, its most frequent follower last
        last = order[np.r_[group[order][1:] != group[order][:-1], True]]
        self.keys = pair_k[last]  # [n-grams] sorted
        self.follower = pair_f[last].astype(np.int64)  # [n-grams]
        self.share = pair_n[last] / totals  # [n-grams]

    def lookup(self, ngram: list[int]) -> tuple[int, float] | None:
        key = ngram_keys(np.asarray(ngram, dtype=np.int64), len(ngram))[0]
        i = np.searchsorted(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            return int(self.follower[i]), float(self.share[i])
        return None

    def propose(self, context: list[int]) -> tuple[list[int], float]:
        """-> (a chain of CHAIN tokens or fewer, the first token's share)."""
        ctx, chain, first_share = list(context), [], 0.0
        for _ in range(CHAIN):
            hit = None
            for n in range(min(MAX_N, len(ctx)), 0, -1):
                hit = self.lookup(ctx[-n:])
                if hit:
                    break
            if not hit:
                break
            chain.append(hit[0])
            ctx.append(hit[0])
            first_share = first_share or hit[1]
        return chain, first_share


def leading_right(chain: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(chain, truth):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--answers", type=Path, default=Path("data/answers/smollm2-135m-instruct.jsonl.gz"))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    with gzip.open(args.answers, "rt") as f:
        answers = [json.loads(line)["response_ids"] for line in f]
    store = Datastore(answers)
    print(f"datastore: {len(answers)} answers, {sum(map(len, answers))} tokens, "
          f"{len(store.keys)} n-grams", flush=True)

    engine = EagleEngine.load(EngineConfig(weights="q4"))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    groups = {"first turns": [], "first turns, conversation match < 3": [], "second turns": []}
    shares: list[tuple[float, bool]] = []
    for row in load_rows(args.prompts, args.limit):
        messages: list[dict[str, str]] = []
        for turn_no, turn in enumerate(row["turns"][:2]):
            messages.append({"role": "user", "content": turn})
            prompt = engine.encode(messages)
            result = engine.generate(prompt, params)
            answer = result.token_ids
            index = ContextIndex(prompt + answer[:1])
            for i in range(1, len(answer)):
                truth = answer[i:i + CHAIN]
                ds_chain, share = store.propose(prompt + answer[:i])
                conv = index.propose(CHAIN)
                conv_chain = conv.tokens if conv else []
                both = (leading_right(ds_chain, truth), leading_right(conv_chain, truth))
                groups["second turns" if turn_no else "first turns"].append(both)
                if not turn_no and (conv.match_len if conv else 0) < 3:
                    groups["first turns, conversation match < 3"].append(both)
                if ds_chain:
                    shares.append((share, ds_chain[0] == truth[0]))
                index.extend([answer[i]])
            messages.append({"role": "assistant", "content": result.text})
        print(f"{row['id']}: {sum(len(g) for k, g in groups.items() if 'match' not in k)} positions",
              flush=True)

    report = {"datastore_tokens": sum(map(len, answers)), "groups": {}, "calibration": []}
    print(f"\n{'positions':40s} {'n':>6s}  datastore 1st / 2 / mean   conversation 1st / 2 / mean")
    for name, rows in groups.items():
        if not rows:
            continue
        a = np.asarray(rows)
        stats = {src: [round(float((a[:, j] >= 1).mean()), 3), round(float((a[:, j] >= 2).mean()), 3),
                       round(float(a[:, j].mean()), 3)] for j, src in enumerate(("datastore", "conversation"))}
        report["groups"][name] = {"positions": len(rows), **stats}
        print(f"{name:40s} {len(rows):6d}  {stats['datastore']}   {stats['conversation']}")
    print("\ndatastore first draft right, by its follower's share:")
    s = np.asarray(shares)
    for lo, hi in zip(SHARE_BINS, SHARE_BINS[1:]):
        sel = (s[:, 0] >= lo) & (s[:, 0] < hi)
        if sel.any():
            right = round(float(s[sel, 1].mean()), 3)
            report["calibration"].append({"share": [lo, min(hi, 1.0)], "n": int(sel.sum()), "right": right})
            print(f"  share [{lo:.2f}, {min(hi, 1.0):.2f}): {int(sel.sum()):6d} drafts, right {right}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
