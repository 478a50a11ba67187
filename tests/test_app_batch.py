"""Issue 26, part 3: the playground answers several visitors at once through the scheduler.

Over a tiny q4 engine: visitors answered together get the answers they get one at a time, each
with its own tokens and tree, the status line says how many requests shared the steps, a
stopped visitor's request leaves the batch, and the chat handlers' concurrency is the batch.
"""
from __future__ import annotations

import threading

import pytest

from eagle_engine.engine import EagleEngine
from playground import handlers, layout, serving
from playground import ui_render as ui
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
