"""The speedup estimate the playground shows on every speculative answer: how long plain decoding
(the target alone) would have taken for the same tokens, from the target's measured plain
decoding speed at this context length.

`measured_speedup` is the figure a compare run measures, on the same terms.
`PlainRate` holds one target's (one weights format's) seconds per plain-decoding token as a line
in the context length, fitted to observations: two runs at warm-up (`measure`, a short and a
long context) and then every plain run the app makes (`PlainRate.observe`). `estimate` compares
an answer's engine time with the plain time of its tokens: the answer's own prefill (the same
target forward either way) plus one plain step per further token at its context length.
Not here: running answers (`engine.py`) or drawing the tile (`ui_render.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import SamplingParams

BUCKET = 128  # context lengths within one bucket share one observation (the latest)
WARMUP_TOKENS = 32
WARMUP_LONG_CONTEXT = 480
WARMUP_TEXT = ("Speculative decoding lets a small draft model propose tokens that a large "
               "target model verifies in one forward pass. ")


@dataclass
class PlainRate:
    """Seconds per plain-decoding token against context length, for one loaded target."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (ctx, s)

    def observe(self, prompt_len: int, stats: dict[str, Any]) -> None:
        """Record a finished plain run (`RunStats.to_dict()`): its decode steps after prefill,
        at their mean context length. Runs of a single token have no decode step."""
        steps, decode_s = decode_steps(stats)
        if steps < 1 or decode_s <= 0:
            return
        context = prompt_len + (steps + 1) / 2
        self.points[int(context) // BUCKET] = (context, decode_s / steps)

    def seconds_per_token(self, context: float) -> float | None:
        """The least-squares line through the observed buckets at `context` (flat with one
        bucket, and below the smallest observed context; never below the fastest observation);
        None before any observation."""
        if not self.points:
            return None
        xs, ys = zip(*self.points.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        return max(my + slope * (max(context, min(xs)) - mx), min(ys))

    def decode_seconds(self, prompt_len: int, num_tokens: int) -> float | None:
        """Plain time of the steps after prefill that produce tokens 2..num_tokens: step i runs
        at context prompt_len + i, so on a line their sum is steps x the value at the mean."""
        steps = max(num_tokens - 1, 0)
        per_step = self.seconds_per_token(prompt_len + (steps + 1) / 2)
        return None if per_step is None else steps * per_step


def decode_steps(stats: dict[str, Any]) -> tuple[int, float]:
    """A plain run's decode steps after its prefill (one per token after the first) and their
    seconds."""
    return (int(stats.get("num_tokens", 0)) - 1,
            float(stats.get("elapsed_s", 0.0)) - float(stats.get("prefill_s", 0.0)))


@dataclass(frozen=True)
class Estimate:
    speedup: float  # estimated plain time / this answer's engine time
    plain_s: float
    prefill_s: float
    ms_per_token: float  # estimated plain step at this answer's mean context

    def explain(self, num_tokens: int, elapsed_s: float) -> str:
        return (f"Estimated, not measured: plain decoding of these {num_tokens} tokens would take "
                f"this answer's prefill {self.prefill_s:.2f} s + {max(num_tokens - 1, 0)} steps × "
                f"{self.ms_per_token:.1f} ms = {self.plain_s:.2f} s (the target's plain speed at "
                f"this context, measured at start-up and refreshed by every plain run), against "
                f"{elapsed_s:.2f} s taken. Tick 'compare with baseline' to measure it.")


def estimate(rate: PlainRate, prompt_len: int, stats: dict[str, Any]) -> Estimate | None:
    """Estimated speedup of a speculative answer's stats (`RunStats.to_dict()`) over plain
    decoding; None before the rate has an observation or the answer has engine time."""
    n, elapsed = int(stats.get("num_tokens", 0)), float(stats.get("elapsed_s", 0.0))
    decode = rate.decode_seconds(prompt_len, n)
    if decode is None or elapsed <= 0 or n < 1:
        return None
    prefill = float(stats.get("prefill_s", 0.0))
    per_token = decode / (n - 1) if n > 1 else 0.0
    return Estimate((prefill + decode) / elapsed, prefill + decode, prefill, 1000 * per_token)


def measured_speedup(stats: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The speedup a compare run measured: the baseline's decoding time per token (its steps
    after prefill) over this answer's tokens, plus this answer's own prefill, against this
    answer's engine time; None when the baseline decoded no step. The baseline runs second and
    finds the prompt in the prefix cache, so its own prefill is left out: both sides then count
    the same prompt work, as `estimate` does."""
    steps, decode = decode_steps(base)
    elapsed = float(stats.get("elapsed_s", 0.0))
    if steps < 1 or decode <= 0 or elapsed <= 0:
        return None
    n = int(stats.get("num_tokens", 0))
    return (float(stats.get("prefill_s", 0.0)) + max(n - 1, 0) * decode / steps) / elapsed


def measure(engine: Any, tokens: int = WARMUP_TOKENS) -> PlainRate:
    """Warm-up: plain-decode `tokens` tokens after a short prompt and after a long one (at most
    half the context window), EOS ignored, and fit the rate to both."""
    rate = PlainRate()
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    short = engine.encode("Hi")
    long_len = min(WARMUP_LONG_CONTEXT, engine.config.max_len // 2)
    text_ids = engine.tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)
    long = (text_ids * (long_len // len(text_ids) + 1))[:long_len]
    for ids in (short, long):
        if len(ids) + tokens < engine.config.max_len:
            rate.observe(len(ids), engine.generate(ids, params, None, None).stats.to_dict())
    return rate
