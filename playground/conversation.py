"""A chat's turns as the target's prompt: the messages, which oldest turns to leave out so
that an answer fits the context window (`fit_prompt`), and the prompt that continues an answer
cut at its max new tokens (`continued_ids`).
Not here: the handlers that stream answers (`handlers.py`).
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

SYSTEM_PROMPT: str | None = None  # None: the chat template's default, as in head training
# A conversation past the context window leaves out its oldest turns until it fills at most
# this share of the window, so its next turns start their prompt the same way and reuse its
# cached rows instead of reading the whole window again.
KEEP_WHEN_FULL = 0.75


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


def continued_ids(engine: Any, turns: list[dict], turn: dict) -> list[int]:
    """The prompt that continues `turn`'s answer (`turns`: the conversation before it): the
    prompt it was answered from (the same turns left out, its message and the assistant's
    header) and then the answer's token ids, so the engine goes on from the answer's last token
    as if it had not stopped, and reuses its cached rows. Not the chat template's
    `continue_final_message` over the answer's text: tokenizing that text again can split it
    otherwise than the model wrote it ("fi" + "b" where it wrote "fib")."""
    return conversation_ids(engine, turns, turn["user"], turn["left_out"]) + turn["ids"]


def fit_prompt(engine: Any, turns: list[dict], user_text: str, reserve: int
               ) -> tuple[list[int], int]:
    """The prompt ids of the conversation and the message, and how many of its oldest turns are
    left out so that `reserve` tokens of the context window stay free (the whole answer and the
    tree's rows), as chat apps do. Turns the last answer left out stay out, so the prompt starts
    as before and reuses its cached rows; when more must go, they go until the prompt and
    `reserve` fill at most KEEP_WHEN_FULL of the window, so the next turns reuse theirs too.
    With every turn left out, the message alone (the engine then names the sizes if even that
    does not fit). A prompt shrinks as turns go, so the fewest to leave out is a binary search:
    counting one turn at a time tokenizes the whole prompt once per turn left out (~26 ms each
    for a long chat), a binary search only a few times."""
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
