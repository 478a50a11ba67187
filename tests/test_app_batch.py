"""Issue 26, part 3: the playground answers several visitors at once through the scheduler.

Over a tiny q4 engine: visitors answered together get the answers they get one at a time, each
with its own tokens and tree, the status line says how many requests shared the steps, a
stopped visitor's request leaves the batch, Stop ends a streaming answer with a last frame
(alone or in a batch, with or without the baseline to compare) and a Stop with nothing streaming
leaves the next answer whole, a Stop during the baseline keeps the answer and compares only
the baseline's start, and the chat handlers' concurrency is the batch. A plain-speed
rate measured after start-up keeps the answers observed meanwhile.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

import app
from eagle_engine import ui_render as ui
from eagle_engine.engine import EagleEngine
from eagle_engine.speed_estimate import PlainRate
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


def answer(pg: app.Playground, question: str, s: ui.Settings) -> tuple[dict, str, str]:
    """-> the final frame's run record, status line and tree."""
    last = list(pg.run([], question, s))[-1]
    return tuple(last[app.OUTPUTS.index(name)] for name in ("run", "status", "tree"))


@pytest.mark.parametrize("spec", [True, False], ids=["eagle", "plain"])
def test_visitors_answered_together_get_their_solo_answers(engine: EagleEngine,
                                                           spec: bool) -> None:
    s = settings(engine, spec)
    serial = app.Playground([engine], app.EngineThread(), frame_interval=0.0)
    alone = [answer(serial, q, s) for q in QUESTIONS]
    batched = app.Playground([engine], app.EngineThread(), frame_interval=0.0, max_batch=4)
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
    pg = app.Playground([engine], app.EngineThread(), frame_interval=0.0, max_batch=4)
    frames = pg.run([], QUESTIONS[3], s)
    next(frames)
    frames.close()  # what Gradio does when the visitor presses Stop
    scheduler = pg.schedulers[engine.config.weights_label]
    status = answer(pg, QUESTIONS[0], s)[1]  # the engine goes on with the next visitor
    assert "Done" in status and not scheduler.busy


@pytest.mark.parametrize("max_batch", [1, 4], ids=["alone", "scheduler"])
@pytest.mark.parametrize("compare", [False, True], ids=["answer", "compare"])
def test_stop_ends_the_answer_with_a_last_frame(engine: EagleEngine, max_batch: int,
                                                compare: bool) -> None:
    """Stop sets the session's flag while the visitor's frames stream (Gradio pulls them on
    another thread); the answer ends after the step in flight, Stop returns once its last frame
    is out, and the engine answers the next message in full."""
    s = dataclasses.replace(settings(engine, True), max_new_tokens=48, compare=compare)
    pg = app.Playground([engine], app.EngineThread(), frame_interval=0.0, max_batch=max_batch)
    frames, first_out = pg.run([], QUESTIONS[3], s, session="visitor"), threading.Event()
    pulled: list[tuple] = []

    def visitor() -> None:
        pulled.append(next(frames))
        first_out.set()
        time.sleep(0.2)  # Stop comes while the visitor waits for the next frame
        pulled.extend(frames)
    thread = threading.Thread(target=visitor)
    thread.start()
    assert first_out.wait(60)
    assert pg.stops.stop("visitor", timeout=60), "the answer ended by itself after Stop"
    thread.join(timeout=60)
    status, history, run = (pulled[-1][app.OUTPUTS.index(k)] for k in ("status", "history", "run"))
    n = history[-1]["tokens"]
    assert status.startswith(f"Stopped after {n} token") and "ready" in status, status
    assert 0 < n < 48 and "text" not in run, "a stopped answer leaves no run record"
    assert not any(str(f[app.OUTPUTS.index("status")]).startswith("Baseline") for f in pulled)
    assert not pg.stops.stop("visitor", timeout=1), "nothing streams: Stop finds no answer"
    full = dataclasses.replace(s, compare=False)
    record, status, _ = answer(pg, QUESTIONS[3], full)
    fresh = app.Playground([engine], app.EngineThread(), frame_interval=0.0)
    assert status.startswith("Done")
    assert record["text"] == answer(fresh, QUESTIONS[3], full)[0]["text"]
    if max_batch > 1:
        assert not pg.schedulers[engine.config.weights_label].busy


def test_stop_during_the_baseline_keeps_the_answer_and_compares_its_start(
        engine: EagleEngine) -> None:
    s = dataclasses.replace(settings(engine, True), max_new_tokens=48, compare=True)
    pg = app.Playground([engine], app.EngineThread(), frame_interval=0.0)
    frames, baseline_out = pg.run([], QUESTIONS[3], s, session="visitor"), threading.Event()
    pulled: list[tuple] = []
    status_at = app.OUTPUTS.index("status")

    def visitor() -> None:
        for frame in frames:
            pulled.append(frame)
            if str(frame[status_at]).startswith("Baseline") and not baseline_out.is_set():
                baseline_out.set()
                time.sleep(0.2)  # Stop comes while the baseline streams
    thread = threading.Thread(target=visitor)
    thread.start()
    assert baseline_out.wait(60)
    assert pg.stops.stop("visitor", timeout=60)
    thread.join(timeout=60)
    status, history, compare = (pulled[-1][app.OUTPUTS.index(k)]
                                for k in ("status", "history", "compare"))
    assert status.startswith("Stopped the baseline after") and "answer above is complete" in status
    alone = answer(app.Playground([engine], app.EngineThread(), frame_interval=0.0),
                   QUESTIONS[3], dataclasses.replace(s, compare=False))[0]
    assert history[-1]["text"] == alone["text"], "the answer itself is whole"
    assert "Baseline stopped after" in compare and "differ" not in compare


def test_chat_concurrency_is_the_batch(engine: EagleEngine) -> None:
    demo = app.build_demo([engine], max_batch=4)
    limits = {fn.api_name: fn.concurrency_limit for fn in demo.fns.values()
              if fn.api_name in ("chat", "regenerate")}
    assert limits == {"chat": 4, "regenerate": 4}


def test_a_rate_measured_after_start_keeps_the_answers_seen_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second weights' plain speed is measured on the engine thread once the UI is up
    (`app.fill_rate`): its observations join the rate in one assignment, and a plain answer
    observed before it ends keeps its context bucket."""
    measured = PlainRate()
    for prompt_len in (10, 480):
        measured.observe(prompt_len, {"num_tokens": 33, "elapsed_s": 0.5, "prefill_s": 0.1})
    monkeypatch.setattr(app, "measure", lambda engine: measured)
    rate = PlainRate()
    rate.observe(12, {"num_tokens": 5, "elapsed_s": 0.3, "prefill_s": 0.1})  # a visitor's
    seen = dict(rate.points)
    app.fill_rate(None, rate)
    assert set(rate.points) == set(measured.points) and len(rate.points) == 2
    bucket = next(iter(seen))
    assert rate.points[bucket] == seen[bucket] != measured.points[bucket]
    other = next(b for b in measured.points if b != bucket)
    assert rate.points[other] == measured.points[other]


def test_a_failed_rate_measurement_is_logged_and_leaves_the_rate_empty(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A background measurement that fails says so in the log instead of vanishing in its
    Future; the rate stays empty until the first plain answer."""
    def broken(engine: object) -> PlainRate:
        raise RuntimeError("injected")
    monkeypatch.setattr(app, "measure", broken)
    engine = type("E", (), {"config": type("C", (), {"weights_label": "fp32"})()})()
    rate = PlainRate()
    app.fill_rate(engine, rate)
    assert rate.points == {} and "fp32 weights' plain speed failed" in caplog.text
