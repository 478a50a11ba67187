"""A visitor's flows through the playground's handlers, over the tiny q4 engine of
test_app_batch.py (a 256-token context window): Stop ends a streaming answer with a last frame
(alone or in a batch, with or without the baseline to compare) and a Stop with nothing streaming
says why in a toast and leaves the next answer whole; a Stop during the baseline keeps the
answer and compares only the baseline's start; an answer without its baseline clears the last
compare; only a sent message's first frame empties the message box; a session streams one answer
at a time; a conversation past the context window leaves its oldest turns out of the prompt
(enough that the next turns keep its start), and says so; Continue goes on from an answer cut at
its max new tokens in the same turn, from the answer's own prompt and token ids; a refused
request says why in a warning toast and on the status line. Gradio pulls a visitor's frames on
its own thread, so the visitor here is a thread too.
"""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import gradio as gr
import pytest

from eagle_engine.engine import EagleEngine
from playground import conversation, handlers, serving
from tests.helpers import ByteTokenizer
from tests.test_app_batch import QUESTIONS, answer, settings
from tests.test_app_batch import engine as engine  # the fixture

RECORDING = "Recording plain decoding"  # the status line while the race's plain run records


@pytest.mark.parametrize("max_batch", [1, 4], ids=["alone", "scheduler"])
@pytest.mark.parametrize("compare", [False, True], ids=["answer", "compare"])
def test_stop_ends_the_answer_with_a_last_frame(engine: EagleEngine, max_batch: int,
                                                compare: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop sets the session's flag while the visitor's frames stream (Gradio pulls them on
    another thread); the answer ends after the step in flight, Stop returns once its last frame
    is out, and the engine answers the next message in full. A Stop with nothing streaming
    says in a toast that a message waiting in the queue cannot be taken back."""
    s = dataclasses.replace(settings(engine, True), max_new_tokens=48, compare=compare)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0,
                             max_batch=max_batch)
    frames = pg.run([], QUESTIONS[3], s, session="visitor")
    first_out, go_on, pulled = threading.Event(), threading.Event(), []

    def visitor() -> None:
        pulled.append(next(frames))
        first_out.set()
        go_on.wait(60)  # Stop comes while the visitor waits for the next frame
        pulled.extend(frames)
    thread = threading.Thread(target=visitor)
    thread.start()
    assert first_out.wait(60)
    assert not pg.stops.stop("visitor", timeout=0), "the flag is set; the answer streams on"
    go_on.set()
    assert pg.stops.stop("visitor", timeout=60), "the answer ended by itself after Stop"
    thread.join(timeout=60)
    status, history, run = (pulled[-1][handlers.OUTPUTS.index(k)]
                            for k in ("status", "history", "run"))
    n = history[-1]["tokens"]
    assert status.startswith(f"Stopped after {n} token") and "ready" in status, status
    assert 0 < n < 48 and "text" not in run, "a stopped answer leaves no run record"
    assert not any(str(f[handlers.OUTPUTS.index("status")]).startswith(RECORDING) for f in pulled)
    assert not pg.stops.stop("visitor", timeout=1), "nothing streams: Stop finds no answer"
    said: list[str] = []
    monkeypatch.setattr(gr, "Info", said.append)
    pg.stop(SimpleNamespace(session_hash="visitor"))
    assert said == [handlers.NOTHING_STREAMING], "a Stop with nothing streaming says why"
    full = dataclasses.replace(s, compare=False)
    record, status, _ = answer(pg, QUESTIONS[3], full)
    fresh = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    assert status.startswith("Done")
    assert record["text"] == answer(fresh, QUESTIONS[3], full)[0]["text"]
    if max_batch > 1:
        assert not engine.scheduler.busy


def test_stop_during_the_baseline_keeps_the_answer_and_compares_its_start(
        engine: EagleEngine) -> None:
    s = dataclasses.replace(settings(engine, True), max_new_tokens=48, compare=True)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    frames = pg.run([], QUESTIONS[3], s, session="visitor")
    baseline_out, go_on, pulled = threading.Event(), threading.Event(), []
    status_at = handlers.OUTPUTS.index("status")

    def visitor() -> None:
        for frame in frames:
            pulled.append(frame)
            if str(frame[status_at]).startswith(RECORDING) and not baseline_out.is_set():
                baseline_out.set()
                go_on.wait(60)  # Stop comes while the baseline streams
    thread = threading.Thread(target=visitor)
    thread.start()
    assert baseline_out.wait(60)
    assert not pg.stops.stop("visitor", timeout=0)  # sets the flag
    go_on.set()
    assert pg.stops.stop("visitor", timeout=60)
    thread.join(timeout=60)
    status, history, compare = (pulled[-1][handlers.OUTPUTS.index(k)]
                                for k in ("status", "history", "compare"))
    assert status.startswith("Stopped the baseline after") and "answer above is complete" in status
    alone = answer(handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0),
                   QUESTIONS[3], dataclasses.replace(s, compare=False))[0]
    assert history[-1]["text"] == alone["text"], "the answer itself is whole"
    assert "Baseline stopped after" in compare and "differ" not in compare


def test_an_answer_without_its_baseline_clears_the_last_compare(engine: EagleEngine) -> None:
    s = settings(engine, True)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    at = handlers.OUTPUTS.index("compare")
    compared = list(pg.run([], QUESTIONS[0], dataclasses.replace(s, compare=True)))
    assert "compare-verdict" in compared[-1][at]
    assert all(frame[at] == "" for frame in pg.run([], QUESTIONS[1], s))


class WholeChatTokenizer(ByteTokenizer):
    """ByteTokenizer's chat template without its 40-byte cut: a conversation's length counts."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else "")
        return [1] + [b + 3 for b in text.encode()]


def test_a_conversation_past_the_window_leaves_its_oldest_turns_out(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "tokenizer", WholeChatTokenizer())
    s = dataclasses.replace(settings(engine, True), max_new_tokens=24)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    turns = [{"user": f"question {i}: " + "x" * 40, "text": f"answer {i}: " + "y" * 40,
              "html": f"answer {i}", "tokens": 50} for i in range(4)]
    reserve, window = 24 + s.num_draft_tokens, engine.config.max_len

    def prompt_len(kept: list[dict]) -> int:
        return len(engine.encode(conversation.chat_messages(kept)
                                 + [{"role": "user", "content": "why"}]))
    ids, left_out = conversation.fit_prompt(engine, turns, "why", reserve)
    assert 0 < left_out < len(turns) and len(ids) == prompt_len(turns[left_out:])
    # the fewest turns out that leave a quarter of the window for the next turns
    keep = conversation.KEEP_WHEN_FULL * window
    assert len(ids) + reserve <= keep < prompt_len(turns[left_out - 1:]) + reserve
    last = list(pg.run(turns, "why", s))[-1]
    status, history = (last[handlers.OUTPUTS.index(k)] for k in ("status", "history"))
    assert status.startswith("Done")
    assert f"the oldest {conversation.turns_text(left_out)} left out" in status
    assert [t["user"] for t in history[:-1]] == [t["user"] for t in turns], "the chat keeps all"
    assert history[-1]["left_out"] == left_out
    # the next turn leaves out the same turns while it fits: its prompt starts with this one,
    # whose rows the prefix cache holds
    after, still_out = conversation.fit_prompt(engine, history, "and?", reserve)
    assert still_out == left_out and after[:len(ids)] == ids
    fits = list(pg.run(turns[:1], "why", s))[-1][handlers.OUTPUTS.index("status")]
    assert "left out" not in fits


def test_the_turns_to_leave_out_are_found_with_few_tokenizations(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long chat past the window: the fewest turns to leave out, as counting them one by one
    finds, from a binary search over the prompt's length (a tokenization costs ~26 ms for a
    4k-token chat with the bundled tokenizer)."""
    monkeypatch.setattr(engine, "tokenizer", WholeChatTokenizer())
    turns = [{"user": f"q{i} " + "x" * 20, "text": f"a{i} " + "y" * 20} for i in range(40)]
    reserve, keep = 28, conversation.KEEP_WHEN_FULL * engine.config.max_len
    lengths = [len(engine.encode(conversation.chat_messages(turns[k:]) + [{"role": "user",
                                                                   "content": "why"}]))
               for k in range(len(turns) + 1)]
    fewest = next(k for k, n in enumerate(lengths) if n + reserve <= keep)
    encodes = []
    real_encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda m: encodes.append(1) or real_encode(m))
    ids, left_out = conversation.fit_prompt(engine, turns, "why", reserve)
    assert left_out == fewest > 20 and len(ids) == lengths[fewest]
    assert len(encodes) <= 2 + 6, f"{len(encodes)} tokenizations for 40 turns"


def test_only_the_first_frame_of_a_sent_message_empties_the_message_box(
        engine: EagleEngine) -> None:
    """What the visitor types while an answer streams stays in the box; Regenerate leaves the
    box alone."""
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    at = handlers.OUTPUTS.index("prompt")
    sent = [frame[at] for frame in pg.run([], QUESTIONS[0], settings(engine, True))]
    assert len(sent) > 2 and sent[0] == "" and all(p == gr.skip() for p in sent[1:])
    again = pg.run([], QUESTIONS[0], settings(engine, True), from_box=False)
    assert all(frame[at] == gr.skip() for frame in again)


def test_a_second_answer_while_the_session_streams_one_is_refused(engine: EagleEngine) -> None:
    """Two answers of one session would write the same chat, and the last to end would drop the
    other's turn: the second gets one frame that changes nothing (a toast says why; with no
    frame Gradio empties every output, the message box too) and the first ends whole."""
    s = dataclasses.replace(settings(engine, True), max_new_tokens=48)
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    frames = pg.run([], QUESTIONS[3], s, session="visitor")
    next(frames)
    assert list(pg.run([], QUESTIONS[0], s, session="visitor", from_box=False)) == [handlers.pack()]
    assert list(pg.run([], QUESTIONS[0], s, session="another"))  # other visitors go on
    last = list(frames)[-1]
    status, history = (last[handlers.OUTPUTS.index(k)] for k in ("status", "history"))
    assert status.startswith("Done") and [t["user"] for t in history] == [QUESTIONS[3]]
    assert list(pg.run(history, QUESTIONS[0], s, session="visitor")), "free again once done"


def test_continue_goes_on_from_the_answer_in_the_same_turn(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer cut at its max new tokens says so, and offers Continue; Continue's prompt is
    the answer's own prompt followed by the answer's token ids (what the engine would have
    read had the answer not stopped), the same turn grows, and Continue hides once the
    answer ends. Continue after an answer that ended by itself is refused with a toast."""
    s = dataclasses.replace(settings(engine, True), max_new_tokens=12)
    sampling, tree, head = s.request(engine.head_info())
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    at = {k: handlers.OUTPUTS.index(k) for k in ("status", "history", "more", "chat")}
    frames = list(pg.run([], QUESTIONS[3], s))
    status, history = frames[-1][at["status"]], frames[-1][at["history"]]
    assert "reached its limit of 12 tokens (Max new tokens): press Continue for more" in status
    assert frames[-1][at["more"]]["visible"] is True
    assert all(f[at["more"]]["visible"] is False for f in frames[:-1]), "hidden as it streams"
    prompt = conversation.conversation_ids(engine, [], QUESTIONS[3], 0)
    first = engine.generate(prompt, sampling, tree, head)
    turn = history[-1]
    assert turn["ids"] == first.token_ids and turn["text"] == first.text and turn["tokens"] == 12
    assert turn["finished"] == "length"
    assert conversation.continued_ids(engine, [], turn) == prompt + first.token_ids
    read = []
    real_stream = engine.stream
    monkeypatch.setattr(engine, "stream", lambda ids, *a: read.append(ids) or real_stream(ids, *a))
    more = list(pg.continue_answer(history, *dataclasses.astuple(s)))
    assert read == [prompt + first.token_ids]
    status, grown = more[-1][at["status"]], more[-1][at["history"]]
    assert status.startswith("Done · ") and "continued with 12 tokens" in status
    assert len(grown) == 1 and grown[0]["user"] == QUESTIONS[3]
    assert grown[0]["text"].startswith(turn["text"]) and grown[0]["tokens"] == 24
    assert grown[0]["html"].startswith(turn["html"]) and len(more[-1][at["chat"]]) == 2
    assert grown[0]["ids"][:12] == first.token_ids and len(grown[0]["ids"]) == 24
    assert "race" not in grown[0], "the race needs an answer's own prompt"
    ended = [dict(grown[0], finished="eos")]
    said: list[str] = []
    monkeypatch.setattr(gr, "Warning", lambda message, **_: said.append(message))
    assert list(pg.continue_answer(ended, *dataclasses.astuple(s))) == [handlers.pack()]
    assert list(pg.continue_answer([], *dataclasses.astuple(s))) == [handlers.pack()]
    assert said == ["Continue goes on from an answer that reached its max new tokens; the "
                    "last answer ended by itself.",
                    "Nothing to continue yet: send a message first."]


def test_a_refused_request_says_why_in_a_toast_and_the_status_line(
        engine: EagleEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals of what a request asks are a warning toast and a status line, not an error
    (after an error Gradio leaves an "Error" badge on the status line); the chat stays."""
    said: list[tuple[str, str]] = []
    monkeypatch.setattr(gr, "Warning", lambda message, title: said.append((title, message)))
    monkeypatch.setattr(engine, "tokenizer", WholeChatTokenizer())
    pg = handlers.Playground([engine], serving.EngineThread(), frame_interval=0.0)
    s = settings(engine, True)
    # a message alone past the 256-token window
    empty, window = list(pg.run([], "  ", s)), list(pg.run([], "x" * 300, s))
    assert empty == [handlers.pack(status="Not sent: Type a message first.")]
    assert len(window) == 1 and window[0][handlers.OUTPUTS.index("status")].startswith(
        "Not sent: prompt has ")
    assert [title for title, _ in said] == ["Invalid input", "Request refused"]
    assert said[1][1] in window[0][handlers.OUTPUTS.index("status")]
    assert window[0][handlers.OUTPUTS.index("history")] == gr.skip()
