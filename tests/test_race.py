"""The race (playground/race.py, handlers.Playground.race): the timings the page replays are the
two real runs' own events (each event's engine seconds and the token elements it drew), with
"compare" on and with the Race button after an answer; while plain decoding is recorded the
page gets a count of its tokens against the answer's, not the tokens; the panel carries the
timings once, escaped, and says who finished first by the recorded times, all of the outcome
inside the race's `waiting` panel (hidden until the page has replayed it) and the measured
speedup held in the tiles. The replay itself is in the browser (tests/test_browser_race.py,
tests/test_browser.py)."""
from __future__ import annotations

import dataclasses
import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pytest

from eagle_engine.engine import EagleEngine
from eagle_engine.events import StepEvent, TokenSpan
from playground import handlers, serving
from playground import ui_render as ui
from playground.race import (
    Lane,
    compare_html,
    plain_offset,
    race_data,
    recording_html,
    recording_text,
    result_text,
)
from playground.speed_estimate import CostTable, VerifyCost
from tests.test_app_batch import engine as engine  # the fixture
from tests.test_app_batch import settings

pytestmark = pytest.mark.usefixtures("quiet_machine")  # the tiles' figures, whatever the load
RACE_ATTR = re.compile(r'data-race="([^"]*)"')
QUESTION = "tell me a story"
RECORDING = "Recording plain decoding of the same prompt for the race… "
HELD = re.compile(r'<span class="race-held">\d+\.\d\d×</span>')  # the measured speedup, held


class Spy:
    """Records the events of every run the playground streams, one list per run."""

    def __init__(self, pg: handlers.Playground) -> None:
        self.runs: list[list[StepEvent]] = []
        events = pg._events

        def recorded(*args: Any) -> Iterator[StepEvent]:
            self.runs.append([])
            for ev in events(*args):
                self.runs[-1].append(ev)
                yield ev
        pg._events = recorded


def drawn(events: list[StepEvent]) -> list[int]:
    """Token elements drawn after each event, counted from the events themselves."""
    view, out = ui.AnswerView(), []
    for ev in events:
        view.add(ev)
        out.append(len(re.findall(r'class="tok ', view.html())))
    return out


def panel_race(compare: str) -> dict:
    return json.loads(html.unescape(RACE_ATTR.search(compare).group(1)))


def assert_race_of(race: dict, eagle: list[StepEvent], plain: list[StepEvent]) -> None:
    assert race["eagle"]["t"] == [ev.stats["elapsed_s"] for ev in eagle]
    assert race["plain"]["t"] == [ev.stats["elapsed_s"] for ev in plain]
    assert race["eagle"]["n"] == drawn(eagle) and race["plain"]["n"] == drawn(plain)
    assert race["eagle"]["offset"] == 0.0
    assert race["plain"]["offset"] == pytest.approx(
        eagle[-1].stats["prefill_s"] - plain[-1].stats["prefill_s"])


def output(frame: tuple, name: str) -> Any:
    return frame[handlers.OUTPUTS.index(name)]


def assert_recorded_without_its_tokens(frames: list[tuple], answer_tokens: int,
                                       plain: list[StepEvent]) -> None:
    """While plain decoding is recorded (a frame an event: `frame_interval` 0), the status line
    and the compare panel count its tokens against the answer's, from 0 up, and no frame
    carries a plain token."""
    counts = [0] + [ev.stats["num_tokens"] for ev in plain]
    assert [output(f, "status") for f in frames] == [recording_text(n, answer_tokens)
                                                  for n in counts]
    assert [output(f, "compare") for f in frames] == [recording_html(n, answer_tokens)
                                                   for n in counts]
    assert all('class="tok' not in output(f, "compare") for f in frames)


def test_compare_races_the_two_runs_with_their_own_event_times(engine: EagleEngine) -> None:
    """With "compare" on: the whole answer shows while plain decoding is recorded behind a count
    of its tokens; then the race of the two, the tiles' measured speedup held."""
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    spy = Spy(pg)
    s = dataclasses.replace(settings(engine, True), compare=True)
    frames = list(pg.run([], QUESTION, s))
    last = frames[-1]
    run, compare, tiles = (output(last, k) for k in ("run", "compare", "tiles"))
    eagle, plain = spy.runs
    assert eagle[0].mode == "eagle" and plain[0].mode == "ar"
    assert_race_of(run["race"], eagle, plain)
    assert panel_race(compare) == run["race"]
    assert compare.count("data-race=") == 1 and 'class="race-play"' in compare
    assert run["greedy_identical"] is True
    assert "Greedy texts are identical" in compare
    answer_tokens = eagle[-1].stats["num_tokens"]
    start = len(frames) - len(plain) - 3  # the whole answer, while plain decoding starts
    assert output(frames[start], "status") == recording_text(0, answer_tokens)
    assert output(frames[start], "chat") == output(last, "chat")
    assert output(frames[start], "compare") == ""
    assert output(frames[start], "tiles") == gr.skip(), "the panels wait for the last frame"
    assert_recorded_without_its_tokens(frames[start + 1:-1], answer_tokens, plain)
    assert HELD.search(tiles) and f'{run["speedup"]:.2f}×' in tiles


def test_the_race_button_races_the_last_answer_with_plain_decoding(engine: EagleEngine) -> None:
    """An answer without "compare", then Race: plain decoding of the same prompt, with the
    answer's sampling and weights, recorded behind a count of its tokens; the tiles get the
    measured speedup (held for the replay's end) beside the answer's estimate, and the status
    line says nothing of the outcome; a plain answer or none cannot race."""
    cost = VerifyCost((CostTable(20.0, (1, 8), (1.0, 1.5)),))
    pg = handlers.Playground([engine], serving.EngineThread(), 0.0,
                             {engine.config.weights_label: cost})
    spy = Spy(pg)
    last = list(pg.run([], QUESTION, settings(engine, True)))[-1]
    history = output(last, "history")
    assert output(last, "compare") == "" and len(spy.runs) == 1
    frames = list(pg.race(history))
    final = frames[-1]
    status, compare, tiles = (output(final, k) for k in ("status", "compare", "tiles"))
    eagle, plain = spy.runs
    assert_race_of(panel_race(compare), eagle, plain)
    assert "".join(ev.text for ev in plain) == history[-1]["text"]  # greedy: the same text
    assert status == "Race recorded · see the replay below.", "the outcome waits for the replay"
    estimated = history[-1]["race"]["estimate"].speedup
    assert f"this answer, raced; estimated ≈{estimated:.2f}×" in tiles and HELD.search(tiles)
    assert_recorded_without_its_tokens(frames[:-1], history[-1]["tokens"], plain)
    plain_answer = list(pg.run([], QUESTION, settings(engine, False)))[-1]
    said: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gr, "Warning", said.append)
        assert list(pg.race(output(plain_answer, "history"))) == [handlers.pack()]
        assert list(pg.race([])) == [handlers.pack()]
    assert len(said) == 2 and "needs a whole EAGLE-3 answer" in said[0]


def test_only_the_last_turn_keeps_its_race(engine: EagleEngine) -> None:
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    history = output(list(pg.run([], QUESTION, settings(engine, True)))[-1], "history")
    history = output(list(pg.run(history, "and then?", settings(engine, True)))[-1], "history")
    assert ["race" in t for t in history] == [False, True]


def lane(text: str, times: tuple[float, ...], prefill: float) -> Lane:
    return Lane(text, "", {"prefill_s": prefill, "num_tokens": len(times)}, times,
                tuple(range(1, len(times) + 1)))


def test_result_and_offset_from_the_recorded_times() -> None:
    eagle = lane("ab", (0.10, 0.30, 0.50), prefill=0.10)
    plain = lane("ab", (0.01, 0.21, 0.41, 0.61, 0.81), prefill=0.01)  # prompt cached
    assert plain_offset(eagle, plain) == pytest.approx(0.09)
    assert result_text(eagle, plain) == "EAGLE-3 finished 0.40 s earlier (1.80× faster)."
    slow = lane("ab", (0.10, 0.60, 1.00), prefill=0.10)
    assert result_text(slow, plain) == ("Plain decoding finished 0.10 s earlier (EAGLE-3 ran at "
                                        "0.90×).")
    data = race_data(eagle, plain)
    assert data["plain"] == {"t": list(plain.times), "n": [1, 2, 3, 4, 5],
                             "offset": pytest.approx(0.09)}


def test_panel_escapes_the_texts_and_a_stopped_run_does_not_race() -> None:
    view = ui.AnswerView()
    view.add(StepEvent(0, "ar", [TokenSpan(1, '<b>"x"</b>', "target", 0)], '<b>"x"</b>',
                       stats={"elapsed_s": 0.1, "prefill_s": 0.1, "num_tokens": 1}))
    one = Lane.of(view)
    raced = compare_html(one, one, greedy=True)
    assert "<b>" not in raced and '"x"' not in raced
    assert panel_race(raced)["eagle"] == {"t": [0.1], "n": [1], "offset": 0.0}
    assert raced.count("done at 0.10 s") == 2 and '">0.10 s</span>' in raced  # as it ends
    stopped = compare_html(one, one, greedy=True, stopped=True)
    assert "data-race" not in stopped and "race-play" not in stopped


def test_recording_counts_plain_tokens_against_the_answers() -> None:
    assert recording_text(0, 5) == RECORDING + "0 of 5 tokens"
    assert recording_text(1, 1) == RECORDING + "1 of 1 token"
    assert recording_text(7, 5) == RECORDING + "7 tokens"  # sampling: plain decoding ran on
    assert recording_html(3, 5) == ('<div class="compare race-recording">'
                                    f'<div class="race-progress">{RECORDING}3 of 5 tokens</div>'
                                    "</div>")


def css_rule(selector: str) -> str:
    """The declarations of the rule in assets/style.css with exactly this selector."""
    css = (Path(__file__).resolve().parent.parent / "assets" / "style.css").read_text()
    rule = re.search(rf"(?m)^{re.escape(selector)} {{([^}}]*)}}", css)
    assert rule, selector
    return rule.group(1)


def test_the_race_arrives_waiting_with_its_outcome_hidden() -> None:
    """The race panel comes `waiting`: the page's stylesheet hides the verdict, each side's
    stats and finish and the result while the race waits or plays, and the tiles' measured
    speedup (held) with them; a stopped run's panel shows at once."""
    eagle = lane("ab", (0.10, 0.30, 0.50), prefill=0.10)
    plain = lane("ab", (0.01, 0.21, 0.41, 0.61, 0.81), prefill=0.01)
    raced = compare_html(eagle, plain, greedy=True)
    assert raced.startswith('<div class="compare race waiting" data-race=')
    outcome = ("compare-verdict", "compare-meta", "race-done", "race-result")
    assert all(f'class="{name}"' in raced for name in outcome)
    hidden = css_rule(".race:is(.waiting, .playing) :is(" + ", ".join(
        f".{name}" for name in outcome) + ")")
    assert "visibility: hidden" in hidden
    assert "display: none" in css_rule("body:has(.race:is(.waiting, .playing)) .race-held")
    stopped = compare_html(eagle, plain, greedy=True, stopped=True)
    assert stopped.startswith('<div class="compare">') and "waiting" not in stopped


def test_the_replay_offers_three_speeds_from_one() -> None:
    raced = compare_html(lane("a", (0.1,), 0.1), lane("a", (0.1,), 0.1), greedy=True)
    speeds = re.findall(r'data-speed="(\d)" aria-pressed="(\w+)"', raced)
    assert speeds == [("1", "true"), ("2", "false"), ("4", "false")]
    assert re.search(r'class="race-play">▶ Replay the race</button><span class="race-speed" '
                     r'role="group" aria-label="Replay speed">', raced)


def test_the_measured_speedup_is_held_only_when_asked() -> None:
    stats = {"num_tokens": 4, "tokens_per_s": 8.0, "tau": 2.0}
    held = ui.tiles_html(stats, True, 2.345, held=True)
    assert '<div class="tile-value"><span class="race-held">2.35×</span></div>' in held
    shown = ui.tiles_html(stats, True, 2.345)
    assert '<div class="tile-value">2.35×</div>' in shown and "race-held" not in shown
    assert held.replace('<span class="race-held">2.35×</span>', "2.35×") == shown
    assert "race-held" not in ui.tiles_html(stats, True, None, held=True)  # nothing measured
