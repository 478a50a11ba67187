"""The engine: loads a target with its EAGLE-3 heads and answers requests through its scheduler.

Every request, alone or among others, runs through `scheduler.Scheduler`, the engine's one
loop (`stream` and `generate` submit to the engine's own scheduler and step it on the caller's
thread; the app steps one on its engine thread):

    prefill -> first event -> read_prompt (the context's suffix index, the head's extend)
            -> [ draft (+ the context's chain) -> tree -> verify -> accept -> commit
                 -> read back -> extend ]*

Each scheduler holds its phase backend (`cuda_graph.phases_for`): CUDA-graph replays on CUDA
(`cuda_graph.GraphPhases`), the eager phases elsewhere (`batch_phases.EagerPhases`).
Not here: the loop (`scheduler.py`), one request's state (`run.py`), the phases' tensor math
(draft/tree/verify/accept modules) or UI concerns.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .chat import encode_chat, stop_token_ids
from .config import EngineConfig, SamplingParams, TreeParams, parse_dtype
from .cpu_share import ThreadGovernor
from . import cuda_graph
from .cuda_graph import GraphMode
from .events import RunStats, StepEvent
from .kernels import StepOps, step_ops
from .kernels.cpu_lowbit import load as load_cpu_kernels
from .models.cpu_lowbit import quantize_head, quantize_target
from .models.cpu_pack import can_pack, pack_linears
from .models.draft_io import load_draft
from .models.draft_model import Eagle3Draft
from .models.loader import load_target, load_tokenizer, resolve_target
from .models.target import TargetModel
from .parts import EngineParts
from .prefix_cache import PrefixCache
from .scheduler import Scheduler

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "heads"
DEFAULT_HEAD = "eagle3-aux-1layer"


@dataclass(frozen=True)
class HeadInfo:
    name: str
    num_layers: int
    use_aux: bool
    draft_vocab_size: int


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finished: str
    stats: RunStats
    events: list[StepEvent] = field(default_factory=list)


def head_source(spec: str) -> Path | str:
    """A head spec -> a bundled head's directory (by name), a local path, or the spec as given
    (a hub id)."""
    path = ASSETS / spec if (ASSETS / spec / "config.json").is_file() else Path(spec)
    return path if path.exists() else spec


def head_name(spec: str) -> str:
    """The name a head loaded from `spec` gets in `EagleEngine.heads`: its directory's name, or
    the spec itself for a hub id."""
    source = head_source(spec)
    return source.name if isinstance(source, Path) else spec


def bundled_head_dirs() -> list[Path]:
    return sorted(p for p in ASSETS.glob("*") if (p / "config.json").is_file())


def load_heads(config: EngineConfig, target: TargetModel, dtype: torch.dtype
               ) -> dict[str, Eagle3Draft]:
    """`config.drafts` loaded for `target` ("bundled": every bundled head, for the bundled
    target only), keyed by `head_name`."""
    specs = [str(p) for p in bundled_head_dirs()] if config.drafts == ("bundled",) else list(
        config.drafts)
    if config.drafts == ("bundled",) and config.target != "bundled":
        specs = []
    return {head_name(spec): load_draft(head_source(spec), target.cfg, target.embed_tokens,
                                        target.lm_head, config.max_len + 512, dtype,
                                        config.device, config.allow_pickle)
            for spec in specs}


class EagleEngine:
    def __init__(self, target: TargetModel, tokenizer: object, heads: dict[str, Eagle3Draft],
                 config: EngineConfig, graph_mode: GraphMode | None = None) -> None:
        """`graph_mode`: the phase backend's mode (default: `cuda_graph.graph_mode` of the
        config on the target's device; STATIC runs the graphed path without capture, on a
        CPU too)."""
        self.target, self.tokenizer, self.heads, self.config = target, tokenizer, heads, config
        self.graph_mode = graph_mode or cuda_graph.graph_mode(config.cuda_graphs, target.device)
        self.load_times: dict[str, float] = {}
        self.tuned = None  # autotune.Tuned once measured or read from the cache
        # the step backend: C++ ops with q4 weights (their load built the module), Triton on
        # CUDA, the torch definitions elsewhere
        self.parts = EngineParts(target, heads, tokenizer,
                                 stop_token_ids(target.cfg.eos_token_ids, tokenizer),
                                 step_ops(target.device, config.weights == "q4"),
                                 PrefixCache(config.prefix_cache_mb * 2 ** 20), config.max_len,
                                 config.default_tree)
        self.scheduler = self.new_scheduler()  # `stream` steps it on the caller's thread

    def new_scheduler(self, max_batch: int | None = None, executor: Executor | None = None
                      ) -> Scheduler:
        """A scheduler over this engine's parts with a phase backend of its own (its own
        caches and graphs) for `max_batch` requests (default `config.max_batch`). The engine's
        own is `scheduler`; the app steps that one."""
        max_batch = self.config.max_batch if max_batch is None else max_batch
        phases = cuda_graph.phases_for(self.target, self.heads, self.config.max_len, max_batch,
                                       self.graph_mode)
        governor = (ThreadGovernor(torch.get_num_threads())
                    if self.config.adapt_threads and self.target.device.type == "cpu" else None)
        return Scheduler(self.parts, phases, max_batch, executor, governor)

    @property
    def default_tree(self) -> TreeParams:
        """A request's tree when it names none: the config's, or the one `autotune` chose."""
        return self.parts.default_tree

    @default_tree.setter
    def default_tree(self, tree: TreeParams) -> None:
        self.parts.default_tree = tree

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.parts.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache) -> None:
        self.parts.prefix_cache = cache

    @property
    def ops(self) -> StepOps:
        return self.parts.ops

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.parts.eos_ids

    @classmethod
    def load(cls, config: EngineConfig, tokenizer: object | None = None) -> EagleEngine:
        """Target, tokenizer and heads for `config`. With q4 weights the target's linears
        become q4 / q8 codes and the heads' linears q8 codes (`models/cpu_lowbit.py`)."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1) as pool:
            # q4's C++ kernels build while the target converts and loads: at a first start each
            # takes ~30 s on 2 cores, and the build's compilers run in processes of their own
            kernels = pool.submit(load_cpu_kernels) if config.weights == "q4" else None
            directory = resolve_target(config.target)
            t1 = time.perf_counter()
            dtype = parse_dtype(config.dtype)
            target = load_target(directory, dtype, config.device, config.max_len)
            tokenizer = load_tokenizer(directory) if tokenizer is None else tokenizer
            heads = load_heads(config, target, dtype)
            if kernels is not None:
                kernels.result()
                log.info("q4 target weights: %s; heads' linears q8: %s", quantize_target(target),
                         [quantize_head(h) for h in heads.values()])
        if config.packed_weights and can_pack(config.device, dtype):
            for model in (target, *heads.values()):
                pack_linears(model)
        engine = cls(target, tokenizer, heads, config)
        engine.load_times = {"resolve_s": t1 - t0, "load_s": time.perf_counter() - t1}
        log.info("engine ready: target %s, heads %s, %.1fs", directory, list(heads),
                 time.perf_counter() - t0)
        return engine

    def head_info(self) -> list[HeadInfo]:
        return [HeadInfo(n, h.cfg.num_layers, h.cfg.use_aux_hidden_state, h.cfg.draft_vocab_size)
                for n, h in self.heads.items()]

    def warm_up(self, prompt_ids: list[int] | None = None) -> None:
        """Before serving: under CUDA graphs, capture every batch-size bucket of plain decoding
        and of each head's default tree (a failed capture raises `GraphCaptureError`); then one
        short answer a head (and one plain) to `prompt_ids` (default: a chat saying "Hi"), so
        no visitor's first answer pays a first use."""
        t0 = time.perf_counter()
        made = self.scheduler.phases.warm_up({h: self.default_tree for h in self.heads})
        if made:
            log.info("captured %d CUDA graphs in %.1f s (%.1f MiB)", len(made),
                     time.perf_counter() - t0, sum(r.bytes for r in made) / 2 ** 20)
        ids = self.encode("Hi") if prompt_ids is None else prompt_ids
        for head in [*self.heads, None]:
            self.generate(ids, SamplingParams(max_new_tokens=4), self.default_tree, head)

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return encode_chat(self.tokenizer, messages)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 tree: TreeParams | None = None, head: str | None = None,
                 keep_events: bool = False) -> GenerationResult:
        ids: list[int] = []
        text, events, last = "", [], None
        for ev in self.stream(prompt_ids, params, tree, head, trace=keep_events):
            ids += [t.token_id for t in ev.tokens]
            text += ev.text
            last = ev
            if keep_events:
                events.append(ev)
        stats = RunStats(**{k: v for k, v in last.stats.items() if k in RunStats.__slots__})
        return GenerationResult(text, ids, last.finished or "length", stats, events)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               tree: TreeParams | None = None, head: str | None = None,
               trace: bool = True) -> Iterator[StepEvent]:
        """Yield the request's events: one per iteration (or per token in baseline mode).
        `head=None` runs the baseline (target only); `tree` defaults to `self.default_tree` (the
        tree chosen for the target's weights). `trace` adds the verified tree and the rejected
        drafts (for the UI) to each event. The request goes through `self.scheduler`, stepped
        here on the caller's thread, with any other request streaming from it at the time.
        Run time in the stats is the engine's own: time the caller holds an event (a UI drawing
        a frame) is not counted, so tokens/s and speedups do not depend on the consumer. A
        generator closed early cancels its request, which leaves at the next step."""
        handle = self.scheduler.submit(prompt_ids, params, tree, head, trace)
        try:
            while (ev := handle.next_event(self.scheduler.step)) is not None:
                handed_over = time.perf_counter()
                yield ev
                handle.hold(time.perf_counter() - handed_over)
        finally:
            handle.cancel()
