"""CUDA graphs for the per-iteration phases, kept apart from the models and the phase modules.

Owns `GraphBuffers` (typed static inputs), one runner per phase at one static shape (draft
multi-step decode at `topk` tokens per step, target verify at `num_draft_tokens`, draft extend
padded to `TreeParams.max_depth + 1`, and the baseline's one-token decode), capture (largest
first, warm-up, one shared memory pool) and `Phases`: the callables a request uses, replaying a
graph when the input fits its captured shape and calling the eager phase function otherwise.
Static shapes come from writing KV rows by index and masking over the whole cache (`cache_rows`
in `models/layers.py`). A runner that was never captured (GraphMode.STATIC) runs its static
function eagerly on replay: that is how the CPU tests pin the static path to the dynamic one.
The engine uses graphs only on CUDA. Not here: the phase math (draft / tree / verify / accept).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .accept import extend
from .config import TreeParams
from .draft import Frontier, draft, expand, join, top_children
from .io_struct import DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput
from .kernels import reference
from .kv_cache import KVCache
from .models.draft_model import Eagle3Draft
from .models.target import TargetModel
from .verify import TreeLogits, run_target

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before capture: lazy inits, cuBLAS workspaces, allocator growth


class CaptureHidden(enum.IntEnum):
    """Which hidden states a graph keeps as output (sglang's CaptureHiddenMode)."""

    NONE = 0
    LAST = 1
    FULL = 2

    def select(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [T, W] -> None, the last row [W], or all rows [T, W]."""
        if self is CaptureHidden.NONE:
            return None
        return hidden[-1] if self is CaptureHidden.LAST else hidden


class GraphMode(enum.Enum):
    EAGER = "eager"  # the dynamic phase functions (the CPU path)
    STATIC = "static"  # static buffers, replayed eagerly (CPU tests of the graph path)
    GRAPHS = "graphs"  # static buffers, captured and replayed as CUDA graphs


def graph_mode(enabled: bool, device: torch.device) -> GraphMode:
    """The engine's choice: graphs on CUDA unless switched off, never on CPU."""
    return GraphMode.GRAPHS if enabled and device.type == "cuda" else GraphMode.EAGER


@dataclass(slots=True)
class GraphBuffers:
    """Static inputs of one graph. A replay reads these addresses, so they are only written in
    place, never rebound. Hidden widths and dtypes come from `hidden_size_for` / `dtype_for`."""

    ids: torch.Tensor  # [T] int64 tokens (draft decode: the level-1 top-k ids)
    hidden: torch.Tensor  # [T, W] hidden states in (W = 0 when the phase reads none)
    positions: torch.Tensor  # [T] int64 RoPE positions
    cache_rows: torch.Tensor  # [T] int64 KV cache rows the tokens are written to
    mask: torch.Tensor  # [T, cache_len] bool: the rows each token attends to, whole cache
    scores: torch.Tensor  # [T] float32 (draft decode: the level-1 top-k probabilities)
    seq_len: torch.Tensor  # [] int64 committed length
    cols: torch.Tensor  # [cache_len] int64 arange, to build masks without allocating

    @classmethod
    def allocate(cls, num_tokens: int, width: int, dtype: torch.dtype, cache_len: int,
                 device: torch.device) -> GraphBuffers:
        long = {"dtype": torch.long, "device": device}
        rows = torch.arange(num_tokens, **long)
        return cls(ids=torch.zeros(num_tokens, **long),
                   hidden=torch.zeros(num_tokens, width, dtype=dtype, device=device),
                   positions=rows.clone(), cache_rows=rows,
                   mask=torch.zeros(num_tokens, cache_len, dtype=torch.bool, device=device),
                   scores=torch.zeros(num_tokens, device=device),
                   seq_len=torch.zeros((), **long), cols=torch.arange(cache_len, **long))

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    def causal_mask_from_rows(self) -> None:
        """Each token sees every cache row up to and including its own."""
        torch.le(self.cols[None, :], self.cache_rows[:, None], out=self.mask)

    def tree_mask(self, ancestors: torch.Tensor, seq_len: int) -> None:
        """ancestors [T, T]: the committed prefix plus the token's own tree ancestry."""
        torch.lt(self.cols.expand_as(self.mask), seq_len, out=self.mask)
        self.mask[:, seq_len:seq_len + self.num_tokens].copy_(ancestors)


def weights_key(model: Eagle3Draft) -> tuple[int, int]:
    """Addresses of the draft's embedding and lm_head: a graph bakes them in at capture."""
    return model.embed_tokens.weight.data_ptr(), model.lm_head.weight.data_ptr()


class GraphRunner:
    """Capture and replay of one phase at one static shape. A subclass defines `fits(inp)` (the
    input matches the captured shape), `replay_prepare(inp)` (copy it into the buffers and pad),
    `forward()` (the captured function: reads only the buffers, no host sync), `slice_out(out,
    inp)` (outputs back at the input's size) and `dummy_input()` (a valid input at committed
    length 0 for the warm-up runs, so warm-up writes only finite values into the cache)."""

    capture_hidden = CaptureHidden.NONE

    def __init__(self, buffers: GraphBuffers, cache: KVCache) -> None:
        self.buffers, self.cache = buffers, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None

    def capture(self, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        self.replay_prepare(self.dummy_input())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.output = self.forward()
        self.graph = graph

    def __call__(self, inp: Any) -> Any:
        self.replay_prepare(inp)
        if self.graph is None:
            return self.slice_out(self.forward(), inp)
        self.graph.replay()
        return self.slice_out(self.output, inp)


class DraftDecodeRunner(GraphRunner):
    """The whole `num_steps - 1` step draft loop as one graph (K tokens per step)."""

    def __init__(self, model: Eagle3Draft, cache: KVCache, tree: TreeParams) -> None:
        width = EagleDraftInput.hidden_size_for(model.cfg)
        dtype = EagleDraftInput.dtype_for(model)
        super().__init__(GraphBuffers.allocate(tree.topk, width, dtype, cache.max_len,
                                               model.d2t.device), cache)
        self.model, self.tree, self.weights = model, tree, weights_key(model)

    def fits(self, inp: EagleDraftInput) -> bool:
        K, S = self.tree.topk, self.tree.num_steps
        return (inp.topk_ids.numel() == K and weights_key(self.model) == self.weights
                and inp.seq_len + (S - 1) * K <= self.cache.max_len)

    def replay_prepare(self, inp: EagleDraftInput) -> None:
        b = self.buffers
        b.ids.copy_(inp.topk_ids)
        b.scores.copy_(inp.topk_p)
        b.hidden.copy_(inp.hidden.expand_as(b.hidden))
        b.seq_len.fill_(inp.seq_len)

    def forward(self) -> DraftTree:
        return draft_decode_static(self.model, self.buffers, self.cache, self.tree)

    def slice_out(self, out: DraftTree, inp: EagleDraftInput) -> DraftTree:
        return DraftTree(out.scores.clone(), out.tokens.clone(), out.parents.clone())

    def dummy_input(self) -> EagleDraftInput:
        b = self.buffers
        K = b.num_tokens
        return EagleDraftInput(torch.full_like(b.scores, 1.0 / K), torch.zeros_like(b.ids),
                               torch.zeros_like(b.hidden[0]), torch.zeros_like(b.ids[:1]), 0)


def draft_decode_static(model: Eagle3Draft, b: GraphBuffers, cache: KVCache,
                        tree: TreeParams) -> DraftTree:
    """`draft.draft` with static shapes: the same candidate layout and arithmetic, but the
    committed length is a device scalar, KV rows are written by index and every mask spans the
    whole cache. tests/test_cuda_graph.py pins the two together."""
    K, S = tree.topk, tree.num_steps
    dev = b.ids.device
    eye = torch.eye(K, dtype=torch.bool, device=dev)
    rel = b.cols - b.seq_len  # [L] cache row relative to the committed length
    committed = rel < 0  # [L]
    front, first = Frontier.first(b.scores, b.ids, b.hidden)
    levels = [first]
    for step in range(S - 1):
        width = (step + 1) * K
        tree_bits = torch.cat([front.ancestry, eye], dim=1)  # [K, width] over scratch rows
        scratch = tree_bits[:, rel.clamp(0, width - 1)] & ((rel >= 0) & (rel < width))  # [K, L]
        mask = (committed | scratch)[None]  # [1, K, L]
        positions = (b.seq_len + step).expand(1, K)
        rows = b.seq_len + step * K + torch.arange(K, device=dev)  # [K]
        logits, h = model(front.ids[None], front.hidden[None], positions, cache, 0, mask,
                          from_target=False, cache_rows=rows)
        front, level = expand(front, *top_children(logits[0], K, model.target_ids), h[0])
        levels.append(level)
    return join(levels)


class TargetRunner(GraphRunner):
    """Target forward at a static number of tokens; subclasses fill ids, positions and mask."""

    def __init__(self, target: TargetModel, cache: KVCache, num_tokens: int,
                 aux_layer_ids: tuple[int, ...], capture_hidden: CaptureHidden) -> None:
        super().__init__(GraphBuffers.allocate(num_tokens, 0, target.dtype, cache.max_len,
                                               target.device), cache)
        self.target, self.aux_layer_ids, self.capture_hidden = target, aux_layer_ids, capture_hidden
        self.node_rows = torch.arange(num_tokens, device=target.device)  # [T]

    def forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        out = self.target(b.ids[None], b.positions[None], self.cache, 0, b.mask[None],
                          self.aux_layer_ids, cache_rows=b.cache_rows)
        feats = out.aux_hidden if self.aux_layer_ids else out.final_hidden
        return out.logits[0], self.capture_hidden.select(feats[0])


class VerifyRunner(TargetRunner):
    """Target verify over the whole tree: N = num_draft_tokens, every hidden state kept."""

    def __init__(self, target: TargetModel, cache: KVCache, num_tokens: int,
                 aux_layer_ids: tuple[int, ...]) -> None:
        super().__init__(target, cache, num_tokens, aux_layer_ids, CaptureHidden.FULL)

    def fits(self, vin: EagleVerifyInput) -> bool:
        N = self.buffers.num_tokens
        return vin.tokens.numel() == N and vin.seq_len + N <= self.cache.max_len

    def replay_prepare(self, vin: EagleVerifyInput) -> None:
        b = self.buffers
        b.ids.copy_(vin.tokens)
        torch.add(vin.depth, vin.seq_len, out=b.positions)
        torch.add(self.node_rows, vin.seq_len, out=b.cache_rows)
        b.tree_mask(vin.ancestors, vin.seq_len)

    def slice_out(self, out: tuple[torch.Tensor, torch.Tensor], vin: EagleVerifyInput
                  ) -> TreeLogits:
        """Views into graph memory, valid until the next replay (the engine consumes them first)."""
        return TreeLogits(out[0], out[1])

    def dummy_input(self) -> EagleVerifyInput:
        parents = self.node_rows - 1  # a chain
        depth, ancestors, retrieve = reference.build_tree_from_parents(parents, parents.numel())
        return EagleVerifyInput(torch.zeros_like(parents), parents, depth, ancestors, retrieve, 0,
                                torch.ones(parents.shape, device=parents.device),
                                torch.zeros_like(parents))


class DecodeRunner(TargetRunner):
    """The baseline's one-token target decode; input (token [1] on the device, committed
    length)."""

    def __init__(self, target: TargetModel, cache: KVCache) -> None:
        super().__init__(target, cache, 1, (), CaptureHidden.NONE)

    def fits(self, inp: tuple[torch.Tensor, int]) -> bool:
        return inp[1] < self.cache.max_len

    def replay_prepare(self, inp: tuple[torch.Tensor, int]) -> None:
        b = self.buffers
        b.ids.copy_(inp[0])
        b.positions.fill_(inp[1])
        b.cache_rows.fill_(inp[1])
        b.causal_mask_from_rows()

    def slice_out(self, out: tuple[torch.Tensor, None], inp: tuple[torch.Tensor, int]
                  ) -> torch.Tensor:
        return out[0][-1:]  # [1, V] a view, consumed before the next replay

    def dummy_input(self) -> tuple[torch.Tensor, int]:
        return torch.zeros_like(self.buffers.ids), 0


class DraftExtendRunner(GraphRunner):
    """Draft extend over the accepted tokens, padded to max_depth + 1 rows (the longest accepted
    path plus the bonus: `num_steps + 1`, or deeper with context drafts). Real rows go last
    (so the last row is the last accepted token, as in the dynamic path); pad rows write to
    uncommitted cache rows after them, which the next draft overwrites, and no real row sees."""

    capture_hidden = CaptureHidden.LAST

    def __init__(self, model: Eagle3Draft, target: TargetModel, cache: KVCache,
                 tree: TreeParams) -> None:
        width = EagleDraftExtendInput.hidden_size_for(model.cfg)
        dtype = EagleDraftExtendInput.dtype_for(target)
        T, dev = tree.max_depth + 1, model.d2t.device
        super().__init__(GraphBuffers.allocate(T, width, dtype, cache.max_len, dev), cache)
        self.model, self.topk, self.weights = model, tree.topk, weights_key(model)
        slots = torch.arange(T, device=dev)
        # [pad, T] cache row (minus seq_len) of each slot: pads first, then the real rows
        self.row_tables = torch.stack([slots.roll(pad) for pad in range(T)])

    def fits(self, ext: EagleDraftExtendInput) -> bool:
        T = self.buffers.num_tokens
        return (1 <= ext.tokens.numel() <= T and ext.seq_len + T <= self.cache.max_len
                and weights_key(self.model) == self.weights)

    def replay_prepare(self, ext: EagleDraftExtendInput) -> None:
        b = self.buffers
        pad = b.num_tokens - ext.tokens.numel()
        b.ids[:pad].zero_()
        b.ids[pad:].copy_(ext.tokens)
        b.hidden[:pad].zero_()
        b.hidden[pad:].copy_(ext.hidden)
        torch.add(self.row_tables[pad], ext.seq_len, out=b.cache_rows)
        b.positions.copy_(b.cache_rows)  # draft cache row == position
        b.causal_mask_from_rows()

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        logits, h = self.model(b.ids[None], b.hidden[None], b.positions[None], self.cache, 0,
                               b.mask[None], from_target=True, last_only=True,
                               cache_rows=b.cache_rows)
        topk_p, topk_idx = torch.softmax(logits[0, -1], -1).topk(self.topk)
        return topk_p, self.model.target_ids(topk_idx), self.capture_hidden.select(h[0])

    def slice_out(self, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  ext: EagleDraftExtendInput) -> EagleDraftInput:
        topk_p, topk_ids, hidden = out
        return EagleDraftInput(topk_p.clone(), topk_ids.clone(), hidden.clone(),
                               root=ext.tokens[-1:], seq_len=ext.seq_len + ext.tokens.numel())

    def dummy_input(self) -> EagleDraftExtendInput:
        b = self.buffers
        return EagleDraftExtendInput(torch.zeros_like(b.ids), torch.zeros_like(b.hidden), 0)


def decode(target: TargetModel, token: torch.Tensor, seq_len: int, cache: KVCache
           ) -> torch.Tensor:
    """Eager baseline step: `token` [1] (on the device) at position `seq_len` -> next-token
    logits [1, V]."""
    position = torch.full((1, 1), seq_len, device=token.device)
    return target(token.view(1, 1), position, cache, seq_len, None).logits[0, -1:]


@dataclass(frozen=True)
class Phases:
    """The phase callables of a request, with the eager functions' signatures."""

    draft: Callable[[Eagle3Draft, EagleDraftInput, KVCache, TreeParams], DraftTree]
    run_target: Callable[[TargetModel, EagleVerifyInput, KVCache, tuple[int, ...]], TreeLogits]
    extend: Callable[[Eagle3Draft, EagleDraftExtendInput, KVCache, int], EagleDraftInput]
    decode: Callable[[TargetModel, torch.Tensor, int, KVCache], torch.Tensor]
    draft_cache: KVCache | None = None  # the draft cache the runners are bound to
    mode: GraphMode = GraphMode.EAGER


EAGER_PHASES = Phases(draft, run_target, extend, decode)


class GraphPhases:
    """Runners bound to the engine's target cache, one draft head (None: the baseline) with its
    own draft cache, and one tree shape. Each method falls back to the eager function when a
    call does not match what the runner was built for (another module, cache or shape)."""

    def __init__(self, target: TargetModel, target_cache: KVCache,
                 draft_model: Eagle3Draft | None, tree: TreeParams, draft_cache_len: int) -> None:
        self.tree, self.draft_cache = tree, None
        self.aux_layer_ids: tuple[int, ...] = ()
        self.runners: dict[str, tuple[torch.nn.Module, GraphRunner]] = {}  # largest first
        if draft_model is None:
            self.runners["decode"] = (target, DecodeRunner(target, target_cache))
            return
        self.aux_layer_ids = draft_model.cfg.resolve_aux_layer_ids(target.cfg)
        self.draft_cache = draft_model.new_cache(draft_cache_len)
        self.runners["verify"] = (target, VerifyRunner(target, target_cache,
                                                       tree.num_draft_tokens, self.aux_layer_ids))
        self.runners["draft"] = (draft_model, DraftDecodeRunner(draft_model, self.draft_cache,
                                                                tree))
        self.runners["extend"] = (draft_model, DraftExtendRunner(draft_model, target,
                                                                 self.draft_cache, tree))

    def capture(self) -> None:
        """Warm up and capture every runner into one shared memory pool, largest first."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for _, runner in self.runners.values():
            runner.capture(pool, stream)
        torch.cuda.synchronize()

    def _runner(self, name: str, module: torch.nn.Module, cache: KVCache, inp: Any
                ) -> GraphRunner | None:
        bound_module, runner = self.runners.get(name, (None, None))
        if runner is None or module is not bound_module or cache is not runner.cache:
            return None
        return runner if runner.fits(inp) else None

    def draft(self, model: Eagle3Draft, inp: EagleDraftInput, cache: KVCache,
              tree: TreeParams) -> DraftTree:
        # a step cut decides on the host how many levels run: no fixed-shape graph for it
        same = tree == self.tree and not tree.step_cut
        runner = self._runner("draft", model, cache, inp) if same else None
        return runner(inp) if runner else draft(model, inp, cache, tree)

    def run_target(self, target: TargetModel, vin: EagleVerifyInput, cache: KVCache,
                   aux_layer_ids: tuple[int, ...]) -> TreeLogits:
        runner = None
        if aux_layer_ids == self.aux_layer_ids:
            runner = self._runner("verify", target, cache, vin)
        return runner(vin) if runner else run_target(target, vin, cache, aux_layer_ids)

    def extend(self, model: Eagle3Draft, ext: EagleDraftExtendInput, cache: KVCache,
               topk: int) -> EagleDraftInput:
        runner = self._runner("extend", model, cache, ext) if topk == self.tree.topk else None
        return runner(ext) if runner else extend(model, ext, cache, topk)

    def decode(self, target: TargetModel, token: torch.Tensor, seq_len: int, cache: KVCache
               ) -> torch.Tensor:
        runner = self._runner("decode", target, cache, (token, seq_len))
        return runner((token, seq_len)) if runner else decode(target, token, seq_len, cache)

    def phases(self, mode: GraphMode) -> Phases:
        return Phases(self.draft, self.run_target, self.extend, self.decode, self.draft_cache,
                      mode)


def phases_for(target: TargetModel, target_cache: KVCache, draft_model: Eagle3Draft | None,
               tree: TreeParams, mode: GraphMode, max_len: int) -> Phases:
    """What a request with this head and tree writing `target_cache` runs in `mode`: the eager
    functions, or runners built on that cache (captured now with GRAPHS, after loading, so the
    draft's embedding and lm_head are bound to their final weights). A failed capture falls
    back to eager with a warning."""
    if mode is GraphMode.EAGER:
        return EAGER_PHASES
    phases = GraphPhases(target, target_cache, draft_model, tree,
                         max_len + tree.topk * tree.num_steps)  # scratch rows past max_len
    if mode is GraphMode.GRAPHS:
        try:
            phases.capture()
        except RuntimeError as e:  # out of memory, or an op that cannot be captured
            log.warning("CUDA graph capture failed, running eagerly (--no-cuda-graphs skips "
                        "capture): %s", e)
            return EAGER_PHASES
    return phases.phases(mode)
