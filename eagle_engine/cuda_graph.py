"""CUDA graphs for the per-iteration phases over a padded batch of requests: `GraphPhases`, the
scheduler's phase backend under CUDA graphs.

Under graphs every request's caches are rows of one `KVPool` per model (the target's, and each
head's), leased as slots when the request is admitted, so a captured graph serves whichever
requests a step brings: it reads their pool rows from a slot buffer. A graph captures the
phase's one definition (`draft.draft_levels`, `verify.verify_forward`, `accept.extend_forward`;
plain decoding's step is a verify of one node) over the pool rows (`models/batched.PoolSlots`),
the same function the CPU runs eagerly over the requests' own caches. A runner exists per
phase, static shape (the head and tree's widths) and batch-size bucket (1, 2, 4, ... up to
`max_batch`); `warm_up` captures every bucket of the trees a server starts with, and a shape
first met later (a visitor's slider) is captured then. A step's requests that share a graph
replay the smallest bucket that holds them; the rows past them are padding that writes only
the pool's scratch row. Within a request, rows are padded too: a tree to its `max_rows` (the
pad nodes see only the committed rows and themselves), an extend to `max_depth + 1` rows (pads
first, real rows last). Outputs are copied out of the graph's memory at once, so no later
replay of the step overwrites what a request still reads.

A capture that fails stops with `GraphCaptureError`, naming the phase, its shape and the op
(`capture_guard.CaptureGuard` names an op that reads the device or shapes by values before the
capture is tried); `--no-cuda-graphs` runs every phase eagerly instead. At most `MAX_GRAPHS`
runners live at once: past that, the one replayed least recently that no warm-up made goes.
A call that no graph takes (a draft with a step cut, whose level count the host decides; a
head whose weights moved since capture; a shape past the cache) runs the eager phases
(`batch_phases.EagerPhases`). In GraphMode.STATIC (the CPU tests) the runners are never
captured and run their function over the pool on each call.
Not here: the phase math (draft / tree / verify / accept), which requests share a step
(`scheduler.py`).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .accept import draft_input, extend_forward
from .batch_phases import EagerPhases, Seat
from .capture_guard import CaptureGuard, CaptureUnsafe
from .config import SamplingParams, TreeParams
from .draft import draft_levels
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kv_cache import KVCache, KVPool
from .models.batched import PoolSlots
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits, verify_forward

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before capture: lazy inits, cuBLAS workspaces, allocator growth
# runners alive at once (each holds its buffers and its graph's share of the memory pool):
# the warm-up's (every bucket of plain decoding and each head's default tree) plus the shapes
# visitors' sliders make, the least recently replayed of those released first
MAX_GRAPHS = 64


class GraphMode(enum.Enum):
    EAGER = "eager"  # the eager phases (the CPU path)
    STATIC = "static"  # the phases over the pools, run eagerly, never captured (CPU tests)
    GRAPHS = "graphs"  # the phases over the pools captured and replayed as CUDA graphs


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
                   seq_len=torch.zeros(B, **long), slots=torch.full((B,), pool.scratch, **long))

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[1]


def weights_key(model: Eagle3Draft) -> tuple[int, int]:
    """Addresses of the draft's embedding and lm_head (its codes when they are low-bit): a
    graph bakes them in at capture."""
    lm_head = model.lm_head
    held = lm_head.weight if hasattr(lm_head, "weight") else lm_head.codes
    return model.embed_tokens.weight.data_ptr(), held.data_ptr()


class GraphCaptureError(RuntimeError):
    """A phase's graph could not be captured: start-up stops (`--no-cuda-graphs` runs the
    phases eagerly)."""


class GraphRunner:
    """Capture and replay of one phase's function over a bucket of B requests' pool rows. A
    subclass defines `fits(inp)` (one request's input matches the static shape), `prepare(i,
    inp)` (copy it into batch row i of the buffers), `forward()` (the phase over
    `self.rows()`: reads only the buffers, no host sync) and `output(out, i, inp)` (request
    i's result, copied out of graph memory)."""

    def __init__(self, buffers: GraphBuffers, pool: KVPool) -> None:
        self.buffers, self.pool = buffers, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured: Any = None
        self.slots = [pool.scratch] * buffers.batch  # what `buffers.slots` holds, on the host
        self.bytes = 0  # device memory the capture took (GRAPHS); else the buffers' bytes
        self.pinned = False  # made by `warm_up`: never evicted
        self.last_used = 0

    def rows(self) -> PoolSlots:
        """The batch's pool rows; attention reads them in place on CUDA (the Triton kernel),
        gathers them under a mask elsewhere (STATIC on a CPU)."""
        b = self.buffers
        return PoolSlots(self.pool, b.slots, b.seq_len, self.pool.data.is_cuda)

    def buffer_bytes(self) -> int:
        b = self.buffers
        return sum(t.numel() * t.element_size() for t in (
            b.ids, b.hidden, b.offsets, b.ancestors, b.scores, b.seq_len, b.slots))

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
        b.hidden[i, 0].copy_(inp.hidden)
        b.seq_len[i].fill_(inp.seq_len)

    def forward(self) -> list[DraftTree]:
        b = self.buffers
        return draft_levels(self.model, self.rows(), b.scores, b.ids, b.hidden[:, 0],
                            [self.tree] * b.batch)

    def output(self, out: list[DraftTree], i: int, inp: EagleDraftInput) -> DraftTree:
        return DraftTree(out[i].scores.clone(), out[i].tokens.clone(), out[i].parents.clone())


class VerifyRunner(GraphRunner):
    """The target over each request's tree, padded to `num_tokens` nodes; `features`: the
    layers whose inputs the head reads (`verify.verify_forward`), None for plain decoding."""

    def __init__(self, target: TargetModel, pool: KVPool, num_tokens: int,
                 features: tuple[int, ...] | None, batch: int) -> None:
        super().__init__(GraphBuffers.allocate(batch, num_tokens, 0, target.dtype, pool,
                                               target.device), pool)
        self.target, self.features = target, features
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

    def forward(self) -> list[TreeLogits]:
        b = self.buffers
        return verify_forward(self.target, self.rows(), b.ids, b.offsets, b.ancestors,
                              [self.features] * b.batch)

    def output(self, out: list[TreeLogits], i: int, vin: EagleVerifyInput) -> TreeLogits:
        n = vin.tokens.numel()
        return TreeLogits(out[i].logits[:n].clone(), out[i].features[:n].clone())


class DecodeRunner(VerifyRunner):
    """Plain decoding's step, a verify of one node; input (token [1] on the device, committed
    length)."""

    def __init__(self, target: TargetModel, pool: KVPool, batch: int) -> None:
        super().__init__(target, pool, 1, None, batch)

    def fits(self, inp: tuple[torch.Tensor, int]) -> bool:
        return inp[1] < self.pool.max_len

    def prepare(self, i: int, inp: tuple[torch.Tensor, int]) -> None:
        self.buffers.ids[i].copy_(inp[0])
        self.buffers.seq_len[i].fill_(inp[1])

    def output(self, out: list[TreeLogits], i: int, inp: tuple[torch.Tensor, int]
               ) -> torch.Tensor:
        return out[i].logits.clone()  # [1, V]


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
        b = self.buffers
        return extend_forward(self.model, self.rows(), b.ids, b.hidden, b.offsets, None,
                              self.topk)

    def output(self, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], i: int,
               ext: EagleDraftExtendInput) -> EagleDraftInput:
        topk_p, topk_ids, hidden = out
        return draft_input(ext, topk_p[i].clone(), topk_ids[i].clone(), hidden[i].clone())


class GraphPhases(EagerPhases):
    """The phase backend under graphs (`GraphMode.GRAPHS` on CUDA; STATIC runs the same
    functions over the pools without capture). Owns the pools the requests' caches are rows of
    (made at the first lease or warm-up; `max_batch` slots and a scratch row each) and the
    runners, keyed by phase, static shape and bucket. Each phase serves what a graph takes and
    hands the rest to `EagerPhases`."""

    def __init__(self, target: TargetModel, heads: dict[str, Eagle3Draft], max_len: int,
                 max_batch: int, mode: GraphMode) -> None:
        super().__init__(target, heads, max_len)
        self.max_batch, self.mode = max_batch, mode
        self.pool: KVPool | None = None
        self.draft_pools: dict[str, KVPool] = {}
        self.free = list(range(max_batch))[::-1]  # pool rows not leased
        self.runners: dict[tuple, GraphRunner] = {}
        self.mempool: tuple[int, int] | None = None
        self.uses = 0  # runner calls so far: the clock of `GraphRunner.last_used`

    # ----- caches
    def _pools(self, head: str | None) -> None:
        if self.pool is None:
            self.pool = self.target.new_pool(self.max_batch, self.max_len)
        if head is not None and head not in self.draft_pools:
            model = self.heads[head]
            self.draft_pools[head] = model.new_pool(self.max_batch, model.max_len)

    def lease(self, prompt_len: int, params: SamplingParams, tree: TreeParams,
              head: str | None) -> tuple[int | None, KVCache, KVCache | None]:
        if not self.free:
            raise RuntimeError(f"every one of the {self.max_batch} cache slots is leased")
        self._pools(head)
        slot = self.free.pop()
        draft_cache = None if head is None else self.draft_pools[head].row(slot)
        return slot, self.pool.row(slot), draft_cache

    def release(self, slot: int | None) -> None:
        self.free.append(slot)

    # ----- the runners of each phase: (key, make) for a shape and bucket
    def _draft_runner(self, head: str, tree: TreeParams, B: int
                      ) -> tuple[tuple, Callable[[], GraphRunner]] | None:
        if tree.step_cut or tree.num_steps < 2:  # host-decided levels, or no level
            return None
        return (("draft", head, tree.topk, tree.num_steps, B),
                lambda: DraftRunner(self.heads[head], self.draft_pools[head], tree, B))

    def _verify_runner(self, features: tuple[int, ...], tree: TreeParams, B: int
                       ) -> tuple[tuple, Callable[[], GraphRunner]]:
        return (("verify", features, tree.max_rows, B),
                lambda: VerifyRunner(self.target, self.pool, tree.max_rows, features, B))

    def _decode_runner(self, B: int) -> tuple[tuple, Callable[[], GraphRunner]]:
        return ("decode", B), lambda: DecodeRunner(self.target, self.pool, B)

    def _extend_runner(self, head: str, tree: TreeParams, B: int
                       ) -> tuple[tuple, Callable[[], GraphRunner]]:
        return (("extend", head, tree.topk, tree.max_depth, B),
                lambda: ExtendRunner(self.heads[head], self.target, self.draft_pools[head],
                                     tree, B))

    def warm_up(self, trees: dict[str, TreeParams]) -> list[GraphRunner]:
        """Make (and with GRAPHS capture) every bucket of plain decoding and of each head's
        tree in `trees` before the first request: none of them is captured during an answer,
        nor evicted. Raises `GraphCaptureError` when one fails."""
        made = []
        for B in buckets(self.max_batch):
            wanted = [self._decode_runner(B)]
            for head, tree in trees.items():
                self._pools(head)
                aux = self.heads[head].cfg
                features = (aux.resolve_aux_layer_ids(self.target.cfg)
                            if aux.use_aux_hidden_state else ())
                wanted += [self._verify_runner(features, tree, B),
                           self._extend_runner(head, tree, B)]
                if (draft := self._draft_runner(head, tree, B)) is not None:
                    wanted.append(draft)
            self._pools(None)
            for key, make in wanted:
                runner = self._runner(key, make)
                runner.pinned = True
                made.append(runner)
        return made

    # ----- the phases
    def draft(self, model: Eagle3Draft, runs: list[Seat], states: list[EagleDraftInput]
              ) -> list[DraftTree]:
        outs = self._serve(runs, states, lambda r, B: self._draft_runner(r.head, r.tree, B))
        return self._eager_rest(outs, super().draft, model, runs, states)

    def verify(self, target: TargetModel, runs: list[Seat], vins: list[EagleVerifyInput],
               plain: list[Seat], tokens: list[torch.Tensor], seq_lens: list[int]
               ) -> list[TreeLogits]:
        trees = self._serve(runs, vins,
                            lambda r, B: self._verify_runner(r.aux_ids, r.tree, B))
        decodes = self._serve(plain, list(zip(tokens, seq_lens)),
                              lambda r, B: self._decode_runner(B))
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

    def extend(self, model: Eagle3Draft, runs: list[Seat], exts: list[EagleDraftExtendInput]
               ) -> list[EagleDraftInput]:
        outs = self._serve(runs, exts, lambda r, B: self._extend_runner(r.head, r.tree, B))
        return self._eager_rest(outs, super().extend, model, runs, exts)

    # ----- runners
    def _serve(self, runs: list[Seat], inputs: list[Any],
               spec: Callable[[Seat, int], tuple[tuple, Callable[[], GraphRunner]] | None]
               ) -> list[Any]:
        """Each request's output from a graph (None where none takes it): the requests whose
        inputs one shape fits replay it together, in the smallest bucket that holds them."""
        groups: dict[tuple, tuple[Seat, list[int]]] = {}
        for i, r in enumerate(runs):
            one = None if r.slot is None else spec(r, 1)  # a shape's `fits` for every bucket
            if one is not None and self._runner(*one).fits(inputs[i]):
                groups.setdefault(one[0], (r, []))[1].append(i)
        outs: list[Any] = [None] * len(runs)
        for first, idx in groups.values():
            graph = self._runner(*spec(first, bucket_for(len(idx), self.max_batch)))
            for i, out in zip(idx, graph([inputs[i] for i in idx], [runs[i].slot for i in idx])):
                outs[i] = out
        return outs

    @staticmethod
    def _eager_rest(outs: list[Any], eager: Callable, model: Any, runs: list[Seat],
                    inputs: list[Any]) -> list[Any]:
        rest = [i for i, o in enumerate(outs) if o is None]
        if rest:
            for i, out in zip(rest, eager(model, [runs[i] for i in rest],
                                          [inputs[i] for i in rest])):
                outs[i] = out
        return outs

    def _runner(self, key: tuple, make: Callable[[], GraphRunner]) -> GraphRunner:
        """The runner for `key`, made (and with GRAPHS captured) the first time. A failed
        capture raises `GraphCaptureError`; past `MAX_GRAPHS` runners the least recently
        replayed one that no warm-up made goes first."""
        self.uses += 1
        runner = self.runners.get(key)
        if runner is None:
            self._evict()
            runner = make()
            runner.bytes = runner.buffer_bytes()
            if self.mode is GraphMode.GRAPHS:
                self.capture(key, runner)
            self.runners[key] = runner
        runner.last_used = self.uses
        return runner

    def _evict(self) -> None:
        spare = [k for k, r in self.runners.items() if not r.pinned]
        while len(self.runners) >= MAX_GRAPHS and spare:
            key = min(spare, key=lambda k: self.runners[k].last_used)
            spare.remove(key)
            gone = self.runners.pop(key)
            if gone.graph is not None:
                gone.graph.reset()
            log.info("CUDA graph %s released (%d graphs at most)", key, MAX_GRAPHS)

    def capture(self, key: tuple, runner: GraphRunner) -> None:
        """Capture `runner` into the backend's one graph memory pool, after one run under
        `CaptureGuard` (which names an op no graph can hold) -> `runner.bytes`, the device
        memory the capture took. Raises `GraphCaptureError`."""
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated()
        try:
            with CaptureGuard():
                runner.forward()
            runner.capture(self.mempool, torch.cuda.Stream())
            torch.cuda.synchronize()
        except (RuntimeError, CaptureUnsafe) as e:
            raise GraphCaptureError(
                f"CUDA graph capture of the {key[0]} phase failed (shape {key[1:-1]}, bucket "
                f"{key[-1]}): {e}. Start with --no-cuda-graphs to run every phase eagerly"
            ) from e
        runner.bytes = max(runner.buffer_bytes(), torch.cuda.memory_allocated() - before)
        log.info("captured the %s graph %s: %.1f MiB", key[0], key[1:], runner.bytes / 2 ** 20)


def phases_for(target: TargetModel, heads: dict[str, Eagle3Draft], max_len: int,
               max_batch: int, mode: GraphMode) -> EagerPhases:
    """A scheduler's phase backend for `max_batch` requests in a context window of `max_len`:
    `GraphPhases` under graphs (GRAPHS, STATIC), `EagerPhases` otherwise."""
    if mode is GraphMode.EAGER:
        return EagerPhases(target, heads, max_len)
    return GraphPhases(target, heads, max_len, max_batch, mode)
