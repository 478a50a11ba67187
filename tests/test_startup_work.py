"""The app's measurements after it serves (`playground/background.py`) and the speed claims
they feed: a visitor is answered while a measurement is unfinished (stubbed to run until
released), a measurement's decoding runs only between answers and again when an answer started
during it, its results reach the costs and the pages opened afterwards, a failure is logged;
the tiles say "estimate after start-up measurement" until the cost exists, "the machine is
busy" for a starved answer, and why EAGLE-3 cannot pay where the measurement says so."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from eagle_engine.config import TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.tools import autotune
from playground import background, handlers, serving
from playground.speed_estimate import CostTable, Estimate, VerifyCost
from tests.test_app_batch import engine as engine  # the fixture: a tiny q4 engine
from tests.test_app_batch import settings

pytestmark = pytest.mark.usefixtures("quiet_machine")  # the judgement's own test undoes it
COST = VerifyCost((CostTable(20.0, (1, 2, 4, 8), (1.0, 1.4, 2.66, 5.07)),))  # a Zen 1's


def final(frames: Any, name: str) -> Any:
    return list(frames)[-1][handlers.OUTPUTS.index(name)]


class Held:
    """A stubbed measurement that decodes (here: counts) one unit after another through
    `run` until `release` is set, then returns `COST`."""

    def __init__(self) -> None:
        self.release, self.units = threading.Event(), 0

    def measure(self, engine: Any, head: str | None, run: Any) -> VerifyCost:
        while not self.release.is_set():
            run(self.unit)
        return COST

    def unit(self) -> None:
        self.units += 1


@pytest.mark.parametrize("stage", ["cost", "tune"])
def test_a_visitor_is_answered_before_the_measurement_ends(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """The verify cost's measurement, or the tuning after it, runs on until released."""
    held, weights = Held(), engine.config.weights_label
    if stage == "cost":
        monkeypatch.setattr(background, "measure", held.measure)
    else:
        monkeypatch.setattr(background, "measure", lambda engine, head, run: COST)
        monkeypatch.setattr(autotune, "tune", lambda engines, head, call: held.measure(
            None, head, call) and autotune.Tuned(head, {}, [weights], 1.0, "test CPU", 0.5,
                                                 True))
    worker, visitors, costs = serving.EngineThread(), serving.Visitors(), {}
    work = background.StartupWork([engine], "head", worker, visitors, costs, tune=True)
    pg = handlers.Playground([engine], worker, 0.0, costs, visitors=visitors, startup=work)
    work.start()
    try:
        tiles = final(pg.run([], "hello", settings(engine, True)), "tiles")
        assert not work.done.is_set() and held.units > 0  # it ran before and around the answer
        assert ("estimate after start-up measurement" in tiles) == (stage == "cost")
        assert {"cost": "Start-up measurement** measuring the q4 target's verify cost",
                "tune": "Start-up measurement** measuring which weights and tree decode "
                "fastest here"}[stage] in pg.page_state()[0]
    finally:
        held.release.set()
    assert work.done.wait(60) and costs == {weights: COST}
    assert "≈" in final(pg.run([], "hello", settings(engine, True)), "tiles")  # the estimate now
    assert "Start-up measurement" not in pg.page_state()[0]
    engine.tuned = None


def test_a_decoding_during_which_an_answer_started_runs_again() -> None:
    visitors = serving.Visitors()
    work = background.StartupWork([], None, serving.EngineThread(), visitors, {}, tune=False)
    runs = []

    def unit() -> int:
        runs.append(visitors.started)
        if len(runs) == 1:  # a visitor's answer starts (and ends) while it runs
            with visitors.answering():
                pass
        return len(runs)
    assert work.call(unit) == 2 and runs == [0, 1]


def test_a_measurement_waits_for_the_answers_streaming() -> None:
    visitors = serving.Visitors()
    work = background.StartupWork([], None, serving.EngineThread(), visitors, {}, tune=False)
    ran = threading.Event()
    with visitors.answering():
        thread = threading.Thread(target=work.call, args=(ran.set,))
        thread.start()
        thread.join(0.2)
        assert not ran.is_set()  # held back while the answer streams
    thread.join(10)
    assert ran.is_set()


def test_a_failed_measurement_is_logged_and_the_app_serves_on(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(engine: Any, head: str | None, run: Any) -> VerifyCost:
        raise RuntimeError("injected")
    monkeypatch.setattr(background, "measure", broken)
    costs: dict = {}
    work = background.StartupWork([engine], "head", serving.EngineThread(), serving.Visitors(),
                                  costs, tune=False)
    work.run()
    assert work.done.is_set() and costs == {}
    assert "a start-up measurement failed (measuring the q4 target's verify cost)" in caplog.text
    pg = handlers.Playground([engine], serving.EngineThread(), 0.0, costs, startup=work)
    assert "estimate after" not in final(pg.run([], "hi", settings(engine, True)), "tiles")


def slower_tuned(weights: str, head: str) -> autotune.Tuned:
    """A measurement in which every tree is slower than plain decoding (a Zen 1's figures)."""
    trees = {"k3 s2 n5 min0.1 step0.5 +ctx+8": 101.6, "k1 s1 n2 +ctx+8": 118.6}
    specs = {"k3 s2 n5 min0.1 step0.5 +ctx+8": "k=3,s=2,n=5,cut=0.1,extra=8,step=0.5",
             "k1 s1 n2 +ctx+8": "k=1,s=1,n=2,extra=8"}
    return autotune.Tuned(head, {weights: autotune.Measured(weights, 135.7, trees, specs,
                                                            chosen="k1 s1 n2 +ctx+8")},
                          [weights], 60.0, "test CPU")


def test_the_tuned_tree_reaches_new_pages_and_the_tiles_say_why_eagle3_cannot_pay(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = engine.config.weights_label
    static = engine.default_tree
    monkeypatch.setattr(background, "measure", lambda engine, head, run: COST)
    monkeypatch.setattr(autotune, "tune", lambda engines, head, call: slower_tuned(weights,
                                                                                    head))
    costs: dict = {}
    work = background.StartupWork([engine], "head", serving.EngineThread(), serving.Visitors(),
                                  costs, tune=True)
    work.run()
    try:
        assert work.ranked == [engine] and engine.default_tree == TreeParams(1, 1, 2,
                                                                             context_extra=8)
        pg = handlers.Playground([engine], serving.EngineThread(), 0.0, costs, startup=work)
        status, radio, topk, steps, tokens, *_ = pg.page_state()
        assert (radio["value"], topk["value"], steps["value"], tokens["value"]) == (
            weights, 1, 1, 2)
        assert ('EAGLE-3 with <span class="tree-name" title="k1 s1 n2 +ctx+8">chain of 1 '
                "draft + context drafts</span>: 119 tok/s; plain decoding: 136 tok/s" in status)
        tiles = final(pg.run([], "hello", settings(engine, True)), "tiles")
        # a 2-token tree: 1.4 steps, 0.40 of a step a draft token; 118.6 / 135.7 = 0.87
        assert ("On this CPU verifying a tree of 2 tokens costs 1.4 one-token steps here (each "
                "draft token 0.40 of a step), more than its accepted drafts save, so EAGLE-3 "
                "runs at 0.87× plain decoding (measured at start-up on short prompts, with the "
                "fastest tree found)") in tiles.replace("&#x27;", "'")
    finally:
        engine.default_tree, engine.tuned = static, None


def test_a_starved_answer_shows_the_machine_is_busy_instead_of_a_ratio(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from playground import speed_estimate

    monkeypatch.setattr(handlers, "starved", speed_estimate.starved)
    pg = handlers.Playground([engine], serving.EngineThread(), 0.0,
                             {engine.config.weights_label: COST})
    weights = engine.config.weights_label
    quiet = {"num_tokens": 8, "elapsed_s": 1.0, "cpu_share": 0.95, "thinned": False}
    est = Estimate(1.3, 1.3, 0.1, 10.0, 20.0, 3.0, 2.0)
    assert "≈1.30×" in pg._tiles(quiet, "head", None, est, weights)
    for busy in ({**quiet, "cpu_share": 0.45}, {**quiet, "thinned": True}):
        tiles = pg._tiles(busy, "head", None, est, weights)
        assert "the machine is busy; timings are unreliable" in tiles and "≈" not in tiles
    assert "busy" not in pg._tiles({**quiet, "cpu_share": 0.45}, None, None, None, weights)
