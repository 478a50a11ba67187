"""CUDA graphs for the per-iteration phases over a padded batch of requests: `GraphPhases`, the
scheduler's phase backend under CUDA graphs.

Under graphs every request's caches are rows of one `KVPool` per model (the target's, and each
head's), leased as slots when the request is admitted, so a captured graph serves whichever
requests a step brings: it reads their pool rows from a slot buffer. Each phase is one static
function over a batch (`draft_static`, `verify_static`, `extend_static`, `decode_static`),
captured per batch-size bucket (1, 2, 4, ... up to `max_batch`) and per static shape (the
head and tree's widths) on first use, warm-up and capture writing only the pool's scratch row.
A step's requests that share a graph replay the smallest bucket that holds them; the rows past
them are padding that writes only the scratch row. Within a request, rows are padded too: a
tree to its `max_rows` (the pad nodes see only the committed rows and themselves), an extend
to `max_depth + 1` rows (pads first, real rows last: `ExtendRunner`). Attention gathers the
batch's pool rows in each layer (`index_select`): a copy of B whole rows that a paged-attention
kernel reading the pool in place would save.

A call that no graph takes (a draft with a step cut, whose level count the host decides; a head
whose weights moved since capture; a shape past the cache) runs the eager phases
(`batch_phases.EagerPhases`), the one definition that each static function is checked against
(tests/test_cuda_graph.py, `selfcheck.phase_parity`). In GraphMode.STATIC (the CPU tests) the
runners are never captured and run their static function on each call.
Not here: the phase math (draft / tree / verify / accept), which requests share a step
(`scheduler.py`).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .accept import draft_input
from .batch_phases import EagerPhases
from .config import SamplingParams, TreeParams
from .draft import Frontier, expand, join, top_children
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kv_cache import CacheSlots, KVCache, KVPool
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits

if TYPE_CHECKING:
    from .engine import EagleEngine
    from .run import Run

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before capture: lazy inits, cuBLAS workspaces, allocator growth


class GraphMode(enum.Enum):
    EAGER = "eager"  # the eager phases (the CPU path)
    STATIC = "static"  # the static functions over the pools, run eagerly (CPU tests)
    GRAPHS = "graphs"  # the static functions captured and replayed as CUDA graphs


def graph_mode(enabled: bool, device: torch.device) -> GraphMode:
    """The engine's choice: graphs on CUDA unless switched off, never on CPU."""
    return GraphMode.GRAPHS if enabled and device.type == "cuda" else GraphMode.EAGER


def buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: powers of two below `max_batch`, and `max_batch`."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


def bucket_for(n: int, max_batch: int) -> int:
    return next(b for b in buckets(max_batch) if b >= n)


@dataclass(slots=True)
class GraphBuffers:
    """Static inputs of one graph for a batch of B requests, T rows each. A replay reads these
    addresses, so they are only written in place. Every phase derives its positions, cache rows
    and masks from them inside the graph. Hidden widths and dtypes come from `hidden_size_for` /
    `dtype_for`. As allocated they hold a valid batch of padding (every slot the scratch row)."""

    ids: torch.Tensor  # [B, T] int64 tokens (draft: the level-1 top-k ids)
    hidden: torch.Tensor  # [B, T, W] hidden states in (W = 0 when the phase reads none)
    offsets: torch.Tensor  # [B, T] int64 verify: node depth; extend: cache row - seq_len
    ancestors: torch.Tensor  # [B, T, T] bool verify: [b, i, j] = node j is i's ancestor-or-self
    scores: torch.Tensor  # [B, T] float32 draft: the level-1 top-k probabilities
    seq_len: torch.Tensor  # [B] int64 committed length of each request
    slots: torch.Tensor  # [B] int64 pool row of each request (`KVPool.scratch` for padding)
    cols: torch.Tensor  # [L] int64 arange over the pool's rows

    @classmethod
    def allocate(cls, batch: int, num_tokens: int, width: int, dtype: torch.dtype,
                 pool: KVPool, device: torch.device) -> GraphBuffers:
        long = {"dtype": torch.long, "device": device}
        B, T = batch, num_tokens
        eye = torch.eye(T, dtype=torch.bool, device=device)
        return cls(ids=torch.zeros(B, T, **long),
                   hidden=torch.zeros(B, T, width, dtype=dtype, device=device),
                   offsets=torch.arange(T, **long).repeat(B, 1),
                   ancestors=eye.repeat(B, 1, 1),
                   scores=torch.full((B, T), 1.0 / T, device=device),
                   seq_len=torch.zeros(B, **long), slots=torch.full((B,), pool.scratch, **long),
                   cols=torch.arange(pool.max_len, **long))

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[1]


def block_mask(cols: torch.Tensor, seq_len: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Each request's committed rows (< seq_len) and `block` [B, T, W] (which of the W rows from
    seq_len each token sees) -> the whole-row mask [B, T, L]."""
    W = block.shape[-1]
    rel = cols - seq_len[:, None]  # [B, L] row relative to the committed length
    inside = ((rel >= 0) & (rel < W))[:, None, :]  # [B, 1, L]
    placed = block.gather(2, rel.clamp(0, W - 1)[:, None, :].expand(-1, block.shape[1], -1))
    return (rel < 0)[:, None, :] | (placed & inside)  # [B, T, L]


def draft_static(model: Eagle3Draft, b: GraphBuffers, pool: KVPool, tree: TreeParams
                 ) -> DraftTree:
    """`draft.draft_levels` of a batch of requests with static shapes and no `step_cut`: the same
    levels, candidate layout and arithmetic, with each request's committed length a device
    value, its K scratch rows a level written by index from its committed length, and its mask
    spanning its whole pool row. -> candidates [B, capacity]."""
    K, S = tree.topk, tree.num_steps
    B, dev = b.batch, b.ids.device
    front, first = Frontier.first(b.scores, b.ids, b.hidden)  # [B, K], [B, K, Hd]
    levels = [first]
    for step in range(S - 1):
        mask = block_mask(b.cols, b.seq_len, front.scratch_seen())  # [B, K, L]
        positions = (b.seq_len + step)[:, None].expand(B, K)
        rows = b.seq_len[:, None] + step * K + torch.arange(K, device=dev)  # [B, K]
        logits, h = model(front.ids, front.hidden, positions, pool, 0, mask, from_target=False,
                          at=CacheSlots(b.slots, rows))
        front, level = expand(front, *top_children(logits, K, model.target_ids), h)
        levels.append(level)
    return join(levels)


def verify_static(target: TargetModel, b: GraphBuffers, pool: KVPool,
                  aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.run_target` of a batch of trees padded to T nodes: node i of request b at cache
    row seq_len + i, position seq_len + depth -> logits [B, T, V], features [B, T, W]."""
    T = b.num_tokens
    rows = b.seq_len[:, None] + torch.arange(T, device=b.ids.device)  # [B, T]
    out = target(b.ids, b.seq_len[:, None] + b.offsets, pool, 0,
                 block_mask(b.cols, b.seq_len, b.ancestors), aux_layer_ids,
                 at=CacheSlots(b.slots, rows))
    return out.logits, out.aux_hidden if aux_layer_ids else out.final_hidden


def extend_static(model: Eagle3Draft, b: GraphBuffers, pool: KVPool, topk: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept.extend_rows` of a batch, each request's rows at cache rows (and positions)
    seq_len + offsets, causal by row -> the top-k after each request's last buffer row
    (probabilities [B, K], target ids [B, K]) and its recycled hidden [B, Hd]."""
    T = b.num_tokens
    rows = b.seq_len[:, None] + b.offsets  # [B, T] draft cache row == position
    causal = torch.arange(T, device=b.ids.device) <= b.offsets[:, :, None]  # [B, T, T]
    logits, h = model(b.ids, b.hidden, rows, pool, 0, block_mask(b.cols, b.seq_len, causal),
                      from_target=True, last_only=True, at=CacheSlots(b.slots, rows))
    return *top_children(logits[:, -1], topk, model.target_ids), h[:, -1]  # [B, K] [B, K] [B, Hd]


def decode_static(target: TargetModel, b: GraphBuffers, pool: KVPool) -> torch.Tensor:
    """`batch_phases.decode` of a batch: each request's token at row and position seq_len ->
    logits [B, 1, V]."""
    rows = b.seq_len[:, None]  # [B, 1]
    mask = (b.cols <= rows)[:, None, :]  # [B, 1, L]
    return target(b.ids, rows, pool, 0, mask, at=CacheSlots(b.slots, rows)).logits


def weights_key(model: Eagle3Draft) -> tuple[int, int]:
    """Addresses of the draft's embedding and lm_head: a graph bakes them in at capture."""
    return model.embed_tokens.weight.data_ptr(), model.lm_head.weight.data_ptr()


class GraphRunner:
    """Capture and replay of one phase's static function for a bucket of B requests. A subclass
    defines `fits(inp)` (one request's input matches the static shape), `prepare(i, inp)` (copy
    it into batch row i of the buffers), `forward()` (the static function: reads only the
    buffers, no host sync) and `output(out, i, inp)` (request i's result)."""

    def __init__(self, buffers: GraphBuffers, pool: KVPool) -> None:
        self.buffers, self.pool = buffers, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured: Any = None
        self.slots = [pool.scratch] * buffers.batch  # what `buffers.slots` holds, on the host

    def capture(self, mempool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        """Warm up and capture on the buffers as allocated: padding, writing the scratch row."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool, stream=stream):
            self.captured = self.forward()
        self.graph = graph

    def __call__(self, inputs: Sequence[Any], slots: Sequence[int]) -> list[Any]:
        """Requests' inputs and their pool rows (at most B) -> their outputs; the rows past
        them are padding on the scratch row."""
        b, n = self.buffers, len(inputs)
        for i, (inp, slot) in enumerate(zip(inputs, slots)):
            if self.slots[i] != slot:
                b.slots[i].fill_(slot)
            self.prepare(i, inp)
        wanted = list(slots) + [self.pool.scratch] * (b.batch - n)
        if self.slots[n:] != wanted[n:]:  # rows a request left: padding again, from row 0
            b.slots[n:].fill_(self.pool.scratch)
            b.seq_len[n:].zero_()
        self.slots = wanted
        if self.graph is None:
            out = self.forward()
        else:
            self.graph.replay()
            out = self.captured
        return [self.output(out, i, inp) for i, inp in enumerate(inputs)]

    def fits(self, inp: Any) -> bool:
        raise NotImplementedError

    def prepare(self, i: int, inp: Any) -> None:
        raise NotImplementedError

    def forward(self) -> Any:
        raise NotImplementedError

    def output(self, out: Any, i: int, inp: Any) -> Any:
        raise NotImplementedError


class DraftRunner(GraphRunner):
    """The draft's `num_steps - 1` levels (K frontier tokens a level) as one graph."""

    def __init__(self, model: Eagle3Draft, pool: KVPool, tree: TreeParams, batch: int) -> None:
        width = EagleDraftInput.hidden_size_for(model.cfg)
        dtype = EagleDraftInput.dtype_for(model)
        super().__init__(GraphBuffers.allocate(batch, tree.topk, width, dtype, pool,
                                               model.d2t.device), pool)
        self.model, self.tree, self.weights = model, tree, weights_key(model)

    def fits(self, inp: EagleDraftInput) -> bool:
        K, S = self.tree.topk, self.tree.num_steps
        return (inp.topk_ids.numel() == K and weights_key(self.model) == self.weights
                and inp.seq_len + (S - 1) * K <= self.pool.max_len)

    def prepare(self, i: int, inp: EagleDraftInput) -> None:
        b = self.buffers
        b.ids[i].copy_(inp.topk_ids)
        b.scores[i].copy_(inp.topk_p)
        b.hidden[i].copy_(inp.hidden.expand_as(b.hidden[i]))
        b.seq_len[i].fill_(inp.seq_len)

    def forward(self) -> DraftTree:
        return draft_static(self.model, self.buffers, self.pool, self.tree)

    def output(self, out: DraftTree, i: int, inp: EagleDraftInput) -> DraftTree:
        return DraftTree(out.scores[i].clone(), out.tokens[i].clone(), out.parents[i].clone())


class VerifyRunner(GraphRunner):
    """The target over each request's tree, padded to `num_tokens` nodes; every hidden kept."""

    def __init__(self, target: TargetModel, pool: KVPool, num_tokens: int,
                 aux_layer_ids: tuple[int, ...], batch: int) -> None:
        super().__init__(GraphBuffers.allocate(batch, num_tokens, 0, target.dtype, pool,
                                               target.device), pool)
        self.target, self.aux_layer_ids = target, aux_layer_ids
        self.eye = self.buffers.ancestors[0].clone()  # [T, T] a pad node sees itself

    def fits(self, vin: EagleVerifyInput) -> bool:
        N = self.buffers.num_tokens
        return vin.tokens.numel() <= N and vin.seq_len + N <= self.pool.max_len

    def prepare(self, i: int, vin: EagleVerifyInput) -> None:
        b, n = self.buffers, vin.tokens.numel()
        if n < b.num_tokens:
            b.ids[i, n:].zero_()
            b.offsets[i, n:].zero_()
            b.ancestors[i].copy_(self.eye)
        b.ids[i, :n].copy_(vin.tokens)
        b.offsets[i, :n].copy_(vin.depth)
        b.ancestors[i, :n, :n].copy_(vin.ancestors)
        b.seq_len[i].fill_(vin.seq_len)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return verify_static(self.target, self.buffers, self.pool, self.aux_layer_ids)

    def output(self, out: tuple[torch.Tensor, torch.Tensor], i: int, vin: EagleVerifyInput
               ) -> TreeLogits:
        """Views into graph memory, valid until the next replay (the engine consumes them
        first)."""
        n = vin.tokens.numel()
        return TreeLogits(out[0][i, :n], out[1][i, :n])


class ExtendRunner(GraphRunner):
    """The draft extend over each request's accepted tokens, padded to max_depth + 1 rows (the
    longest accepted path plus the bonus). Real rows go last, so the last row is the last
    accepted token, as in the eager extend; pad rows write uncommitted cache rows after the
    real ones, which the next draft overwrites and no real row sees."""

    def __init__(self, model: Eagle3Draft, target: TargetModel, pool: KVPool, tree: TreeParams,
                 batch: int) -> None:
        width = EagleDraftExtendInput.hidden_size_for(model.cfg)
        dtype = EagleDraftExtendInput.dtype_for(target)
        T, dev = tree.max_depth + 1, model.d2t.device
        super().__init__(GraphBuffers.allocate(batch, T, width, dtype, pool, dev), pool)
        self.model, self.topk, self.weights = model, tree.topk, weights_key(model)
        # [pad, T] cache row (minus seq_len) of each buffer row: pads first, then the real rows
        self.row_tables = torch.stack([torch.arange(T, device=dev).roll(pad) for pad in range(T)])

    def fits(self, ext: EagleDraftExtendInput) -> bool:
        T = self.buffers.num_tokens
        return (1 <= ext.tokens.numel() <= T and ext.seq_len + T <= self.pool.max_len
                and weights_key(self.model) == self.weights)

    def prepare(self, i: int, ext: EagleDraftExtendInput) -> None:
        b = self.buffers
        pad = b.num_tokens - ext.tokens.numel()
        b.ids[i, :pad].zero_()
        b.ids[i, pad:].copy_(ext.tokens)
        b.hidden[i, :pad].zero_()
        b.hidden[i, pad:].copy_(ext.hidden)
        b.offsets[i].copy_(self.row_tables[pad])
        b.seq_len[i].fill_(ext.seq_len)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return extend_static(self.model, self.buffers, self.pool, self.topk)

    def output(self, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], i: int,
               ext: EagleDraftExtendInput) -> EagleDraftInput:
        topk_p, topk_ids, hidden = out
        return draft_input(ext, topk_p[i].clone(), topk_ids[i].clone(), hidden[i].clone())


class DecodeRunner(GraphRunner):
    """Plain decoding's one-token target step; input (token [1] on the device, committed
    length)."""

    def __init__(self, target: TargetModel, pool: KVPool, batch: int) -> None:
        super().__init__(GraphBuffers.allocate(batch, 1, 0, target.dtype, pool, target.device),
                         pool)
        self.target = target

    def fits(self, inp: tuple[torch.Tensor, int]) -> bool:
        return inp[1] < self.pool.max_len

    def prepare(self, i: int, inp: tuple[torch.Tensor, int]) -> None:
        self.buffers.ids[i].copy_(inp[0])
        self.buffers.seq_len[i].fill_(inp[1])

    def forward(self) -> torch.Tensor:
        return decode_static(self.target, self.buffers, self.pool)

    def output(self, out: torch.Tensor, i: int, inp: tuple[torch.Tensor, int]) -> torch.Tensor:
        return out[i]  # [1, V] a view, consumed before the next replay


class GraphPhases(EagerPhases):
    """The phase backend under graphs (`GraphMode.GRAPHS` on CUDA; STATIC runs the same static
    functions without capture). Owns the pools the requests' caches are rows of (made at the
    first lease; `max_batch` slots and a scratch row each) and the runners, made (and captured)
    the first time a phase needs one: keyed by phase, static shape and bucket. Each phase serves
    what a graph takes and hands the rest to `EagerPhases`."""

    def __init__(self, target: TargetModel, heads: dict[str, Eagle3Draft], max_len: int,
                 max_batch: int, mode: GraphMode) -> None:
        super().__init__(target, heads, max_len)
        self.max_batch, self.mode = max_batch, mode
        self.pool: KVPool | None = None
        self.draft_pools: dict[str, KVPool] = {}
        self.free = list(range(max_batch))[::-1]  # pool rows not leased
        self.runners: dict[tuple, GraphRunner | None] = {}  # None: its capture failed
        self.mempool: tuple[int, int] | None = None

    # ----- caches
    def lease(self, prompt_len: int, params: SamplingParams, tree: TreeParams,
              head: str | None) -> tuple[int | None, KVCache, KVCache | None]:
        if not self.free:
            raise RuntimeError(f"every one of the {self.max_batch} cache slots is leased")
        if self.pool is None:
            self.pool = self.target.new_pool(self.max_batch, self.max_len)
        slot = self.free.pop()
        draft_cache = None
        if head is not None:
            if head not in self.draft_pools:
                model = self.heads[head]
                self.draft_pools[head] = model.new_pool(self.max_batch, model.max_len)
            draft_cache = self.draft_pools[head].row(slot)
        return slot, self.pool.row(slot), draft_cache

    def release(self, slot: int | None) -> None:
        self.free.append(slot)

    # ----- the phases
    def draft(self, model: Eagle3Draft, runs: list[Run], states: list[EagleDraftInput]
              ) -> list[DraftTree]:
        def runner(r: Run, B: int) -> DraftRunner | None:
            if r.tree.step_cut or r.tree.num_steps < 2:  # host-decided levels, or no level
                return None
            key = ("draft", r.head, r.tree.topk, r.tree.num_steps, B)
            return self._runner(key, lambda: DraftRunner(model, self.draft_pools[r.head],
                                                         r.tree, B))
        outs = self._serve(runs, states, runner)
        return self._eager_rest(outs, super().draft, model, runs, states)

    def verify(self, target: TargetModel, runs: list[Run], vins: list[EagleVerifyInput],
               plain: list[Run], tokens: list[torch.Tensor], seq_lens: list[int]
               ) -> list[TreeLogits]:
        def tree_runner(r: Run, B: int) -> VerifyRunner:
            key = ("verify", r.aux_ids, r.tree.max_rows, B)
            return self._runner(key, lambda: VerifyRunner(target, self.pool, r.tree.max_rows,
                                                          r.aux_ids, B))

        def decode_runner(r: Run, B: int) -> DecodeRunner:
            return self._runner(("decode", B), lambda: DecodeRunner(target, self.pool, B))
        trees = self._serve(runs, vins, tree_runner)
        decodes = self._serve(plain, list(zip(tokens, seq_lens)), decode_runner)
        outs = trees + [None if d is None else TreeLogits(d, None) for d in decodes]
        rest = [i for i, o in enumerate(outs) if o is None]  # the trees' first, in order
        if rest:
            t_rest = [i for i in rest if i < len(runs)]
            p_rest = [i - len(runs) for i in rest if i >= len(runs)]
            eager = super().verify(target, [runs[i] for i in t_rest], [vins[i] for i in t_rest],
                                   [plain[i] for i in p_rest], [tokens[i] for i in p_rest],
                                   [seq_lens[i] for i in p_rest])
            for i, out in zip(rest, eager):
                outs[i] = out
        return outs

    def extend(self, model: Eagle3Draft, runs: list[Run], exts: list[EagleDraftExtendInput]
               ) -> list[EagleDraftInput]:
        def runner(r: Run, B: int) -> ExtendRunner:
            key = ("extend", r.head, r.tree.topk, r.tree.max_depth, B)
            return self._runner(key, lambda: ExtendRunner(model, self.target,
                                                          self.draft_pools[r.head], r.tree, B))
        outs = self._serve(runs, exts, runner)
        return self._eager_rest(outs, super().extend, model, runs, exts)

    # ----- runners
    def _serve(self, runs: list[Run], inputs: list[Any],
               runner: Callable[[Run, int], GraphRunner | None]) -> list[Any]:
        """Each request's output from a graph (None where none takes it): the requests whose
        inputs one runner fits replay it together, in the smallest bucket that holds them."""
        groups: dict[int, tuple[GraphRunner, Run, list[int]]] = {}
        for i, r in enumerate(runs):
            shape = None if r.slot is None else runner(r, 1)  # a shape's `fits` for every bucket
            if shape is not None and shape.fits(inputs[i]):
                groups.setdefault(id(shape), (shape, r, []))[2].append(i)
        outs: list[Any] = [None] * len(runs)
        for shape, first, idx in groups.values():
            graph = shape if len(idx) == 1 else runner(first, bucket_for(len(idx),
                                                                         self.max_batch))
            if graph is None:
                continue
            for i, out in zip(idx, graph([inputs[i] for i in idx], [runs[i].slot for i in idx])):
                outs[i] = out
        return outs

    @staticmethod
    def _eager_rest(outs: list[Any], eager: Callable, model: Any, runs: list[Run],
                    inputs: list[Any]) -> list[Any]:
        rest = [i for i, o in enumerate(outs) if o is None]
        if rest:
            for i, out in zip(rest, eager(model, [runs[i] for i in rest],
                                          [inputs[i] for i in rest])):
                outs[i] = out
        return outs

    def _runner(self, key: tuple, make: Callable[[], GraphRunner]) -> GraphRunner | None:
        """The runner for `key`, made (and captured with GRAPHS) the first time; None when its
        capture failed (that shape then runs eagerly)."""
        if key not in self.runners:
            runner = make()
            if self.mode is GraphMode.GRAPHS:
                try:
                    self.capture(runner)
                except RuntimeError as e:  # out of memory, or an op that cannot be captured
                    log.warning("CUDA graph capture of %s failed, it runs eagerly "
                                "(--no-cuda-graphs skips capture): %s", key, e)
                    runner = None
            self.runners[key] = runner
        return self.runners[key]


    def capture(self, runner: GraphRunner) -> None:
        """Capture `runner` into the backend's one graph memory pool."""
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        runner.capture(self.mempool, torch.cuda.Stream())
        torch.cuda.synchronize()


def phases_for(engine: EagleEngine, max_batch: int) -> EagerPhases:
    """A scheduler's phase backend: `GraphPhases` under graphs, `EagerPhases` otherwise."""
    mode, window = engine.graph_mode, engine.config.max_len
    if mode is GraphMode.EAGER:
        return EagerPhases(engine.target, engine.heads, window)
    return GraphPhases(engine.target, engine.heads, window, max_batch, mode)
