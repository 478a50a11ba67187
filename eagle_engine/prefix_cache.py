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
attention kernels, `kernels/attention.attend`). Memory is bounded by `max_bytes` in resident
memory, not only in the entries' count: rows live in one pool of blocks (`BlockPool`),
allocated once at the first store and never grown, into which entries are copied; an evicted
entry's blocks go back to the pool's free list and nothing is freed, so churn leaves no freed
tensors behind for the allocator to hold. The least recently used entries are evicted first,
and `max_bytes` 0 turns reuse off. An entry whose
tokens extend another's replaces it, unless that one holds another head's draft rows; an entry
without draft rows takes over those of the one it replaces, which stay valid for its longer
prompt (so a baseline run after an EAGLE-3 run of the same prompt, as the playground's compare
makes, keeps the head's rows for the next turn).
Not here: running the prefill (`run.Run`), or deciding when a request ends (engine, scheduler).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache

BLOCK_ROWS = 16  # target rows per pool block (an entry wastes at most one block's tail)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """The shape of one cache's rows: `KVCache.data` is [lead, kv_heads, rows, head_dim]."""

    lead: int  # 2 * layers (keys and values)
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cache: KVCache) -> RowLayout:
        lead, kvh, _, hd = cache.data.shape
        return cls(lead, kvh, hd, cache.data.dtype)

    @property
    def row_bytes(self) -> int:
        return self.lead * self.kv_heads * self.head_dim * self.dtype.itemsize


class BlockPool:
    """`max_bytes` of one device buffer, cut into blocks of `BLOCK_ROWS` target rows. A block
    holds `BLOCK_ROWS` rows of the target's layout or as many rows of another layout (a head's
    draft rows) as fit. The buffer is made at the first `bind` (`torch.empty`: pages become
    resident as blocks are first written, up to the bound) and never grows."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.buffer: torch.Tensor | None = None  # [num_blocks * block_bytes] uint8
        self.block_bytes = 0
        self.free: list[int] = []

    @property
    def num_blocks(self) -> int:
        return self.max_bytes // self.block_bytes if self.block_bytes else 0

    def bind(self, target: RowLayout, device: torch.device) -> None:
        """Size the blocks to the target's rows; allocate the buffer (once)."""
        if self.buffer is not None:
            return
        self.block_bytes = -(-BLOCK_ROWS * target.row_bytes // 64) * 64  # 64-byte aligned
        self.buffer = torch.empty(self.num_blocks * self.block_bytes, dtype=torch.uint8,
                                  device=device)
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def rows_per_block(self, layout: RowLayout) -> int:
        return self.block_bytes // layout.row_bytes

    def blocks_for(self, layout: RowLayout, rows: int) -> int:
        return -(-rows // self.rows_per_block(layout))

    def view(self, block: int, layout: RowLayout) -> torch.Tensor:
        """Block `block` as rows of `layout`: [lead, kv_heads, rows_per_block, head_dim]."""
        rows = self.rows_per_block(layout)
        at = block * self.block_bytes
        flat = self.buffer[at:at + rows * layout.row_bytes].view(layout.dtype)
        return flat.view(layout.lead, layout.kv_heads, rows, layout.head_dim)

    def write(self, blocks: list[int], layout: RowLayout, src: torch.Tensor) -> None:
        """src [lead, kv_heads, n, head_dim] -> the blocks, in order."""
        per = self.rows_per_block(layout)
        for i, b in enumerate(blocks):
            part = src[:, :, i * per:(i + 1) * per]
            self.view(b, layout)[:, :, :part.shape[2]].copy_(part)

    def read(self, blocks: list[int], layout: RowLayout, dst: torch.Tensor, rows: int) -> None:
        """Rows [0, rows) of the blocks -> dst [lead, kv_heads, >= rows, head_dim]."""
        per = self.rows_per_block(layout)
        for i, b in enumerate(blocks[:-(-rows // per)]):
            n = min(per, rows - i * per)
            dst[:, :, i * per:i * per + n].copy_(self.view(b, layout)[:, :, :n])


@dataclass(slots=True)
class PrefixEntry:
    tokens: tuple[int, ...]  # the token ids of the target rows, one per row
    blocks: list[int]  # pool blocks holding the target rows, in order
    head: str | None = None  # the head whose draft rows `draft_blocks` hold (None: none)
    draft_blocks: list[int] = field(default_factory=list)
    draft_rows: int = 0
    draft_layout: RowLayout | None = None


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
    """Entries keyed by their token ids, least recently used first, their rows in one
    `BlockPool`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pool = BlockPool(max_bytes)
        self.target_layout: RowLayout | None = None
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's blocks the entries hold."""
        return sum(len(e.blocks) + len(e.draft_blocks)
                   for e in self._entries.values()) * self.pool.block_bytes

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

    def restore(self, hit: PrefixHit, target_cache: KVCache, draft_cache: KVCache | None
                ) -> None:
        """Copy the hit's rows [0, rows) into a request's caches (the draft's for a head)."""
        e = hit.entry
        self.pool.read(e.blocks, self.target_layout, target_cache.data, hit.rows)
        if draft_cache is not None:
            self.pool.read(e.draft_blocks, e.draft_layout, draft_cache.data, hit.rows)

    def rows(self, entry: PrefixEntry) -> torch.Tensor:
        """A copy of the entry's target rows [lead, kv_heads, len(tokens), head_dim]."""
        lay = self.target_layout
        out = torch.empty(lay.lead, lay.kv_heads, len(entry.tokens), lay.head_dim,
                          dtype=lay.dtype, device=self.pool.buffer.device)
        self.pool.read(entry.blocks, lay, out, len(entry.tokens))
        return out

    def store(self, tokens: list[int], target_cache: KVCache, head: str | None,
              draft_cache: KVCache | None, draft_rows: int) -> None:
        """Copy rows [0, len(tokens)) of `target_cache` (token k in row k) and rows
        [0, draft_rows) of `draft_cache` written by `head` into pool blocks, dropping the
        entries it supersedes; least recently used entries make room."""
        n = len(tokens)
        if self.max_bytes <= 0 or n == 0:
            return
        layout = RowLayout.of(target_cache)
        if self.target_layout is None:
            self.target_layout = layout
            self.pool.bind(layout, target_cache.data.device)
        if layout != self.target_layout:
            raise ValueError(f"a prefix cache holds one target's rows: {self.target_layout}, "
                             f"got {layout}")
        key = tuple(tokens)
        entry = PrefixEntry(key, [])
        draft_layout = None
        if head is not None and draft_cache is not None and draft_rows > 0:
            draft_layout = RowLayout.of(draft_cache)
            entry.head, entry.draft_rows = head, min(draft_rows, n)
            entry.draft_layout = draft_layout
        prefixes = [e for k, e in self._entries.items() if key[:len(k)] == k]
        inherited = None
        if draft_layout is None:  # a baseline run: a head's rows for a prefix still hold
            inherited = max((e for e in prefixes if e.draft_blocks), key=lambda e: e.draft_rows,
                            default=None)
        need = self.pool.blocks_for(layout, n) + (
            self.pool.blocks_for(draft_layout, entry.draft_rows) if draft_layout else 0)
        if need > self.pool.num_blocks:
            return
        if inherited is not None:  # the draft blocks change owner (that entry is dropped below)
            entry.head, entry.draft_rows = inherited.head, inherited.draft_rows
            entry.draft_layout, entry.draft_blocks = inherited.draft_layout, inherited.draft_blocks
            inherited.draft_blocks = []
        for old in prefixes:  # superseded, unless it holds another head's rows
            if old.head is None or old.head == entry.head or old is inherited:
                self._drop(old)
        while len(self.pool.free) < need:
            self._drop(next(iter(self._entries.values())))
        entry.blocks = [self.pool.free.pop() for _ in range(self.pool.blocks_for(layout, n))]
        self.pool.write(entry.blocks, layout, target_cache.data[:, :, :n])
        if draft_layout is not None:
            entry.draft_blocks = [self.pool.free.pop()
                                  for _ in range(self.pool.blocks_for(draft_layout,
                                                                      entry.draft_rows))]
            self.pool.write(entry.draft_blocks, draft_layout,
                            draft_cache.data[:, :, :entry.draft_rows])
        self._entries[key] = entry

    def _drop(self, entry: PrefixEntry) -> None:
        del self._entries[entry.tokens]
        self.pool.free += entry.blocks + entry.draft_blocks
