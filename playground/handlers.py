"""The playground's event handlers over the loaded engines (`Playground`): sending a message,
streaming its answer frame by frame, continuing an answer cut at its max new tokens, the race
with plain decoding, Stop, Clear and the sidebar's state; and the helpers of a frame. A request
refused for what it asks (an empty message, settings no loaded head serves, a prompt past the
context window) is a warning toast and a status line that says why, not an error: Gradio leaves
an "Error" badge on the status line after an error.
Not here: the layout (`layout.py`), drawing (`ui_render.py`, `race.py`), the engine.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from typing import Any

import gradio as gr

from eagle_engine import memory
from eagle_engine.config import (
    CONTEXT_DRAFTS,
    ConfigError,
    SamplingParams,
    TreeParams,
)
from eagle_engine.events import StepEvent

from . import ui_render as ui
from .conversation import continued_ids, conversation_ids, fit_prompt, turns_text
from .race import Lane, compare_html, race_data, recording_html, recording_text
from .serving import EngineThread, StopFlags, Visitors
from .speed_estimate import (
    Estimate,
    VerifyCost,
    estimate,
    measured_speedup,
    slower_note,
    starved,
)

log = logging.getLogger("app")
# A frame costs Gradio tens of ms, more than an engine step, and a
# browser on the same cores far more: at 0.1 s such a browser slows the engine about twice as
# much as at 0.25 s. Events within this interval share a frame.
FRAME_INTERVAL_S = 0.25
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
# engine: with them in the last frame only, the engine runs ~7% faster. While an answer streams
# they move at most once per this interval, the first time one interval after the answer starts
# (the tokens in the chat stream every frame); the last frame draws them.
PANEL_INTERVAL_S = 1.0


OUTPUTS = ("prompt", "chat", "history", "status", "tiles", "plot", "tree", "timing", "compare",
           "run", "more")  # more: the Continue button, shown after an answer cut at its cap


def pack(**values: Any) -> tuple:
    """Handler outputs in OUTPUTS order; outputs not given are left as they are."""
    return tuple(values.get(name, gr.skip()) for name in OUTPUTS)


class Refused(gr.Error):
    """The engine refused a request for what it asks (`ConfigError`)."""


def refused(reason: str, title: str) -> tuple:
    """The one frame of a refused request: a warning toast, and the status line says why; the
    chat and the message box stay as they are."""
    gr.Warning(reason, title=title)
    return pack(status=f"Not sent: {reason}")


class Playground:
    """Event handlers bound to the loaded engines (the target as loaded and, on a CPU with bf16,
    a copy with 4-bit weights: the sidebar's "Target weights"), stepped on one `EngineThread`.
    Both engines share the tokenizer and carry the same heads. Every request goes through the
    engine's own `Scheduler` (one set of caches and CUDA graphs an engine): with `max_batch` > 1
    it steps on the engine thread as requests come (up to `max_batch` answered together); with
    1, `engine.stream` steps it on the engine thread."""

    def __init__(self, engines: Sequence[Any], worker: EngineThread, frame_interval: float,
                 costs: dict[str, VerifyCost | None] | None = None, max_batch: int = 1,
                 panel_interval: float = PANEL_INTERVAL_S, visitors: Visitors | None = None,
                 startup: Any = None) -> None:
        """`visitors`: the answers streaming (background work waits for none); `startup`:
        the measurements made once the page serves (`background.StartupWork`), whose results
        the page and the tiles show once they end."""
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
        self.visitors, self.startup = visitors or Visitors(), startup

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
            raise Refused(str(e), title="Request refused") from e
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
            session: str | None = None, from_box: bool = True,
            going_on: dict | None = None) -> Iterator[tuple]:
        """Stream one answer (then the baseline when comparing): a frame for the first engine
        step, then at most one per `frame_interval` seconds, and the final one; the panels
        (tiles, step plot, tree, timing) at most once per `panel_interval` seconds, the first
        time one interval after the start, and in the final one.
        Stop (`stop` with the same `session`) ends it after the engine step in flight.
        `from_box`: `user_text` came from the message box, which the first frame empties.
        `going_on`: the turn (after `turns`) whose answer this one continues, in that turn."""
        if problems := self.problems(user_text, s):
            yield refused(" ".join(problems), "Invalid input")
            return
        with self.stops.running(session) as stop:
            if stop is None:
                gr.Warning("An answer is still streaming: wait for it or press Stop, then send "
                           "again (your message stays in the box).")
                yield pack()  # a run that yields no frame empties every output
                return
            try:
                with self.visitors.answering():
                    yield from self._answer(turns, user_text, s, stop, from_box, going_on)
            finally:  # what the answer freed goes back to the system (`memory.py`)
                memory.trim()

    def _answer(self, turns: list[dict], user_text: str, s: ui.Settings,
                stop: threading.Event, from_box: bool,
                going_on: dict | None) -> Iterator[tuple]:
        sampling, tree, head = s.request(self.heads)
        engine, cost = self.engines[s.weights], self.costs.get(s.weights)
        if going_on is None:
            ids, left_out = fit_prompt(engine, turns, user_text, sampling.max_new_tokens + (
                tree.max_rows if head else 1))
        else:  # past the window the engine ends the answer ("context window full")
            ids, left_out = continued_ids(engine, turns, going_on), going_on["left_out"]
        t0 = time.perf_counter()
        view = ui.AnswerView(shown=going_on["text"] if going_on else "")
        with closing(self._steps(engine, ids, sampling, tree, head)) as events:
            try:  # context-window and engine errors surface before history changes
                first = next(events)
            except Refused as e:
                yield refused(e.message, e.title)
                return
            # only the last turn keeps what a race on request needs
            turns = [{k: v for k, v in t.items() if k != "race"} for t in turns] + [{}]
            batches = []  # how many requests shared each step

            def add(ev: StepEvent) -> None:
                view.add(ev)
                batches.append(ev.batch)
            drawn = time.perf_counter()  # when the panels last moved (before: the last answer's)
            doing = "Continuing" if going_on else "Generating"
            for ev in paced(itertools.chain([first], events), add, self.frame_interval, stop):
                turns[-1] = answer_turn(user_text, view, left_out, going_on)
                status = (f"{doing}… {view.num_tokens}/{sampling.max_new_tokens} tokens "
                          f"({head or 'baseline'}, step {ev.step}{shared(ev.batch)})")
                now = time.perf_counter()
                panels = now - drawn >= self.panel_interval
                drawn = now if panels else drawn
                yield self._frame(turns, status, view, head, None, s.weights,
                                  estimate(cost, len(ids), view.verifies, view.stats)
                                  if head and panels else None, panels=panels,
                                  sent=from_box and ev is first, live=True)
        turns[-1] = answer_turn(user_text, view, left_out, going_on)
        on_screen = time.perf_counter() - t0

        def cut(answer: ui.AnswerView) -> bool:  # Stop ended it before its own end
            return stop.is_set() and not answer.finished
        est = estimate(cost, len(ids), view.verifies, view.stats) if head else None
        speedup, base = None, None
        # the Race button runs plain decoding from the turn's message: a continued answer's
        # last part started from the answer so far
        if head is not None and not cut(view) and going_on is None:
            turns[-1]["race"] = {"lane": Lane.of(view), "sampling": sampling, "head": head,
                                 "weights": s.weights, "estimate": est}
        if head is not None and s.compare and not cut(view):
            # the whole answer in the chat while plain decoding is recorded; the panels wait
            # for the last frame, so that drawing them takes no time from plain decoding
            yield self._frame(turns, recording_text(0, view.num_tokens), view, head, None,
                              s.weights, est, panels=False)
            base = yield from self._plain_run(engine, ids, sampling, stop, view.num_tokens)
            if not cut(base):
                speedup = measured_speedup(view.stats, base.stats)
        if cut(view) or (base is not None and cut(base)):
            status = (f"Stopped the baseline after {ui.tokens_text(base.num_tokens)}; the answer "
                      "above is complete." if base
                      else f"Stopped after {ui.tokens_text(view.num_tokens)}.")
            yield self._frame(turns, status + " The engine is ready for the next message.", view,
                              head, None, s.weights, est, base, sampling.greedy, stopped=True)
            return
        reason = (f"the answer reached its limit of {ui.tokens_text(sampling.max_new_tokens)}"
                  " (Max new tokens): press Continue for more" if view.finished == "length"
                  else ui.FINISH_TEXT.get(view.finished or "", view.finished))
        reused = view.stats.get("reused_tokens", 0)
        status = (f"Done · {reason} · {'continued with ' if going_on else ''}"
                  f"{ui.tokens_text(view.num_tokens)} in {view.stats.get('elapsed_s', 0):.2f} s "
                  f"of engine time ({on_screen:.2f} s on screen) · {head or 'baseline'}"
                  f" · {s.weights} target"
                  + (f" · steps shared by up to {max(batches)} requests"
                     if max(batches) > 1 else "")
                  + (f" · {ui.tokens_text(reused)} of the prompt reused from the cache"
                     if reused else "")
                  + (f" · the oldest {turns_text(left_out)} left out of the prompt to fit the "
                     f"{engine.config.max_len}-token context window" if left_out else ""))
        yield self._frame(turns, status, view, head, speedup, s.weights, est, base,
                          sampling.greedy)

    def _plain_run(self, engine: Any, ids: list[int], sampling: SamplingParams,
                   stop: threading.Event, total: int) -> Generator[tuple, None, ui.AnswerView]:
        """Plain decoding of an answer's prompt for its race, recorded: the status line and the
        compare panel count its tokens against the answer's `total`, and its tokens show once,
        in the replay (the page draws less than while the answer streamed, so the browser
        takes no more time from plain decoding than from the answer); returns its view."""
        base = ui.AnswerView()

        def progress() -> tuple:
            return pack(status=recording_text(base.num_tokens, total),
                        compare=recording_html(base.num_tokens, total))
        yield progress()
        with closing(self._steps(engine, ids, sampling, None, None)) as events:
            for _ in paced(events, base.add, self.frame_interval, stop):
                yield progress()
        return base

    def race(self, history: list[dict], request: gr.Request | None = None) -> Iterator[tuple]:
        """The Race button: plain decoding of the last answer's prompt (with that answer's
        sampling and target weights), recorded, then the race of the two in the compare panel
        and the measured speedup in the tiles, beside the answer's estimate (the page shows the
        outcome once the replay ends)."""
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
                with self.visitors.answering():
                    yield from self._race(history, side, stop)
            finally:
                memory.trim()

    def _race(self, history: list[dict], side: dict, stop: threading.Event) -> Iterator[tuple]:
        eagle, sampling = side["lane"], side["sampling"]
        if side["weights"] not in self.engines:
            raise gr.Error(f"target weights {side['weights']!r} are not loaded")
        engine, turn = self.engines[side["weights"]], history[-1]
        ids = conversation_ids(engine, history[:-1], turn["user"], turn.get("left_out", 0))
        base = yield from self._plain_run(engine, ids, sampling, stop, eagle.num_tokens)
        plain = Lane.of(base)
        if stop.is_set() and not base.finished:
            yield pack(status=f"Stopped the baseline after {ui.tokens_text(base.num_tokens)}.",
                       compare=compare_html(eagle, plain, sampling.greedy, stopped=True))
            return
        speedup = measured_speedup(eagle.stats, base.stats)
        yield pack(status="Race recorded · see the replay below.",
                   tiles=self._tiles(eagle.stats, side["head"], speedup, side["estimate"],
                                     side["weights"], held=True),
                   compare=compare_html(eagle, plain, sampling.greedy))

    def _frame(self, turns: list[dict], status: str, view: ui.AnswerView, head: str | None,
               speedup: float | None, weights: str, est: Estimate | None,
               base: ui.AnswerView | None = None, greedy: bool = True,
               panels: bool = True, stopped: bool = False, sent: bool = False,
               live: bool = False) -> tuple:
        """`sent`: the answer's first frame, which empties the message box; later frames leave
        it to what the visitor types meanwhile. `panels`: the frame moves the tiles, the step
        plot, the tree and the timing (else they stay as they are). With `base`, the compare
        panel: the race of the two (the tiles' measured speedup held until its replay ends),
        or, `stopped`, the two side by side. `live`: the answer still streams; once it ends,
        Continue shows if it reached its max new tokens."""
        lanes = (Lane.of(view), Lane.of(base)) if base else None
        raced = lanes is not None and not stopped
        moved = dict(tiles=self._tiles(view.stats, head, speedup, est, weights, raced),
                     plot=step_plot(view.accepted_per_step),
                     tree=ui.tree_svg(view.tree, view.tree_step),
                     timing=ui.timing_html(view.stats)) if panels else {}
        return pack(prompt="" if sent else gr.skip(), chat=ui.chat_display(turns),
                    history=turns, status=status, **moved,
                    # an answer without its baseline (yet) clears the last answer's compare
                    compare=compare_html(*lanes, greedy, stopped) if lanes else "",
                    run=ui.run_record(view, head, speedup, base, greedy, weights, est,
                                      race_data(*lanes) if raced else None)
                    if status.startswith("Done") else gr.skip(),
                    more=gr.update(visible=not live and view.finished == "length"))

    def _tiles(self, stats: dict[str, Any], head: str | None, speedup: float | None,
               est: Estimate | None, weights: str, held: bool = False) -> str:
        """The tiles with the speed figures that hold: no estimate on a CPU answer that the
        machine's load starved, nor before the start-up measurement it needs; under them,
        why EAGLE-3 cannot pay here when the start-up measurement or this answer says so.
        `held`: a raced speedup stays hidden until the race's replay ends."""
        engine, unknown, note = self.engines[weights], None, None
        if head is not None:
            if engine.config.device == "cpu" and starved(stats):
                unknown, est = ui.MACHINE_BUSY, None
            elif est is None and speedup is None and self._measuring(weights):
                unknown = ui.ESTIMATE_PENDING
            note = self._slower_note(weights, est)
        return ui.tiles_html(stats, head is not None, speedup, est, unknown, note, held)

    def _measuring(self, weights: str) -> bool:
        """The start-up measurement of `weights`' verify cost has not ended yet."""
        return (weights not in self.costs and self.startup is not None
                and not self.startup.done.is_set())

    def _slower_note(self, weights: str, est: Estimate | None) -> str | None:
        """Why EAGLE-3 is slower than plain decoding here, when the start-up measurement of
        the trees (`autotune.Tuned`) or, without one, this answer's estimate says it is."""
        engine = self.engines[weights]
        tuned = engine.tuned
        m = tuned.measured.get(weights) if tuned and not tuned.loaded else None
        tree, cost = engine.default_tree, self.costs.get(weights)
        if m is not None and m.chosen is not None:
            ratio = m.tree_tok_s[m.chosen] / m.plain_tok_s
            if ratio < 1:
                return slower_note(ratio, tree, cost, "measured at start-up on short prompts, "
                                   "with the fastest tree found")
            return None
        if est is not None and est.speedup < 1:
            return slower_note(est.speedup, tree, cost, "this answer, estimated")
        return None

    def page_state(self) -> tuple:
        """What a page opened now shows of the start-up measurements: the sidebar's engine
        status, the fastest weights and their tree on the sliders."""
        ranked = self.startup.ranked if self.startup is not None else None
        weights = (ranked[0] if ranked else next(iter(self.engines.values()))
                   ).config.weights_label
        return (self.engine_status(weights), gr.update(value=weights),
                *self.weights_changed(weights))

    def engine_status(self, weights: str) -> str:
        """The sidebar's Markdown: the engine, and what the start-up measurement found (or that
        it is running)."""
        engine = self.engines[weights]
        measuring = self.startup is not None and not self.startup.done.is_set()
        return ui.engine_status(engine.config, len(self.heads), list(self.engines),
                                engine.tuned and engine.tuned.summary(weights, ui.tree_named),
                                self.startup.stage if measuring else None)

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

    def continue_answer(self, history: list[dict], spec: bool, aux: bool, layers: int,
                        topk: int, num_steps: int, num_draft_tokens: int, temperature: float,
                        top_p: float, max_new_tokens: int, seed: float | None, compare: bool,
                        weights: str, context_drafts: bool = CONTEXT_DRAFTS,
                        min_score: float = 0.0, context_extra: int = 0, step_cut: float = 0.0,
                        request: gr.Request | None = None) -> Iterator[tuple]:
        """Continue: the last answer, cut at its max new tokens, goes on from its last token
        with the current settings, up to max new tokens more, in the same turn."""
        if not history or history[-1].get("finished") != "length":
            gr.Warning("Continue goes on from an answer that reached its max new tokens; "
                       "the last answer ended by itself." if history else
                       "Nothing to continue yet: send a message first.")
            yield pack()
            return
        yield from self.run(history[:-1], history[-1]["user"], ui.Settings(
            spec, aux, layers, topk, num_steps, num_draft_tokens, temperature, top_p,
            max_new_tokens, seed, compare, weights, context_drafts, min_score, context_extra,
            step_cut), session_of(request), from_box=False, going_on=history[-1])

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
                    timing=ui.timing_html({}), compare="", run=None,
                    more=gr.update(visible=False))

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
        """Updates for aux, layers and the head note: only combinations with a loaded head, and
        the layer counts left out say which aux setting they need."""
        aux_values = {h.use_aux for h in self.heads}
        # without a head the radio keeps its one choice: Gradio refuses a value outside them
        choices = ui.layer_choices(self.heads, aux) or [layers]
        layers = layers if layers in choices else choices[0]
        aux_info = ("aux hidden states feed the head three target layers instead of one"
                    if len(aux_values) > 1 else
                    f"only heads with aux {'on' if aux else 'off'} are loaded" if aux_values
                    else "no draft head is loaded")
        # layer counts only heads with the other aux setting have: why they are not offered
        # ("" clears the note: None would leave the last one)
        missing = sorted({h.num_layers for h in self.heads} - set(choices))
        layers_info = "; ".join(f"{n} layer{'s' * (n > 1)}: needs aux hidden states "
                                f"{'off' if aux else 'on'}" for n in missing)
        return (gr.update(interactive=spec and len(aux_values) > 1, info=aux_info),
                gr.update(choices=[(f"{n} layer{'s' * (n > 1)}", n) for n in choices],
                          value=layers, interactive=spec and len(choices) > 1,
                          info=layers_info),
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


def answer_turn(user_text: str, view: ui.AnswerView, left_out: int,
                going_on: dict | None = None) -> dict:
    """A turn of the chat history; `left_out`: the earlier turns its prompt left out;
    `going_on`: the turn whose answer `view` continues (its text, spans and ids come first).
    `finished`: why the answer ended (None: stopped)."""
    before = going_on or {"text": "", "html": "", "tokens": 0, "ids": []}
    return {"user": user_text, "text": before["text"] + view.text,
            "html": before["html"] + view.html(), "tokens": before["tokens"] + view.num_tokens,
            "ids": before["ids"] + view.ids, "finished": view.finished, "left_out": left_out}
