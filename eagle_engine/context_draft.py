"""Drafts from the context: a suffix index over one request's tokens (prompt, then every
committed token), which proposes the tokens that followed the longest suffix of the context
that occurred before, as a chain after the root, with a calibrated probability per node.

The index is incremental: `extend` registers the n-grams (n <= MAX_MATCH) that end at each new
token's predecessor, pointing at the token after them, so a lookup sees only earlier
occurrences and finds the latest one of the longest matching suffix with MAX_MATCH dict reads.
A chain that runs into the end of the context continues with itself (a copy of a repeated
span goes on repeating). Calibration needs no training: before a generated token is
registered, the index checks what it would have proposed there, counting hits per match
length; a chain node's probability is the product, down the chain, of the smoothed hit rates
of the match lengths it extends (`PRIOR_HIT_RATE` stands in while counts are few). That is the
rate at which the target accepts such a node, the same quantity as the head's path
probability, so the two compete for the tree's budget on one scale (`tree.merge_context`).
Not here: merging into the tree (`tree.py`) or the engine's loop (`scheduler.py`).
"""
from __future__ import annotations

from .config import ConfigError
from .io_struct import ContextDraft

MAX_MATCH = 8  # longest suffix looked up; longer matches count as this long
# hit rate of a proposal by match length 1..MAX_MATCH before any count. Set below the marginal
# rates on MT-bench first turns (~0.27, 0.58, 0.72, 0.67, 0.85+ for lengths 1, 2, 3, 4, 5+;
# `ContextIndex.hit_rates` counts them): where the chain competes with the head it disagrees
# with the head, and is right less often then. These values give a higher tau than the
# marginal rates
PRIOR_HIT_RATE = (0.2, 0.35, 0.45, 0.55, 0.6, 0.65, 0.7, 0.75)
PRIOR_WEIGHT = 8.0  # pseudo-counts of the prior per match length


class ContextIndex:
    """Suffix index and hit-rate calibration over the tokens of one request."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest follower is
        self.hits = [0] * MAX_MATCH  # [MAX_MATCH] right proposals by match length - 1
        self.trials = [0] * MAX_MATCH  # [MAX_MATCH] proposals checked by match length - 1
        self.extend(tokens or [], calibrate=False)

    def extend(self, tokens: list[int], calibrate: bool = True) -> None:
        """Append committed tokens; with `calibrate`, first score the proposal each one meets."""
        for tok in tokens:
            if calibrate:
                m, start = self.match()
                if m:
                    self.trials[m - 1] += 1
                    self.hits[m - 1] += self.tokens[start] == tok
            T = len(self.tokens)
            for n in range(1, min(MAX_MATCH, T) + 1):
                self.after[tuple(self.tokens[T - n:])] = T
            self.tokens.append(tok)

    def match(self) -> tuple[int, int]:
        """-> (length of the longest suffix that occurred before, index of the token after its
        latest earlier occurrence); (0, -1) when even the last token is new."""
        T = len(self.tokens)
        for n in range(min(MAX_MATCH, T - 1), 0, -1):
            start = self.after.get(tuple(self.tokens[T - n:]))
            if start is not None:
                return n, start
        return 0, -1

    def hit_rate(self, match_len: int) -> float:
        """Smoothed rate at which a proposal after a `match_len`-token match was right."""
        b = min(match_len, MAX_MATCH) - 1
        return (self.hits[b] + PRIOR_WEIGHT * PRIOR_HIT_RATE[b]) / (self.trials[b] + PRIOR_WEIGHT)

    def propose(self, max_len: int) -> ContextDraft | None:
        """The chain after the root (the last token), at most `max_len` long, or None when no
        suffix of the context occurred before."""
        if max_len < 1:
            raise ConfigError(f"a context draft needs room for one token, got max_len={max_len}")
        m, start = self.match()
        if not m:
            return None
        T, chain, scores, p = len(self.tokens), [], [], 1.0
        for i in range(max_len):
            j = start + i  # past the end the chain continues with itself
            chain.append(self.tokens[j] if j < T else chain[j - T])
            p *= self.hit_rate(m + i)
            scores.append(p)
        return ContextDraft(chain, scores, m)

    def hit_rates(self) -> list[tuple[int, int]]:
        """(hits, trials) per match length 1..MAX_MATCH (the measurement behind the prior)."""
        return list(zip(self.hits, self.trials))
