"""Issue 26, part 2: KV reuse across chat turns (`prefix_cache.py`).

A request restores the rows its prompt shares with an earlier request and prefills the rest.
With q4 weights both caches after that prefill equal a fresh prefill bit for bit, and so does
every answer of a conversation with reuse; dense fp32 agrees up to rounding. The cache stays
within its byte bound in one pool made once (eviction frees nothing), evicting the least
recently used entry, and never hands a head's draft rows to another head.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_engine.accept import extend
from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.kv_cache import KVCache
from eagle_engine.prefix_cache import (
    BLOCK_ROWS,
    PrefixCache,
    PrefixEntry,
    RowLayout,
    reusable_rows,
)
from eagle_engine.run import Run
from tests.helpers import tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")
# head-only trees: the exact reuse counts below hold for them. Reuse stops at the draft rows a
# request wrote (`reusable_rows`), and a finished request skips its last draft extend; with
# drafts from the context that last iteration can accept a longer chain, so fewer rows are
# reused (answers still equal: `test_answers_with_reuse_and_context_drafts_equal_answers_without`)
TREE = TreeParams(2, 3, 6, context_drafts=False)
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
Q4 = {"weights": "q4", "hidden_size": 64, "intermediate_size": 96, "weight_scale": 1.0}
HEAD = {"head": {"intermediate_size": 64}, "other": {"intermediate_size": 64, "seed": 5}}


def user_turn(seed: int, n: int = 9) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["q4", "fp32"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> EagleEngine:
    kw = Q4 if request.param == "q4" else {"weight_scale": 1.0}
    return tiny_engine(tmp_path_factory.mktemp(f"prefix_{request.param}"), HEAD, max_len=512,
                       **kw)


def conversation(engine: EagleEngine, head: str | None, turns: int, mb: int,
                 tree: TreeParams = TREE) -> tuple[list[list[int]], list[int]]:
    """A chat of `turns` turns: each prompt is the previous prompt, its answer and a new user
    turn. -> (answers, tokens reused per turn)."""
    engine.prefix_cache = PrefixCache(mb * 2 ** 20)
    prompt, answers, reused = [1], [], []
    for t in range(turns):
        prompt = prompt + user_turn(t)
        result = engine.generate(prompt, GREEDY, tree, head)
        answers.append(result.token_ids)
        reused.append(result.stats.reused_tokens)
        prompt = prompt + result.token_ids
    return answers, reused


@pytest.mark.parametrize("head", ["head", None], ids=["eagle", "baseline"])
def test_answers_with_reuse_equal_answers_without(engine: EagleEngine, head: str | None
                                                  ) -> None:
    without, none_reused = conversation(engine, head, 4, 0)
    with_reuse, reused = conversation(engine, head, 4, 64)
    assert with_reuse == without
    assert none_reused == [0] * 4
    # every later turn reuses all of the previous prompt and answer but the last token
    # (EAGLE-3: and the one before it, whose target features the draft extend needs)
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])
    for t in range(1, 4):
        previous = 1 + sum(9 + len(a) for a in without[:t])
        assert reused[t] == previous - (2 if head else 1)


def test_answers_with_reuse_and_context_drafts_equal_answers_without(engine: EagleEngine
                                                                     ) -> None:
    tree = TreeParams(2, 3, 6, context_drafts=True)
    without, _ = conversation(engine, "head", 4, 0, tree)
    with_reuse, reused = conversation(engine, "head", 4, 64, tree)
    assert with_reuse == without
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])


def test_caches_after_a_reused_prefill_equal_a_fresh_prefill(engine: EagleEngine) -> None:
    """Both caches' rows, the first token and the draft's first top-k: a prefill that restores
    rows against one that computes them all (q4: bit for bit)."""
    first = [1] + user_turn(0, 20)
    engine.prefix_cache = PrefixCache(64 * 2 ** 20)
    engine.generate(first, GREEDY, TREE, "head")  # leaves its rows behind
    prompt = first + engine.generate(first, GREEDY, TREE, "head").token_ids + user_turn(1)
    runs = []
    for reuse in (True, False):
        if not reuse:
            engine.prefix_cache = PrefixCache(0)
        slot, cache, draft_cache = engine.scheduler.phases.lease(len(prompt), GREEDY, TREE, "head")
        run = Run(engine.parts, prompt, GREEDY, TREE, "head", False, cache, draft_cache, slot)
        root, ext = engine.scheduler._prefill(run)
        state = extend(run.draft_model, ext, run.draft_cache, TREE.topk)
        runs.append((run, root, state))
    (a, root_a, state_a), (b, root_b, state_b) = runs
    n = len(prompt)
    assert a.stats.reused_tokens > len(first) and b.stats.reused_tokens == 0
    assert root_a.tolist() == root_b.tolist() and state_a.seq_len == state_b.seq_len == n
    q4 = engine.config.weights == "q4"
    close = (lambda x, y: torch.equal(x, y)) if q4 else (
        lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-5))
    assert close(a.cache.data[:, :, :n], b.cache.data[:, :, :n])
    assert close(a.draft_cache.data[:, :, :n], b.draft_cache.data[:, :, :n])
    assert close(state_a.hidden, state_b.hidden) and close(state_a.topk_p, state_b.topk_p)
    assert state_a.topk_ids.tolist() == state_b.topk_ids.tolist()


def test_a_head_never_reuses_another_heads_draft_rows(engine: EagleEngine) -> None:
    prompt = [1] + user_turn(3, 16)
    engine.prefix_cache = PrefixCache(64 * 2 ** 20)
    answer = engine.generate(prompt, GREEDY, TREE, "head").token_ids
    follow = prompt + answer + user_turn(4)
    other = engine.generate(follow, GREEDY, TREE, "other")
    assert other.stats.reused_tokens == 0
    # the other head's longer entry leaves the first head's in place (switching back reuses)
    assert engine.generate(follow, GREEDY, TREE, "head").stats.reused_tokens == (
        len(prompt) + len(answer) - 2)
    engine.prefix_cache = PrefixCache(0)
    assert engine.generate(follow, GREEDY, TREE, "other").token_ids == other.token_ids


def test_a_baseline_run_keeps_the_heads_rows_for_the_next_turn(engine: EagleEngine) -> None:
    """The playground's compare runs the baseline after EAGLE-3 on the same prompt: its entry
    holds the same tokens without draft rows and must not replace the head's."""
    engine.prefix_cache = PrefixCache(64 * 2 ** 20)
    prompt = [1] + user_turn(5, 16)
    answer = engine.generate(prompt, GREEDY, TREE, "head").token_ids
    assert engine.generate(prompt, GREEDY, TREE, None).token_ids == answer
    follow = prompt + answer + user_turn(6)
    reused = engine.generate(follow, GREEDY, TREE, "head")
    assert reused.stats.reused_tokens == len(prompt) + len(answer) - 2  # as without compare
    engine.prefix_cache = PrefixCache(0)
    assert engine.generate(follow, GREEDY, TREE, "head").token_ids == reused.token_ids


def entry(tokens: list[int], head: str | None = None, draft_rows: int = 0) -> PrefixEntry:
    """An entry's bookkeeping alone (no rows in a pool), for `reusable_rows`."""
    return PrefixEntry(tuple(tokens), [], head, [], draft_rows)


def test_reusable_rows() -> None:
    e = entry([1, 2, 3, 4, 5, 6], "h", 5)
    assert reusable_rows(e, [1, 2, 3, 9, 9], None) == 3  # the common prefix
    assert reusable_rows(e, [1, 2, 3, 9, 9], "h") == 2  # and the draft's features before it
    assert reusable_rows(e, [1, 2, 3, 4, 5, 6], None) == 5  # the last token is prefilled
    assert reusable_rows(e, [1, 2, 3, 4, 5, 6, 7, 8], "h") == 5  # the draft's rows
    assert reusable_rows(e, [1, 2, 3, 9], "other") == 0
    assert reusable_rows(e, [7, 2, 3], None) == 0


def caches(tmp_path: Path) -> tuple[EagleEngine, KVCache, KVCache]:
    engine = tiny_engine(tmp_path, {"head": {}}, max_len=128)
    target, draft = engine.target.new_cache(max_len=64), engine.heads["head"].new_cache(64)
    target.data.normal_()
    draft.data.normal_()
    return engine, target, draft


def test_lru_eviction_within_the_pools_blocks(tmp_path: Path) -> None:
    _, cache, _ = caches(tmp_path)
    block = RowLayout.of(cache).row_bytes * BLOCK_ROWS  # the blocks are 64-byte aligned rows
    pc = PrefixCache(max_bytes=3 * block + 100)  # three blocks
    a, b, c = list(range(1, 11)), list(range(20, 30)), list(range(40, 50))
    for tokens in (a, b, c):
        pc.store(tokens, cache, None, None, 0)
    assert len(pc) == 3 and pc.nbytes == 3 * pc.pool.block_bytes <= pc.max_bytes
    assert pc.lookup(a + [99], None).rows == 10  # `a` becomes the most recently used
    pc.store(list(range(60, 70)), cache, None, None, 0)  # no free block: `b` goes
    assert pc.nbytes <= pc.max_bytes and len(pc) == 3
    assert pc.lookup(b + [99], None) is None and pc.lookup(a + [99], None) is not None
    pc.store(list(range(100, 100 + 2 * BLOCK_ROWS)), cache, None, None, 0)  # two blocks
    assert len(pc) == 2 and sorted(pc.pool.free) == []


def test_the_pool_is_made_once_and_churn_never_grows_it(tmp_path: Path) -> None:
    """Entries of every size come and go (with and without a head's draft rows); the pool's
    buffer is the one made at the first store, and every block is held or free, once."""
    _, cache, draft = caches(tmp_path)
    pc = PrefixCache(max_bytes=40 * RowLayout.of(cache).row_bytes)
    pc.store([1, 2, 3], cache, "head", draft, 2)
    buffer = pc.pool.buffer
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        n = int(torch.randint(1, 40, (), generator=g))
        head = "head" if i % 3 else None
        pc.store(torch.randint(3, 90, (n,), generator=g).tolist(), cache, head, draft, n - 1)
        held = [b for e in pc._entries.values() for b in e.blocks + e.draft_blocks]
        assert sorted(held + pc.pool.free) == list(range(pc.pool.num_blocks))
        assert pc.nbytes <= pc.max_bytes
    assert pc.pool.buffer is buffer and buffer.numel() <= pc.max_bytes


def test_store_copies_rows_supersedes_prefixes_and_respects_the_bound(tmp_path: Path) -> None:
    _, cache, draft = caches(tmp_path)
    pc = PrefixCache(max_bytes=cache.data[:, :, :40].nbytes)
    pc.store(list(range(10)), cache, None, None, 0)
    pc.store(list(range(20)), cache, None, None, 0)  # extends the first: replaces it
    assert len(pc) == 1 and pc.nbytes == 2 * pc.pool.block_bytes
    stored = pc.lookup(list(range(25)), None)
    assert stored.rows == 20 and torch.equal(pc.rows(stored.entry), cache.data[:, :, :20])
    cache.data.zero_()  # a copy, not a view
    assert pc.rows(stored.entry).abs().sum() > 0
    pc.store(list(range(100, 150)), cache, None, None, 0)  # larger than the bound: not kept
    assert len(pc) == 1
    # a head's rows (a block of target rows, one of draft rows: the 20 rows make room), then
    # the baseline over the same tokens and more: it replaces that entry and keeps its draft rows
    pc.store(list(range(200, 210)), cache, "head", draft, 9)
    assert len(pc) == 1 and pc.lookup(list(range(25)), None) is None
    pc.store(list(range(200, 212)), cache, None, None, 0)
    hit = pc.lookup(list(range(200, 215)), "head")
    assert len(pc) == 1 and hit.rows == 9 and hit.entry.tokens == tuple(range(200, 212))
    restored = torch.zeros_like(draft.data)
    pc.pool.read(hit.entry.draft_blocks, hit.entry.draft_layout, restored, 9)
    assert torch.equal(restored[:, :, :9], draft.data[:, :, :9])
