"""KV reuse across chat turns: the committed cache rows of finished requests, keyed by the token
ids they hold, so the next turn of a conversation prefills only its new tokens.

A request that ends (finished or stopped) leaves a copy of its target cache rows (and, for an
EAGLE-3 request, its draft cache rows with the head's name) here. A new request looks up the
entry sharing the longest token prefix with its prompt and restores the reusable rows into its
own caches; the engine then prefills the rest from that row. Which rows are reusable:

  * target row k holds the keys/values of token k after tokens 0..k: valid while the prompt
    agrees with the entry on tokens 0..k;
  * draft row k pairs the target features of position k with token k+1: valid while the prompt
    agrees on tokens 0..k+1, and only for the head that wrote it. The draft extend after the
    prefill also needs the target features of the first position it writes, so an EAGLE-3
    request reuses r = min(common - 1, draft rows) rows of both caches and recomputes the target
    from row r (a baseline request reuses r = common rows of the target);
  * at least the prompt's last token is always prefilled (its logits give the first token).

With q4 weights a row's numbers do not depend on the other rows of a forward
(`kernels/cpu_lowbit.cpp`), so the caches and the answer equal those of a full prefill bit for
bit; dense weights may differ in float rounding (prefill and short forwards take different
attention kernels, `models/layers.attend`). Memory is bounded by `max_bytes`: the least
recently used entries are evicted first, and `max_bytes` 0 turns reuse off. An entry whose
tokens extend another's replaces it, unless that one holds another head's draft rows; an entry
without draft rows takes over those of the one it replaces, which stay valid for its longer
prompt (so a baseline run after an EAGLE-3 run of the same prompt, as the playground's compare
makes, keeps the head's rows for the next turn).
Not here: running the prefill (`engine.Run`), or deciding when a request ends (engine, scheduler).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass(slots=True)
class PrefixEntry:
    tokens: tuple[int, ...]  # the token ids of the target rows, one per row
    target: torch.Tensor  # [2 * layers, kv_heads, len(tokens), head_dim] target rows
    head: str | None  # the head whose draft rows `draft` holds (None: no draft rows)
    draft: torch.Tensor | None  # [2 * draft_layers, kv_heads, draft_rows, head_dim]

    @property
    def draft_rows(self) -> int:
        return 0 if self.draft is None else self.draft.shape[2]

    @property
    def nbytes(self) -> int:
        draft = 0 if self.draft is None else self.draft.nbytes
        return self.target.nbytes + draft


@dataclass(frozen=True, slots=True)
class PrefixHit:
    entry: PrefixEntry
    rows: int  # rows of the target cache (and the draft cache, for a head) to restore


def reusable_rows(entry: PrefixEntry, prompt: list[int], head: str | None) -> int:
    """Rows a request for `prompt` (with draft head `head`, None for the baseline) can restore
    from `entry` (see the module docstring)."""
    common = len(os.path.commonprefix([list(entry.tokens), prompt]))
    if head is None:
        return min(common, len(prompt) - 1)
    if entry.head != head:
        return 0
    return max(0, min(common - 1, len(prompt) - 1, entry.draft_rows))


class PrefixCache:
    """Entries keyed by their token ids, least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], head: str | None) -> PrefixHit | None:
        """The entry with the most reusable rows for this request (marked recently used), or
        None when no entry has any."""
        best: PrefixHit | None = None
        for entry in self._entries.values():
            rows = reusable_rows(entry, prompt, head)
            if rows > 0 and (best is None or rows > best.rows):
                best = PrefixHit(entry, rows)
        if best is not None:
            self._entries.move_to_end(best.entry.tokens)
        return best

    @staticmethod
    def restore(hit: PrefixHit, target_cache: KVCache, draft_cache: KVCache | None) -> None:
        """Copy the hit's rows [0, rows) into a request's caches (the draft's for a head)."""
        r = hit.rows
        target_cache.data[:, :, :r].copy_(hit.entry.target[:, :, :r])
        if draft_cache is not None:
            draft_cache.data[:, :, :r].copy_(hit.entry.draft[:, :, :r])

    def store(self, tokens: list[int], target_cache: KVCache, head: str | None,
              draft_cache: KVCache | None, draft_rows: int) -> None:
        """Keep a copy of rows [0, len(tokens)) of `target_cache` (token k in row k) and rows
        [0, draft_rows) of `draft_cache` written by `head`, dropping the entries it supersedes;
        then evict down to `max_bytes`."""
        n = len(tokens)
        if self.max_bytes <= 0 or n == 0:
            return
        key = tuple(tokens)
        draft = None
        if head is not None and draft_cache is not None and draft_rows > 0:
            draft = draft_cache.data[:, :, :min(draft_rows, n)].clone()
        prefixes = [e for k, e in self._entries.items() if key[:len(k)] == k]
        if draft is None:  # a baseline run: a head's rows for a prefix of these tokens still hold
            draft, head = max(((e.draft, e.head) for e in prefixes if e.draft is not None),
                              key=lambda d: d[0].shape[2], default=(None, None))
        entry = PrefixEntry(key, target_cache.data[:, :, :n].clone(), head if draft is not None
                            else None, draft)
        if entry.nbytes > self.max_bytes:
            return
        for old in prefixes:  # superseded, unless it holds another head's rows
            if old.head is None or old.head == entry.head:
                del self._entries[old.tokens]
        self._entries[key] = entry
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
