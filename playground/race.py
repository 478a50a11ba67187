"""The EAGLE-3 answer beside plain decoding of the same prompt, as a race the page replays.

Owns what a run leaves for the race (`Lane`: its text, spans and stats, and per event the
engine's seconds on the run after it and the token elements drawn so far, all from the run's own
events), the recorded timings the page replays (`race_data`), the comparison panel that carries
them (`compare_html`: both answers side by side, the greedy-identity verdict, who finished
first, the Replay button and its speeds) and the progress line while plain decoding is recorded
(`recording_text`, `recording_html`: a count, not its tokens, so the visitor watches plain
decoding once, in the replay). The server sends a race once, drawn finished but `waiting`: its
outcome stays hidden (assets/style.css) until the page's script (assets/race.js) has replayed
it in the browser, which costs the engine nothing. Pure functions of plain data; every piece of
model text is HTML-escaped by `ui_render`. Not here: running the two answers (`handlers.py`),
drawing token spans and the speedup tile (`ui_render.py`) or the replay itself (race.js).
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any

from .ui_render import AnswerView, first_difference, tokens_text

REPLAY_SPEEDS = (1, 2, 4)  # the replay's choices, in multiples of the recorded pace


@dataclass(frozen=True)
class Lane:
    """One run as the race replays it."""

    text: str
    html: str  # its token spans, as in the chat
    stats: dict[str, Any]  # `RunStats.to_dict()` after its last event
    times: tuple[float, ...]  # per event: the engine's seconds on the run after it
    drawn: tuple[int, ...]  # per event: the token elements of `html` drawn after it

    @classmethod
    def of(cls, view: AnswerView) -> Lane:
        return cls(view.text, view.html(), view.stats, tuple(t for t, _ in view.marks),
                   tuple(n for _, n in view.marks))

    @property
    def prefill_s(self) -> float:
        return float(self.stats.get("prefill_s", 0.0))

    @property
    def end_s(self) -> float:
        return self.times[-1] if self.times else 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.stats.get("num_tokens", 0))


def plain_offset(eagle: Lane, plain: Lane) -> float:
    """Seconds added to the plain run's times: plain decoding runs second and finds the prompt
    in the prefix cache, so it starts from the answer's own prefill instead of its own (the
    same prompt work on both sides, as `speed_estimate.measured_speedup` counts it)."""
    return eagle.prefill_s - plain.prefill_s


def race_data(eagle: Lane, plain: Lane) -> dict[str, Any]:
    """What the page replays: per lane the recorded event times (seconds, the runs' own), the
    token elements drawn after each, and the offset added to its times."""
    return {"eagle": {"t": list(eagle.times), "n": list(eagle.drawn), "offset": 0.0},
            "plain": {"t": list(plain.times), "n": list(plain.drawn),
                      "offset": plain_offset(eagle, plain)}}


def result_text(eagle: Lane, plain: Lane) -> str:
    """Who finished first and by how much, on the race's clock."""
    a, b = eagle.end_s, plain.end_s + plain_offset(eagle, plain)
    if a <= 0 or b <= 0:
        return "Nothing to race: a run produced no event."
    if a < b:
        return f"EAGLE-3 finished {b - a:.2f} s earlier ({b / a:.2f}× faster)."
    if b < a:
        return f"Plain decoding finished {a - b:.2f} s earlier (EAGLE-3 ran at {b / a:.2f}×)."
    return "Both finished together."


def verdict_text(eagle: Lane, plain: Lane, greedy: bool, stopped: bool) -> str:
    if not greedy:
        return ("Sampling (temperature > 0): the texts may differ; both follow the target's "
                "distribution.")
    if stopped and eagle.text.startswith(plain.text):
        return (f"Baseline stopped after {tokens_text(plain.num_tokens)}; greedy, its text so "
                "far is the answer's start.")
    if (diff := first_difference(eagle.text, plain.text)) is None:
        return "✓ Greedy texts are identical (speculation is lossless)."
    return (f"✗ Greedy texts differ from character {diff}. In bf16/fp16, verifying several "
            "tokens at once rounds differently from one-token decoding, so near-tied tokens "
            "can flip; in fp32 the texts match.")


def _column(title: str, lane: Lane, col_id: str, name: str, done_at: float | None) -> str:
    """One answer's column; `done_at`: when it finished on the race's clock (no race: None)."""
    s = lane.stats
    meta = (f"{tokens_text(lane.num_tokens)} · {s.get('tokens_per_s', 0.0):.1f} tok/s · "
            f"{s.get('elapsed_s', 0.0):.2f} s")
    done = "" if done_at is None else f" · done at {done_at:.2f} s"
    return (f'<div class="compare-col{" done" * (done_at is not None)}" id="{col_id}" '
            f'data-lane="{name}"><div class="compare-title">{title}<span class="race-done">'
            f'{done}</span></div><div class="compare-meta">{meta}</div>'
            f'<div class="spec-answer">{lane.html}</div></div>')


def _speeds() -> str:
    """The replay's speed choices; 1× pressed (the page keeps a visitor's choice)."""
    buttons = "".join(f'<button type="button" data-speed="{x}" aria-pressed="{str(x == 1).lower()}"'
                      f' title="replay at {x}× the recorded pace">{x}×</button>'
                      for x in REPLAY_SPEEDS)
    return f'<span class="race-speed" role="group" aria-label="Replay speed">{buttons}</span>'


def compare_html(eagle: Lane, plain: Lane, greedy: bool, stopped: bool = False) -> str:
    """Both answers side by side with the verdict. A whole plain run (not `stopped`) makes a
    race: the panel carries its recorded timings (`race_data`) for the page to replay, a
    replay button with its speeds and the result; drawn here as the race ends (each column's
    finish, the clock at the last), which the page's replay ends on too, and `waiting`: until
    the page plays or shows it, the outcome (verdict, result, each column's stats and finish)
    is hidden."""
    verdict = html.escape(verdict_text(eagle, plain, greedy, stopped))
    ends = (None, None) if stopped else (eagle.end_s, plain.end_s + plain_offset(eagle, plain))
    cols = (f'<div class="compare-cols">'
            f'{_column("EAGLE-3", eagle, "compare-eagle", "eagle", ends[0])}'
            f'{_column("Plain decoding (target only)", plain, "compare-base", "plain", ends[1])}'
            '</div>')
    if stopped:
        return (f'<div class="compare"><div class="compare-verdict">{verdict}</div>{cols}'
                '</div>')
    data = html.escape(json.dumps(race_data(eagle, plain), separators=(",", ":")))
    return (f'<div class="compare race waiting" data-race="{data}"><div class="race-head">'
            f'<button type="button" class="race-play">▶ Replay the race</button>{_speeds()}'
            f'<span class="race-clock" aria-live="off">{max(ends):.2f} s</span>'
            '<span class="race-note">each '
            "side at its own recorded pace: every step appears at the engine time it was "
            "produced; plain decoding starts from the answer's prefill</span></div>"
            f'<div class="compare-verdict">{verdict}</div>{cols}'
            f'<div class="race-result">{html.escape(result_text(eagle, plain))}</div></div>')


def recording_text(done: int, total: int) -> str:
    """Where the recording of plain decoding stands: `done` of its tokens against the answer's
    `total` (sampling may take plain decoding past it)."""
    count = f"{done} of {tokens_text(total)}" if done <= total else tokens_text(done)
    return f"Recording plain decoding of the same prompt for the race… {count}"


def recording_html(done: int, total: int) -> str:
    """The panel while plain decoding is recorded: one progress line (`recording_text`)."""
    return (f'<div class="compare race-recording"><div class="race-progress">'
            f'{recording_text(done, total)}</div></div>')
