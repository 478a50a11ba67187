"""The engine: loads a target with its EAGLE-3 heads and sequences the phases of one request.

    prefill -> first event -> read_prompt (the context's suffix index, the head's extend)
            -> [ draft (+ the context's chain) -> build_tree -> verify -> accept -> commit
                 -> read_back -> extend ]*

`stream()` is the one loop; it yields a `StepEvent` per iteration (or per token in baseline
mode) and `generate()` consumes it. An iteration syncs with the device once: `read_back` copies
the emitted tokens, the accepted path and the traced tree to the host in one packed copy, and
the events are built from it (a baseline step reads its one token). A request prefills into
caches owned by the engine (or, under the scheduler, by the request), after restoring the rows
its prompt shares with an earlier request from the prefix cache (`prefix_cache.py`, when
`EngineConfig.prefix_cache_mb` > 0); only a request that ends cleanly (finished, or stopped
between steps under the scheduler) leaves rows there, so a failed request never changes the
next answer.
`Run` holds one request's state and the per-request halves of each phase; `stream` sequences
them for one request, `scheduler.py` for several at once.
Not here: tensor math of the phases (draft/tree/verify/accept modules) or UI concerns.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .accept import commit, extend_input, read_back
from .chat import IncrementalDetokenizer, encode_chat, stop_token_ids
from .config import ConfigError, EngineConfig, SamplingParams, TreeParams, parse_dtype
from .context_draft import ContextIndex
from .cuda_graph import EAGER_PHASES, Phases, phases_for
from .events import RunStats, StepEvent, TokenSpan, TreeNode
from .io_struct import (DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput,
                        EagleVerifyOutput, NodeSource, VerifyReadback)
from .kernels.cpu_lowbit import load as load_cpu_kernels
from .kv_cache import KVCache, causal_mask
from .models.cpu_lowbit import quantize_head, quantize_target
from .models.cpu_pack import can_pack, pack_linears
from .models.draft_io import load_draft
from .models.draft_model import Eagle3Draft
from .models.loader import load_target, load_tokenizer, resolve_target
from .models.target import TargetModel
from .prefix_cache import PrefixCache
from .sampling import next_token
from .tree import tree_input
from .verify import TreeLogits, greedy_acceptance, sampled_acceptance

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
                 config: EngineConfig) -> None:
        self.target, self.tokenizer, self.heads, self.config = target, tokenizer, heads, config
        self.cache = target.new_cache(max_len=config.max_len)
        self.prefix_cache = PrefixCache(config.prefix_cache_mb * 2 ** 20)
        self.eos_ids = stop_token_ids(target.cfg.eos_token_ids, tokenizer)
        self.load_times: dict[str, float] = {}
        self.default_tree = config.default_tree  # the tree `autotune` chose, after `apply`
        self.tuned = None  # autotune.Tuned once measured or read from the cache
        self._phases: dict[tuple[str | None, TreeParams | None], Phases] = {}

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

    def phases(self, head: str | None, tree: TreeParams) -> Phases:
        """Phase callables for a request: CUDA-graph replays on CUDA (captured on first use of
        a head and tree shape) unless `config.cuda_graphs` is off; the eager functions on CPU."""
        key = (head, tree if head else None)
        if key not in self._phases:
            self._phases[key] = phases_for(self.target, self.cache, self.heads.get(head), tree,
                                           self.config)
        return self._phases[key]

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

    def check_request(self, prompt_ids: list[int], tree: TreeParams | None,
                      head: str | None) -> None:
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if head is not None and head not in self.heads:
            raise ConfigError(f"unknown draft head {head!r}; loaded: {sorted(self.heads)}")
        room = self.config.max_len - (tree.max_rows if tree and head else 1)
        if len(prompt_ids) >= room:
            raise ConfigError(f"prompt has {len(prompt_ids)} tokens but the context window is "
                              f"{self.config.max_len} (room for at most {room - 1} prompt tokens)")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.cfg.vocab_size]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary "
                              f"(size {self.target.cfg.vocab_size})")

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams,
               tree: TreeParams | None = None, head: str | None = None,
               trace: bool = True) -> Iterator[StepEvent]:
        """Yield one event per iteration. `head=None` runs the baseline (target only); `tree`
        defaults to `self.default_tree` (the tree chosen for the target's weights).
        `trace` adds the verified tree and the rejected drafts (for the UI) to each event.
        Run time in the stats is the engine's own: time the caller holds an event (a UI drawing
        a frame) is not counted, so tokens/s and speedups do not depend on the consumer."""
        tree = tree or self.default_tree
        self.check_request(prompt_ids, tree, head)
        run = Run(self, prompt_ids, params, tree, head, trace, self.cache)
        for ev in run.loop():
            handed_over = time.perf_counter()
            yield ev
            run.t_start += time.perf_counter() - handed_over


class Run:
    """State of one request: its caches, stats, detokenizer, generator and every token it
    produced; the per-request halves of each phase (`prefill`, `read_prompt`, `accept`,
    `after_readback`, `iteration_event`, `keep_prefix`) and `loop`, which sequences them for
    `stream`.
    `cache` is the target cache it writes (the engine's for `stream`, its own under the
    scheduler); the draft cache is its own, sized like `cache` plus the draft's scratch rows
    (`eager`: always, with the eager phases; else CUDA-graph phases bring theirs)."""

    def __init__(self, engine: EagleEngine, prompt_ids: list[int], params: SamplingParams,
                 tree: TreeParams, head: str | None, trace: bool, cache: KVCache,
                 eager: bool = False) -> None:
        self.e, self.prompt, self.params, self.tree = engine, prompt_ids, params, tree
        self.trace, self.head, self.cache = trace, head, cache
        self.draft_model = engine.heads[head] if head else None
        self.aux_ids: tuple[int, ...] = ()
        if self.draft_model is not None and self.draft_model.cfg.use_aux_hidden_state:
            self.aux_ids = self.draft_model.cfg.resolve_aux_layer_ids(engine.target.cfg)
        dev = engine.target.device
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=dev).manual_seed(params.seed)
        self.detok = IncrementalDetokenizer(engine.tokenizer, params.stop)
        # per depth up to num_steps, grown when a chain from the context is accepted deeper
        self.stats = RunStats(accepted_per_depth=[0] * tree.num_steps)
        self.context: ContextIndex | None = None  # the suffix index, with context drafts
        self.phases = EAGER_PHASES if eager else engine.phases(head, tree)
        self.draft_cache = self.phases.draft_cache
        if self.draft_model is not None and self.draft_cache is None:  # tree scratch past max_len
            self.draft_cache = self.draft_model.new_cache(
                cache.max_len + tree.topk * tree.num_steps)
        self.tokens = list(prompt_ids)  # the prompt and every token generated (past a stop too)
        self.draft_rows = 0  # draft cache rows holding committed tokens
        self.t_start = time.perf_counter()
        self.step = 0

    def _features(self, out) -> torch.Tensor:
        return out.aux_hidden if self.aux_ids else out.final_hidden

    def _emit(self, tokens: list[int], kinds: list[str], depths: list[int],
              sources: list[str] | None = None) -> tuple[list[TokenSpan], str | None]:
        """Apply stop rules to emitted tokens; returns kept spans and a finish reason."""
        self.tokens += tokens
        spans, finished = [], None
        for tok, kind, depth, source in zip(tokens, kinds, depths, sources or [""] * len(tokens)):
            if tok in self.e.eos_ids and not self.params.ignore_eos:
                finished = "eos"
                break
            spans.append(TokenSpan(tok, self.detok.add([tok]), kind, depth, source))
            self.stats.num_tokens += 1
            if self.detok.stopped:
                finished = "stop"
                break
            if self.stats.num_tokens >= self.params.max_new_tokens:
                finished = "length"
                break
        if finished and spans:
            spans[-1].text += self.detok.flush()
        return spans, finished

    def event(self, spans: list[TokenSpan], finished: str | None, timings: dict[str, float],
              **extra) -> StepEvent:
        self.stats.elapsed_s = time.perf_counter() - self.t_start
        for k, v in timings.items():
            self.stats.phase_s[k] = self.stats.phase_s.get(k, 0.0) + v / 1000
        # text held back for a possible stop string belongs to earlier spans; release it when the
        # run ends (EOS or the context limit can end it with no span this step to carry it)
        tail = self.detok.flush() if finished else ""
        ev = StepEvent(step=self.step, mode="eagle" if self.draft_model else "ar", tokens=spans,
                       text="".join(s.text for s in spans) + tail, timings_ms=timings,
                       stats=self.stats.to_dict(), finished=finished, **extra)
        self.step += 1
        return ev

    def prefill(self) -> tuple[torch.Tensor, EagleDraftExtendInput]:
        """-> (the first generated token [1], on the device; the draft extend's input after the
        prompt: its tokens shifted by one, that token last, with the prompt's features).
        Rows the prompt shares with an earlier request come from the prefix cache; the target
        runs from the first row not restored."""
        target, dev = self.e.target, self.e.target.device
        n = len(self.prompt)
        hit = self.e.prefix_cache.lookup(self.prompt, self.head)
        r = hit.rows if hit else 0
        if hit:
            self.e.prefix_cache.restore(hit, self.cache, self.draft_cache)
        self.stats.reused_tokens = r
        ids = torch.tensor(self.prompt[r:], device=dev)  # [n - r]
        out = target(ids[None], torch.arange(r, n, device=dev)[None], self.cache, r,
                     causal_mask(n - r, r, dev), self.aux_ids, last_only=True)
        root = next_token(out.logits[0, -1:], self.params, self.generator)  # [1]
        return root, EagleDraftExtendInput(torch.cat([ids[1:], root]), self._features(out)[0], r)

    def after_prefill(self, root: int) -> tuple[list[TokenSpan], str | None]:
        spans, finished = self._emit([root], ["target"], [0])
        self.stats.prefill_s = time.perf_counter() - self.t_start
        return spans, finished

    def read_prompt(self, ext: EagleDraftExtendInput) -> EagleDraftInput:
        """Once the first token is out: the context's suffix index over the prompt and that
        token (with context drafts), and the head's draft extend over the prompt -> the first
        draft's input. Also after a one-token answer, so that the prefix cache keeps the
        head's rows for the next turn."""
        if self.tree.context_drafts:
            self.context = ContextIndex(self.tokens)
        state = self.phases.extend(self.draft_model, ext, self.draft_cache, self.tree.topk)
        self.draft_rows = state.seq_len
        return state

    def context_full(self, seq_len: int) -> bool:
        """Whether the next step would write past the context window."""
        width = self.tree.max_rows if self.draft_model else 1
        return seq_len + width + (1 if self.draft_model else 0) > self.e.config.max_len

    def keep_prefix(self) -> None:
        """Leave this request's committed rows in the prefix cache (after a clean end)."""
        rows = len(self.tokens) - 1  # the last token produced is in no cache yet
        self.e.prefix_cache.store(self.tokens[:rows], self.cache, self.head, self.draft_cache,
                                  self.draft_rows)

    def loop(self) -> Iterator[StepEvent]:
        """The request alone: yields its events, then keeps its prefix. A generator closed
        early keeps nothing: its close may run on another thread while the engine's cache
        already holds the next request (the scheduler, which owns each request's caches, keeps
        a stopped request's prefix)."""
        yield from self._loop()
        self.keep_prefix()

    def _loop(self) -> Iterator[StepEvent]:
        root, ext = self.prefill()
        spans, finished = self.after_prefill(int(root))
        if self.draft_model is None:
            yield from self._baseline(root, spans, finished)
            return
        yield self.event(spans, finished, {"prefill": self.stats.prefill_s * 1000})
        state = self.read_prompt(ext)
        while not finished:
            if self.context_full(state.seq_len):
                yield self.event([], "context", {})
                return
            state, ev = self._iteration(state)
            finished = ev.finished
            yield ev

    def accept(self, vin: EagleVerifyInput, tl: TreeLogits) -> EagleVerifyOutput:
        """Acceptance on the device and the KV commit of the accepted path."""
        if self.params.greedy:
            vout = greedy_acceptance(vin, tl.logits)
        else:
            vout = sampled_acceptance(vin, tl.logits, self.params, self.generator)
        commit(vin, vout, self.cache)
        return vout

    def after_readback(self, got: VerifyReadback, vin: EagleVerifyInput,
                       vout: EagleVerifyOutput, tl: TreeLogits
                       ) -> tuple[list[TokenSpan], str | None, EagleDraftExtendInput | None]:
        """Stats and stop rules for an iteration's read-back -> (spans, finish reason, the draft
        extend's input, None when finished)."""
        n_acc = got.num_accepted
        if self.context is not None:
            self.context.extend(got.emitted)
        self.stats.num_steps += 1
        self.stats.step_tokens += n_acc + 1
        depths = self.stats.accepted_per_depth
        depths += [0] * (n_acc - len(depths))
        for d in range(n_acc):
            depths[d] += 1
        sources = [NodeSource(s) for s in got.accepted_sources[1:]]
        kinds = ["context" if s is NodeSource.CONTEXT else "accepted" for s in sources]
        self.stats.context_tokens += kinds.count("context")
        spans, finished = self._emit(got.emitted, kinds + ["bonus"],
                                     list(range(1, n_acc + 1)) + [0],
                                     [s.label for s in sources] + [""])
        ext = None if finished else extend_input(vin, vout, n_acc, tl.features)
        return spans, finished, ext

    def after_decode(self, token: int) -> tuple[list[TokenSpan], str | None]:
        """Stats and stop rules for a plain decode step's token."""
        self.stats.num_steps += 1
        self.stats.step_tokens += 1
        return self._emit([token], ["target"], [0])

    def iteration_event(self, got: VerifyReadback, spans: list[TokenSpan],
                        finished: str | None, timings: dict[str, float],
                        **extra) -> StepEvent:
        detail = {"rejected": self._rejected(got), "tree": self._tree_nodes(got)
                  } if self.trace else {}
        return self.event(spans, finished, timings, **detail, **extra)

    def tree_input(self, drafted: DraftTree, state: EagleDraftInput) -> EagleVerifyInput:
        """The head's candidates, with the context's chain merged in when there is one, as the
        tree to verify."""
        ctx = self.context.propose(self.tree.chain_len) if self.context else None
        return tree_input(drafted, ctx, state.root, state.seq_len, self.tree)

    def _iteration(self, state: EagleDraftInput) -> tuple[EagleDraftInput, StepEvent]:
        t0 = time.perf_counter()
        drafted = self.phases.draft(self.draft_model, state, self.draft_cache, self.tree)
        vin = self.tree_input(drafted, state)
        t1 = time.perf_counter()
        tl = self.phases.run_target(self.e.target, vin, self.cache, self.aux_ids)
        vout = self.accept(vin, tl)
        got = read_back(vin, vout, self.trace)  # the one host sync: waits for the device
        t2 = time.perf_counter()
        spans, finished, ext = self.after_readback(got, vin, vout, tl)
        new_state = state
        if ext is not None:
            new_state = self.phases.extend(self.draft_model, ext, self.draft_cache,
                                           self.tree.topk)
            self.draft_rows = new_state.seq_len
        t3 = time.perf_counter()
        timings = {"draft": (t1 - t0) * 1000, "verify": (t2 - t1) * 1000,
                   "extend": (t3 - t2) * 1000}
        return new_state, self.iteration_event(got, spans, finished, timings)

    def _token_text(self, tok: int) -> str:
        return self.e.tokenizer.decode([tok])

    def _rejected(self, got: VerifyReadback) -> list[TokenSpan]:
        """The draft's own best continuation below the last accepted node (first children)."""
        parents, tokens = got.tree_parents, got.tree_tokens
        node, out = got.accepted_nodes[-1], []
        while True:
            children = [c for c in range(len(parents)) if parents[c] == node]
            if not children:
                return out
            node = children[0]
            out.append(TokenSpan(tokens[node], self._token_text(tokens[node]), "rejected",
                                 got.tree_depth[node], NodeSource(got.tree_sources[node]).label))

    def _tree_nodes(self, got: VerifyReadback) -> list[TreeNode]:
        on_path = set(got.accepted_nodes)
        return [TreeNode(t, self._token_text(t), p, d, i in on_path, s, NodeSource(src).label)
                for i, (t, p, d, s, src) in enumerate(zip(
                    got.tree_tokens, got.tree_parents, got.tree_depth, got.tree_scores,
                    got.tree_sources))]

    def _baseline(self, root: torch.Tensor, spans: list[TokenSpan], finished: str | None
                  ) -> Iterator[StepEvent]:
        """root [1]: the prefill's token, on the device. One host read per token: its id."""
        target = self.e.target
        yield self.event(spans, finished, {"prefill": self.stats.prefill_s * 1000})
        seq, tok = len(self.prompt), root
        while not finished:
            if self.context_full(seq):
                yield self.event([], "context", {})
                return
            t0 = time.perf_counter()
            logits = self.phases.decode(target, tok, seq, self.cache)  # [1, V]
            tok = next_token(logits, self.params, self.generator)  # [1]
            seq += 1
            spans, finished = self.after_decode(int(tok))
            yield self.event(spans, finished, {"decode": (time.perf_counter() - t0) * 1000})
