"""Issue 26, part 3: the playground answers several visitors at once through the scheduler.

Over a tiny q4 engine: visitors answered together get the answers they get one at a time, each
with its own tokens and tree, the status line says how many requests shared the steps, a
stopped visitor's request leaves the batch, and the chat handlers' concurrency is the batch.
A verify cost measured after start-up joins the costs the playground holds.
"""
from __future__ import annotations

import threading

import pytest

from eagle_engine.engine import EagleEngine
from playground import handlers, layout, serving, startup
from playground import ui_render as ui
from playground.speed_estimate import CostTable, VerifyCost
from tests.helpers import tiny_engine

QUESTIONS = ["abc", "hello there", "what is up", "tell me a story"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EagleEngine:
    return tiny_engine(tmp_path_factory.mktemp("app_batch"), {"head": {"intermediate_size": 64}},
                       weights="q4", hidden_size=64, intermediate_size=96, weight_scale=1.0,
                       vocab_size=264)


def settings(engine: EagleEngine, spec: bool) -> ui.Settings:
    return ui.Settings(spec, True, 1, 2, 2, 4, 0.0, 1.0, 24, 0, False,
                       engine.config.weights_label)


def answer(pg: handlers.Playground, question: str, s: ui.Settings) -> tuple[dict, str, str]:
    """-> the final frame's run record, status line and tree."""
    last = list(pg.run([], question, s))[-1]
    return tuple(last[handlers.OUTPUTS.index(name)] for name in ("run", "status", "tree"))


@pytest.mark.parametrize("spec", [True, False], ids=["eagle", "plain"])
def test_visitors_answered_together_get_their_solo_answers(engine: EagleEngine,
                                                           spec: bool) -> None:
    s = settings(engine, spec)
    serial = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    alone = [answer(serial, q, s) for q in QUESTIONS]
    batched = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0, max_batch=4)
    results: list = [None] * len(QUESTIONS)
    start = threading.Barrier(len(QUESTIONS))

    def visit(i: int) -> None:
        start.wait()
        results[i] = answer(batched, QUESTIONS[i], s)
    threads = [threading.Thread(target=visit, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for (run, status, tree), (solo, solo_status, solo_tree) in zip(results, alone):
        # its own accepted / bonus / rejected tokens and its own last tree
        assert run["text"] == solo["text"] and run["spans"] == solo["spans"]
        assert tree == solo_tree
        assert "Done" in status and "shared" not in solo_status
    assert any("steps shared by up to" in status for _, status, _ in results)


def test_a_stopped_visitor_leaves_the_batch(engine: EagleEngine) -> None:
    s = settings(engine, True)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0, max_batch=4)
    frames = pg.run([], QUESTIONS[3], s)
    next(frames)
    frames.close()  # what Gradio does when the visitor presses Stop
    scheduler = engine.scheduler
    status = answer(pg, QUESTIONS[0], s)[1]  # the engine goes on with the next visitor
    assert "Done" in status and not scheduler.busy


def test_chat_concurrency_is_the_batch(engine: EagleEngine) -> None:
    demo = layout.build_demo([engine], max_batch=4)
    limits = {fn.api_name: fn.concurrency_limit for fn in demo.fns.values()
              if fn.api_name in ("chat", "regenerate")}
    assert limits == {"chat": 4, "regenerate": 4}


def stub_engine(weights: str) -> object:
    return type("E", (), {"config": type("C", (), {"weights_label": weights})()})()


def test_a_cost_measured_after_start_joins_the_playgrounds_costs(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second weights' verify cost is measured on the engine thread once the UI is up
    (`startup.fill_cost`): it lands, under its weights, in the dict the Playground holds (not a
    copy), so that target's next answer has an estimate."""
    measured = VerifyCost((CostTable(20.0, (1, 8), (1.0, 1.5)),))
    monkeypatch.setattr(startup, "measure", lambda engine, head: measured)
    costs: dict = {}
    pg = handlers.Playground([engine], serving.EngineThread(), 0.0, costs)
    s = settings(engine, True)
    assert answer(pg, QUESTIONS[1], s)[0]["speedup_estimate"] is None
    startup.fill_cost(engine, "head", costs)
    assert pg.costs == {engine.config.weights_label: measured}
    assert answer(pg, QUESTIONS[1], s)[0]["speedup_estimate"] > 0


def test_a_failed_cost_measurement_is_logged_and_leaves_no_cost(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A background measurement that fails says so in the log instead of vanishing in its
    Future; that target's answers then show no estimate."""
    def broken(engine: object, head: str | None) -> VerifyCost:
        raise RuntimeError("injected")
    monkeypatch.setattr(startup, "measure", broken)
    costs: dict = {}
    startup.fill_cost(stub_engine("fp32"), "head", costs)
    assert costs == {} and "fp32 weights' verify cost failed" in caplog.text
