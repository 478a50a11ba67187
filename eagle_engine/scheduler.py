"""The scheduler: steps up to `EngineConfig.max_batch` requests together, EAGLE-3 and plain
ones alike, so a visitor's answer no longer waits for the answers queued before it.

One `step`:

    leave    cancelled requests leave (their committed rows go to the prefix cache)
    admit    waiting requests join while there is room: each prefills alone (restoring what the
             prefix cache holds of its prompt)
    context  a request whose next step would pass the context window ends ("context")
    draft    per head, one draft forward per tree level over every EAGLE-3 request's frontier
    verify   one target forward over every running request's rows: its tree, or its one token
             for a plain request, on its own cache rows, positions and mask
    accept   per request, on the device (greedy, or sampling with the request's own generator),
             then the KV commit of its accepted path
    read     the step's one host read: a single packed copy of every request's results
             (and the first token of every request admitted in this step, which goes out at
             once)
    extend   per head, one draft forward over every continuing request's accepted tokens
    emit     an event per request (`StepEvent.batch`: how many requests shared the step);
             finished requests leave, leaving their rows in the prefix cache
    prompts  each EAGLE-3 request admitted in this step reads its prompt, alone, now that its
             first token is out: the context's suffix index and its head's draft extend

Requests join and leave only between steps. Each owns its caches, sized to what it can use
(its prompt, `max_new_tokens` and its tree, at most the context window), and the batched
forwards (`batch_phases.py`, `models/batched.py`) give every request the numbers it gets alone:
greedy output equals the request run alone, and a sampled request draws the same coins from its
own generator, so sampling stays lossless (and reproducible under a seed). A request whose
admission fails gets its error alone; an error in a shared phase fails the requests of that
step, whose caches are dropped, and the scheduler takes the next requests as before.
A request's time (`RunStats.elapsed_s`) runs from its admission: a shared step counts whole
for each request in it, and, as the scheduler never waits for a caller, the time a visitor's
frames take on the same cores is in it too.
Threads: `submit` and `Handle.cancel` may be called from any thread; steps run on one engine
thread: the `executor` given (the app's `EngineThread`), or the caller of `step` /
`run_until_idle`. Without CUDA graphs: the batched phases run eagerly.
Not here: the phases' math (`batch_phases.py`, draft/tree/verify/accept) or the UI.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from .accept import parse_readback, readback_parts
from .batch_phases import decode_rows, draft_many, extend_many, target_many, tree_rows
from .config import ConfigError, SamplingParams, TreeParams
from .engine import EagleEngine, Run
from .events import StepEvent
from .io_struct import (EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput,
                        EagleVerifyOutput, VerifyReadback)
from .sampling import next_token
from .verify import TreeLogits

log = logging.getLogger(__name__)
_END = object()  # a handle's last queue item after a clean end


class Handle:
    """A submitted request as its caller sees it: `events()` yields its events in order, then
    ends (or raises the error that ended it); `cancel()` makes it leave before the next step."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()

    def events(self) -> Iterator[StepEvent]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, item: StepEvent | BaseException | object) -> None:
        self._queue.put(item)


@dataclass(slots=True)
class _Pending:
    handle: Handle
    prompt: list[int]
    params: SamplingParams
    tree: TreeParams
    head: str | None
    trace: bool


@dataclass(slots=True, eq=False)  # compared by identity
class _Active:
    """A running request: its `Run` and where its decoding stands."""

    handle: Handle
    run: Run
    seq_len: int  # committed target rows
    state: EagleDraftInput | None = None  # EAGLE-3: the next draft's input
    token: torch.Tensor | None = None  # plain decoding: the last token [1], not yet in the cache
    root: torch.Tensor | None = None  # admitted this step: its first token [1], not yet read
    ext: EagleDraftExtendInput | None = None  # admitted this step: its head's prompt extend


@dataclass(slots=True, eq=False)
class _Iteration:
    """One EAGLE-3 request's share of a step, between verify and emit."""

    req: _Active
    vin: EagleVerifyInput
    tl: TreeLogits | None = None
    vout: EagleVerifyOutput | None = None
    got: VerifyReadback | None = None
    read_size: int = 0  # values of the step's packed read that are this request's


@dataclass(slots=True)
class _Step:
    """What one step read and timed, for the events."""

    timings: dict[str, float] = field(default_factory=dict)
    batch: int = 0


class Scheduler:
    def __init__(self, engine: EagleEngine, max_batch: int | None = None,
                 executor: Executor | None = None) -> None:
        self.engine = engine
        self.max_batch = engine.config.max_batch if max_batch is None else max_batch
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        self.executor = executor
        self._lock = threading.Lock()
        self._waiting: deque[_Pending] = deque()
        self._active: list[_Active] = []
        self._ticking = False  # a `_tick` is queued on the executor or running
        self.steps = 0

    # ----- any thread -----
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               tree: TreeParams | None = None, head: str | None = None,
               trace: bool = True) -> Handle:
        """Queue a request (checked now: a bad one raises `ConfigError` here). With an
        executor, steps start on it as needed."""
        tree = tree or self.engine.default_tree
        self.engine.check_request(prompt_ids, tree, head)
        handle = Handle()
        with self._lock:
            self._waiting.append(_Pending(handle, list(prompt_ids), params, tree, head, trace))
            start = self.executor is not None and not self._ticking
            self._ticking = self._ticking or start
        if start:
            self.executor.submit(self._tick)
        return handle

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active)

    # ----- the engine thread -----
    def _tick(self) -> None:
        """One step, then queue the next while there is work (other work queued on the same
        executor runs in between). An error outside a step's shared phases (those fail only
        their requests) ends every running request, so the scheduler never stalls."""
        try:
            self.step()
        except Exception as e:  # noqa: BLE001 - reported to every running request
            log.exception("a scheduler step failed; %d running requests end with the error",
                          len(self._active))
            for req in self._active:
                req.handle.put(e)
            self._active.clear()
        with self._lock:
            self._ticking = bool(self._waiting or self._active)
            again = self._ticking
        if again:
            self.executor.submit(self._tick)

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    @torch.inference_mode()
    def step(self) -> None:
        self._leave_cancelled()
        admitted = self._admit()
        running = [r for r in self._active if r not in admitted]
        step = _Step(batch=len(self._active))
        running = self._end_at_context(running, step)
        if not running and not admitted:
            return
        try:
            self._iterate(running, admitted, step)
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the engine goes on
            log.exception("a batched step failed; its %d requests end with the error",
                          len(running) + len(admitted))
            for req in running + admitted:
                if req in self._active:  # not yet finished when the error came
                    self._active.remove(req)
                    req.handle.put(e)
        self.steps += 1

    def _leave_cancelled(self) -> None:
        for req in [r for r in self._active if r.handle.cancelled]:
            self._active.remove(req)
            req.run.keep_prefix()
            req.handle.put(_END)
        with self._lock:
            kept = [p for p in self._waiting if not p.handle.cancelled]
            for p in self._waiting:
                if p.handle.cancelled:
                    p.handle.put(_END)
            self._waiting = deque(kept)

    def _admit(self) -> list[_Active]:
        """Prefill waiting requests while there is room; their first tokens are read with the
        step's results."""
        admitted = []
        while len(self._active) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    break
                p = self._waiting.popleft()
            try:
                admitted.append(self._start(p))
                self._active.append(admitted[-1])
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("a request failed at admission")
                p.handle.put(e)
        return admitted

    def _start(self, p: _Pending) -> _Active:
        e = self.engine
        n = len(p.prompt)
        width = p.tree.max_rows if p.head else 1
        capacity = min(e.config.max_len, n + p.params.max_new_tokens + width + 2)
        run = Run(e, p.prompt, p.params, p.tree, p.head, p.trace,
                  e.target.new_cache(max_len=capacity), eager=True)
        root, ext = run.prefill()
        req = _Active(p.handle, run, n, root=root)
        if run.draft_model is not None:
            req.ext = ext  # run once the step's tokens are out (`_extend_prompts`)
        else:
            req.token = root
        return req

    def _end_at_context(self, running: list[_Active], step: _Step) -> list[_Active]:
        going = []
        for req in running:
            if req.run.context_full(req.seq_len):
                self._finish(req, req.run.event([], "context", {}, batch=step.batch))
            else:
                going.append(req)
        return going

    def _iterate(self, running: list[_Active], admitted: list[_Active], step: _Step) -> None:
        t0 = time.perf_counter()
        e = self.engine
        eagle = [_Iteration(r, None) for r in running if r.state is not None]
        plain = [r for r in running if r.state is None]
        for model, group in self._by_head(eagle):
            drafted = draft_many(model, [it.req.state for it in group],
                                 [it.req.run.draft_cache for it in group],
                                 [it.req.run.tree for it in group])
            for it, d in zip(group, drafted):
                it.vin = it.req.run.tree_input(d, it.req.state)
        t1 = time.perf_counter()
        rows = ([tree_rows(it.vin, it.req.run.cache) for it in eagle]
                + [decode_rows(r.token, r.seq_len, r.run.cache) for r in plain])
        outs = target_many(e.target, rows, [it.req.run.aux_ids for it in eagle]
                           + [() for _ in plain]) if rows else []
        parts: list[torch.Tensor] = [r.root.double() for r in admitted]
        for it, tl in zip(eagle, outs):
            it.tl = tl
            it.vout = it.req.run.accept(it.vin, tl)
            own = readback_parts(it.vin, it.vout, it.req.run.trace)
            it.read_size = sum(p.numel() for p in own)
            parts += own
        for r, tl in zip(plain, outs[len(eagle):]):
            r.token = next_token(tl.logits[-1:], r.run.params, r.run.generator)  # [1]
            parts.append(r.token.double())
        flat = torch.cat(parts).tolist()  # the step's one host sync
        t2 = time.perf_counter()
        firsts = self._read_admitted(admitted, flat, step)
        at = len(firsts)
        for it in eagle:
            it.got = parse_readback(flat[at:at + it.read_size], it.vin, it.vout,
                                    it.req.run.trace)
            at += it.read_size
        step.timings = {"draft": (t1 - t0) * 1000, "verify": (t2 - t1) * 1000}
        self._finish_eagle(eagle, step)
        t3 = time.perf_counter()
        for r, tok in zip(plain, flat[at:]):
            r.seq_len += 1
            spans, finished = r.run.after_decode(int(tok))
            ev = r.run.event(spans, finished, {"decode": (t3 - t0) * 1000}, batch=step.batch)
            self._deliver(r, ev)
        self._extend_prompts(admitted, firsts)

    def _read_admitted(self, admitted: list[_Active], flat: list[float], step: _Step
                       ) -> list[StepEvent]:
        """Every admitted request's first token goes out at once -> their first events."""
        events = []
        for req, root in zip(admitted, flat):
            req.root = None
            spans, finished = req.run.after_prefill(int(root))
            events.append(req.run.event(spans, finished,
                                        {"prefill": req.run.stats.prefill_s * 1000},
                                        batch=step.batch))
            req.handle.put(events[-1])
        return events

    def _extend_prompts(self, admitted: list[_Active], firsts: list[StepEvent]) -> None:
        """Once every token of the step is out, each admitted EAGLE-3 request reads its prompt
        (`Run.read_prompt`); a request that ended at its first token then leaves."""
        for req, ev in zip(admitted, firsts):
            if req.ext is not None:
                req.state, req.ext = req.run.read_prompt(req.ext), None
            if ev.finished:
                self._finish(req, None)

    def _finish_eagle(self, eagle: list[_Iteration], step: _Step) -> None:
        """Stop rules, then one batched draft extend per head for the requests going on."""
        t2 = time.perf_counter()
        results = []
        for it in eagle:
            spans, finished, ext = it.req.run.after_readback(it.got, it.vin, it.vout, it.tl)
            it.req.seq_len = it.vin.seq_len + it.got.num_accepted + 1
            results.append((spans, finished, ext))
        going = [(it, ext) for it, (_, _, ext) in zip(eagle, results) if ext is not None]
        for model, group in self._by_head([it for it, _ in going]):
            exts = [ext for it, ext in going if it in group]
            states = extend_many(model, exts, [it.req.run.draft_cache for it in group],
                                 [it.req.run.tree.topk for it in group])
            for it, state in zip(group, states):
                it.req.state = state
                it.req.run.draft_rows = state.seq_len
        timings = {**step.timings, "extend": (time.perf_counter() - t2) * 1000}
        for it, (spans, finished, _) in zip(eagle, results):
            self._deliver(it.req, it.req.run.iteration_event(it.got, spans, finished, timings,
                                                             batch=step.batch))

    @staticmethod
    def _by_head(items: list[_Iteration]) -> list[tuple[object, list[_Iteration]]]:
        groups: dict[str, list[_Iteration]] = {}
        for it in items:
            groups.setdefault(it.req.run.head, []).append(it)
        return [(g[0].req.run.draft_model, g) for g in groups.values()]

    def _deliver(self, req: _Active, ev: StepEvent) -> None:
        req.handle.put(ev)
        if ev.finished:
            self._finish(req, None)

    def _finish(self, req: _Active, ev: StepEvent | None) -> None:
        if ev is not None:
            req.handle.put(ev)
        self._active.remove(req)
        req.run.keep_prefix()
        req.handle.put(_END)
