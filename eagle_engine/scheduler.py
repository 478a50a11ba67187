"""The scheduler: the engine's one loop. It steps up to `EngineConfig.max_batch` requests
together, EAGLE-3 and plain ones alike, so a visitor's answer does not wait for the answers
queued before it; a single request (`EagleEngine.stream`, the CLI, `bench`, `tune`,
`selfcheck`) is a batch of one.

One `step`:

    leave    cancelled requests leave (their committed rows go to the prefix cache)
    prompts  each EAGLE-3 request admitted in the last step reads its prompt, alone, now that
             its first token is out: the context's suffix index and its head's draft extend
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

Which forward a phase runs is the phase backend's choice (`self.phases`, one per scheduler):
`batch_phases.EagerPhases` runs a request alone in its phase through its own phase function
(one C++ call for a q8 head's draft or extend on a CPU) and several requests through one
batched eager forward per phase; under CUDA graphs `cuda_graph.GraphPhases` replays one graph
per phase for every request it fits, padded to a batch-size bucket, and hands the rest to the
eager phases. The backend also leases each request its caches: sized to what it can use, or
under CUDA graphs (which bake cache addresses in) the rows of a slot in pools made once.
Requests join and leave only between steps. The batched
forwards (`batch_phases.py`, `models/batched.py`) read each weight once for all requests and
give every request its own numbers: with q4 weights the bits it gets alone, with dense weights
up to the rounding a matrix product may change with the rows beside it. Greedy output equals
the request run alone (tests/test_scheduler.py), and a sampled request draws the same coins
from its own generator, so sampling stays lossless (and reproducible under a seed). A request whose
admission fails gets its error alone; an error in a shared phase fails the requests of that
step, whose caches are dropped, and the scheduler takes the next requests as before.
A request's time (`RunStats.elapsed_s`) runs from its admission: a shared step counts whole
for each request in it, and, as the scheduler never waits for a caller, the time a visitor's
frames take on the same cores is in it too.
Threads: `submit` and `Handle.cancel` may be called from any thread; steps run on the
`executor` given (`step_on`: the app's `EngineThread`), or on the caller of `step` /
`run_until_idle`, as `EagleEngine.stream` does; steps never overlap. On a CPU each step runs on
the thread count its `cpu_share.ThreadGovernor` sets (one while other processes take the
cores), and marks its requests' figures as taken on a busy machine while it does.
The scheduler is given its parts (`parts.EngineParts`: models, tokenizer, step ops, prefix
cache, defaults) and its phase backend, never the engine; it does each request's work with the
models (prefill, the prompt's extend, tree input, acceptance and commit, the prefix cache) and
keeps its state in a `run.Run`.
Not here: the phases' math (`batch_phases.py`, draft/tree/verify/accept), stop rules and events
(`run.py`) or the UI.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from .accept import commit, extend, parse_readback, readback_parts
from .batch_phases import EagerPhases
from .config import ConfigError, SamplingParams, TreeParams
from .context_draft import ContextIndex
from .cpu_share import CpuClock, ThreadGovernor
from .events import StepEvent
from .io_struct import (DraftTree, EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput,
                        EagleVerifyOutput, VerifyReadback)
from .kv_cache import causal_mask
from .parts import EngineParts
from .run import Run
from .sampling import next_token
from .tree import tree_input
from .verify import TreeLogits, greedy_acceptance, sampled_acceptance

log = logging.getLogger(__name__)
_END = object()  # a handle's last queue item after a clean end


class Handle:
    """A submitted request as its caller sees it: `events()` yields its events in order, then
    ends (or raises the error that ended it); `cancel()` makes it leave before the next step."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self.run: Run | None = None  # set at admission

    def events(self) -> Iterator[StepEvent]:
        """The events as the scheduler's executor steps them (blocks between them)."""
        while (ev := self.next_event()) is not None:
            yield ev

    def next_event(self, step: Callable[[], None] | None = None) -> StepEvent | None:
        """The next event, None after a clean end (raises the error that ended the request).
        With `step` (the scheduler's, on the caller's thread), steps until one is there."""
        while step is not None and self._queue.empty():
            step()
        item = self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def hold(self, seconds: float) -> None:
        """The caller held the last event `seconds`: not the engine's time (stepped on the
        caller's thread, the request waited for it)."""
        if self.run is not None:
            self.run.t_start += seconds

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
    ext: EagleDraftExtendInput | None = None  # admitted: its head's prompt extend, not yet run
    ended: bool = False  # ended at its first token, leaves once its prompt is read


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
    """The loop over `parts` (the engine's models, caches and defaults) with its phase backend
    `phases` (`cuda_graph.phases_for`, made for `max_batch` requests)."""

    def __init__(self, parts: EngineParts, phases: EagerPhases, max_batch: int,
                 executor: Executor | None = None, governor: ThreadGovernor | None = None
                 ) -> None:
        """`governor`: the thread count under load (`cpu_share.ThreadGovernor`; None on a GPU,
        where the CPU's threads only launch work)."""
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.parts, self.phases, self.max_batch = parts, phases, max_batch
        self.executor, self.governor = executor, governor
        self._lock = threading.Lock()
        self._stepping = threading.Lock()  # held through a step
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
        tree = tree or self.parts.default_tree
        self.parts.check_request(prompt_ids, tree, head)
        handle = Handle()
        with self._lock:
            self._waiting.append(_Pending(handle, list(prompt_ids), params, tree, head, trace))
            start = self.executor is not None and not self._ticking
            self._ticking = self._ticking or start
        if start:
            self.executor.submit(self._tick)
        return handle

    def step_on(self, executor: Executor) -> None:
        """From now on, steps start on `executor` (the app's engine thread) as requests come.
        Requests a caller is stepping itself at the time (`EagleEngine.stream`) go on as they
        were: steps never overlap, whichever thread takes them."""
        with self._lock:
            self.executor = executor

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active)

    # ----- the engine thread -----
    def _tick(self) -> None:
        """One step, then queue the next while there is work (other work queued on the same
        executor runs in between)."""
        self.step()
        with self._lock:
            self._ticking = bool(self._waiting or self._active)
            again = self._ticking
        if again:
            self.executor.submit(self._tick)

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    def step(self) -> None:
        """One step of every running request. An error outside a step's shared phases (those
        fail only their requests) ends every running request, so the scheduler never stalls.
        Steps never overlap: a caller stepping its own request (`EagleEngine.stream`) while the
        executor steps takes turns with it, each step serving every request."""
        with self._stepping:
            if self.governor is None:
                self._guarded_step()
                return
            self.governor.apply()
            if self.governor.thinned:  # its requests' figures are taken on a busy machine
                for req in self._active:
                    req.run.stats.thinned = True
            with CpuClock() as clock:
                self._guarded_step()
            self.governor.account(clock.reading)

    def _guarded_step(self) -> None:
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - reported to every running request
            log.exception("a scheduler step failed; %d running requests end with the error",
                          len(self._active))
            for req in list(self._active):
                self._leave(req, keep=False)
                req.handle.put(e)

    @torch.inference_mode()
    def _step(self) -> None:
        self._leave_cancelled()
        self._read_prompts()
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
                    self._leave(req, keep=False)
                    req.handle.put(e)
        self.steps += 1

    def _leave_cancelled(self) -> None:
        for req in [r for r in self._active if r.handle.cancelled]:
            self._leave(req, keep=True)
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
        slot, cache, draft_cache = self.phases.lease(len(p.prompt), p.params, p.tree, p.head)
        try:
            run = Run(self.parts, p.prompt, p.params, p.tree, p.head, p.trace, cache,
                      draft_cache, slot)
            root, ext = self._prefill(run)
        except BaseException:
            self.phases.release(slot)
            raise
        p.handle.run = run
        req = _Active(p.handle, run, len(p.prompt), root=root)
        if run.draft_model is not None:
            req.ext = ext  # read at the next step, its first token out (`_read_prompts`)
        else:
            req.token = root
        return req

    def _prefill(self, run: Run) -> tuple[torch.Tensor, EagleDraftExtendInput]:
        """-> (the first generated token [1], on the device; the draft extend's input after the
        prompt: its tokens shifted by one, that token last, with the prompt's features).
        Rows the prompt shares with an earlier request come from the prefix cache; the target
        runs from the first row not restored."""
        target, prefix = self.parts.target, self.parts.prefix_cache
        dev, n = target.device, len(run.prompt)
        hit = prefix.lookup(run.prompt, run.head)
        r = hit.rows if hit else 0
        if hit:
            prefix.restore(hit, run.cache, run.draft_cache)
        run.stats.reused_tokens = r
        ids = torch.tensor(run.prompt[r:], device=dev)  # [n - r]
        out = target(ids[None], torch.arange(r, n, device=dev)[None], run.cache, r,
                     causal_mask(n - r, r, dev), run.aux_ids, last_only=True)
        root = next_token(out.logits[0, -1:], run.params, run.generator, self.parts.ops)  # [1]
        features = out.aux_hidden if run.aux_ids else out.final_hidden
        return root, EagleDraftExtendInput(torch.cat([ids[1:], root]), features[0], r)

    @staticmethod
    def _read_prompt(run: Run, ext: EagleDraftExtendInput) -> EagleDraftInput:
        """Once the first token is out: the context's suffix index over the prompt and that
        token (with context drafts), and the head's draft extend over the prompt -> the first
        draft's input. Also after a one-token answer, so that the prefix cache keeps the
        head's rows for the next turn. The extend runs eagerly: a prompt is wider than the
        extend's CUDA graph."""
        if run.tree.context_drafts:
            run.context = ContextIndex(run.tokens)
        state = extend(run.draft_model, ext, run.draft_cache, run.tree.topk)
        run.draft_rows = state.seq_len
        return state

    def _tree_input(self, run: Run, drafted: DraftTree, state: EagleDraftInput
                    ) -> EagleVerifyInput:
        """The head's candidates, with the context's chain merged in when there is one, as the
        tree to verify."""
        chain = run.context.propose(run.tree.chain_len) if run.context else None
        return tree_input(drafted, chain, state.root, state.seq_len, run.tree, self.parts.ops)

    def _accept(self, run: Run, vin: EagleVerifyInput, tl: TreeLogits) -> EagleVerifyOutput:
        """Acceptance on the device and the KV commit of the accepted path."""
        ops = self.parts.ops
        if run.params.greedy:
            vout = greedy_acceptance(vin, tl.logits, ops)
        else:
            vout = sampled_acceptance(vin, tl.logits, run.params, run.generator, ops)
        commit(vin, vout, run.cache, ops)
        return vout

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
        eagle = [_Iteration(r, None) for r in running if r.state is not None]
        plain = [r for r in running if r.state is None]
        for model, group in self._by_head(eagle):
            for it, d in zip(group, self._draft(model, group)):
                it.vin = self._tree_input(it.req.run, d, it.req.state)
        t1 = time.perf_counter()
        outs = self._verify(eagle, plain)
        parts: list[torch.Tensor] = [r.root.double() for r in admitted]
        for it, tl in zip(eagle, outs):
            it.tl = tl
            it.vout = self._accept(it.req.run, it.vin, tl)
            own = readback_parts(it.vin, it.vout, it.req.run.trace)
            it.read_size = sum(p.numel() for p in own)
            parts += own
        for r, tl in zip(plain, outs[len(eagle):]):
            r.token = next_token(tl.logits[-1:], r.run.params, r.run.generator,
                                 self.parts.ops)  # [1]
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
        for req, ev in zip(admitted, firsts):
            if ev.finished and req.ext is None:
                self._finish(req, None)
            req.ended = bool(ev.finished)

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

    def _read_prompts(self) -> None:
        """Each EAGLE-3 request admitted in the last step reads its prompt (`_read_prompt`)
        now, its first token already out (also to a caller stepping on its own thread); one
        that ended at its first token then leaves."""
        for req in [r for r in self._active if r.ext is not None]:
            try:
                req.state, req.ext = self._read_prompt(req.run, req.ext), None
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("a request failed reading its prompt")
                self._leave(req, keep=False)
                req.handle.put(e)
                continue
            if req.ended:
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
            for it, state in zip(group, self._extend(model, group, exts)):
                it.req.state = state
                it.req.run.draft_rows = state.seq_len
        timings = {**step.timings, "extend": (time.perf_counter() - t2) * 1000}
        for it, (spans, finished, _) in zip(eagle, results):
            self._deliver(it.req, it.req.run.iteration_event(it.got, spans, finished, timings,
                                                             batch=step.batch))

    def _draft(self, model: object, group: list[_Iteration]) -> list[DraftTree]:
        return self.phases.draft(model, [it.req.run for it in group],
                                 [it.req.state for it in group])

    def _verify(self, eagle: list[_Iteration], plain: list[_Active]) -> list[TreeLogits]:
        """The target over every running request's rows: an EAGLE-3 request's tree, a plain
        request's next token (its logits only)."""
        return self.phases.verify(self.parts.target, [it.req.run for it in eagle],
                                  [it.vin for it in eagle], [r.run for r in plain],
                                  [r.token for r in plain], [r.seq_len for r in plain])

    def _extend(self, model: object, group: list[_Iteration], exts: list[EagleDraftExtendInput]
                ) -> list[EagleDraftInput]:
        return self.phases.extend(model, [it.req.run for it in group], exts)

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
        self._leave(req, keep=True)
        req.handle.put(_END)

    def _leave(self, req: _Active, keep: bool) -> None:
        """`req` leaves: its committed rows go to the prefix cache (`keep`: a clean end, or a
        stop between steps), then its slot is free for the next request."""
        self._active.remove(req)
        if keep:  # the last token produced is in no cache yet
            run = req.run
            self.parts.prefix_cache.store(run.tokens[:-1], run.cache, run.head,
                                          run.draft_cache, run.draft_rows)
        self.phases.release(req.run.slot)
