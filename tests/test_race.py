"""The race (playground/race.py, handlers.Playground.race): the timings the page replays are the
two real runs' own events (each event's engine seconds and the token elements it drew), with
"compare" on and with the Race button after an answer; the panel carries them once, escaped,
and says who finished first by the recorded times. The replay itself is in the browser
(tests/test_browser.py)."""
from __future__ import annotations

import dataclasses
import html
import json
import re
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pytest

from eagle_engine.engine import EagleEngine
from eagle_engine.events import StepEvent, TokenSpan
from playground import handlers, serving
from playground import ui_render as ui
from playground.race import Lane, compare_html, plain_offset, race_data, result_text
from playground.speed_estimate import CostTable, VerifyCost
from tests import test_app_batch
from tests.test_app_batch import settings

engine = test_app_batch.engine  # the tiny q4 engine's fixture

RACE_ATTR = re.compile(r'data-race="([^"]*)"')
QUESTION = "tell me a story"


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


def test_compare_races_the_two_runs_with_their_own_event_times(engine: EagleEngine) -> None:
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    spy = Spy(pg)
    s = dataclasses.replace(settings(engine, True), compare=True)
    last = list(pg.run([], QUESTION, s))[-1]
    run, compare = (last[handlers.OUTPUTS.index(k)] for k in ("run", "compare"))
    eagle, plain = spy.runs
    assert eagle[0].mode == "eagle" and plain[0].mode == "ar"
    assert_race_of(run["race"], eagle, plain)
    assert panel_race(compare) == run["race"]
    assert compare.count("data-race=") == 1 and 'class="race-play"' in compare
    assert run["greedy_identical"] is True
    assert "Greedy texts are identical" in compare


def test_the_race_button_races_the_last_answer_with_plain_decoding(engine: EagleEngine) -> None:
    """An answer without "compare", then Race: plain decoding of the same prompt, with the
    answer's sampling and weights; the tiles get the measured speedup beside the answer's
    estimate; a plain answer or none cannot race."""
    cost = VerifyCost((CostTable(20.0, (1, 8), (1.0, 1.5)),))
    pg = handlers.Playground([engine], serving.EngineThread(), 0.0,
                             {engine.config.weights_label: cost})
    spy = Spy(pg)
    last = list(pg.run([], QUESTION, settings(engine, True)))[-1]
    history = last[handlers.OUTPUTS.index("history")]
    assert last[handlers.OUTPUTS.index("compare")] == "" and len(spy.runs) == 1
    frames = list(pg.race(history))
    final = frames[-1]
    status, compare, tiles = (final[handlers.OUTPUTS.index(k)]
                              for k in ("status", "compare", "tiles"))
    eagle, plain = spy.runs
    assert_race_of(panel_race(compare), eagle, plain)
    assert "".join(ev.text for ev in plain) == history[-1]["text"]  # greedy: the same text
    assert status.startswith("Race ready · ")
    estimated = history[-1]["race"]["estimate"].speedup
    assert f"(measured; estimate ≈{estimated:.2f}×)" in tiles
    assert any(str(f[handlers.OUTPUTS.index("status")]).startswith("Baseline") for f in frames[:-1])
    plain_answer = list(pg.run([], QUESTION, settings(engine, False)))[-1]
    said: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gr, "Warning", said.append)
        assert list(pg.race(plain_answer[handlers.OUTPUTS.index("history")])) == [handlers.pack()]
        assert list(pg.race([])) == [handlers.pack()]
    assert len(said) == 2 and "needs a whole EAGLE-3 answer" in said[0]


def test_only_the_last_turn_keeps_its_race(engine: EagleEngine) -> None:
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    history = list(pg.run([], QUESTION, settings(engine, True)))[-1][
        handlers.OUTPUTS.index("history")]
    history = list(pg.run(history, "and then?", settings(engine, True)))[-1][
        handlers.OUTPUTS.index("history")]
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
