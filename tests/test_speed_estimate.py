"""The speedup estimate (eagle_engine/speed_estimate.py): the plain-decoding line fitted to
observed plain runs, the plain time it predicts for an answer, and the estimate it gives. The
estimate against a measured compare run in the app is in tests/test_app_api.py."""
from __future__ import annotations

import pytest

from eagle_engine.speed_estimate import PlainRate, estimate, measured_speedup


def plain_stats(prompt_len: int, n: int, a: float, b: float, prefill: float) -> dict:
    """Stats of a plain run whose step i costs a + b * (prompt_len + i) seconds."""
    decode = sum(a + b * (prompt_len + i) for i in range(1, n))
    return {"num_tokens": n, "prefill_s": prefill, "elapsed_s": prefill + decode}


def test_line_through_two_contexts_predicts_the_plain_time() -> None:
    a, b = 0.010, 2e-5
    rate = PlainRate()
    rate.observe(30, plain_stats(30, 33, a, b, 0.05))
    rate.observe(480, plain_stats(480, 33, a, b, 0.4))
    exact = sum(a + b * (200 + i) for i in range(1, 100))
    assert rate.decode_seconds(200, 100) == pytest.approx(exact, rel=1e-9)
    assert rate.seconds_per_token(1000) == pytest.approx(a + b * 1000, rel=1e-9)


def test_latest_run_replaces_its_context_bucket_and_short_runs_are_ignored() -> None:
    rate = PlainRate()
    rate.observe(40, plain_stats(40, 20, 0.010, 0.0, 0.1))
    rate.observe(50, plain_stats(50, 20, 0.020, 0.0, 0.1))  # same bucket: replaces
    rate.observe(60, {"num_tokens": 1, "prefill_s": 0.1, "elapsed_s": 0.1})  # no decode step
    assert len(rate.points) == 1
    assert rate.seconds_per_token(5000) == pytest.approx(0.020)
    assert PlainRate().decode_seconds(10, 10) is None


def test_no_extrapolation_below_the_shortest_context_or_the_fastest_step() -> None:
    rate = PlainRate()
    rate.observe(300, plain_stats(300, 11, 0.0, 1e-4, 0.1))  # steep: 0.03 s at 300
    rate.observe(700, plain_stats(700, 11, 0.0, 1e-4, 0.1))
    assert rate.seconds_per_token(0) == pytest.approx(rate.seconds_per_token(305.5))
    rate.points[99] = (12_700.0, 0.001)  # a fast outlier far out: slope clamps at 0
    assert rate.seconds_per_token(0) >= min(y for _, y in rate.points.values())


def test_estimate_is_plain_time_over_the_answers_engine_time() -> None:
    rate = PlainRate()
    rate.observe(100, plain_stats(100, 41, 0.010, 0.0, 0.2))
    answer = {"num_tokens": 41, "prefill_s": 0.2, "elapsed_s": 0.3}
    est = estimate(rate, 100, answer)
    assert est is not None
    assert est.plain_s == pytest.approx(0.2 + 40 * 0.010)
    assert est.speedup == pytest.approx(0.6 / 0.3)
    assert est.ms_per_token == pytest.approx(10.0)
    assert "Estimated, not measured" in est.explain(41, 0.3)
    assert estimate(PlainRate(), 100, answer) is None
    assert estimate(rate, 100, {"num_tokens": 0, "elapsed_s": 0.0}) is None


def test_measured_speedup_counts_the_answers_prefill_on_both_sides() -> None:
    """The compare baseline finds the prompt cached (prefill ~0): its decoding rate over the
    answer's tokens plus the answer's own prefill, against the answer's time."""
    answer = {"num_tokens": 41, "prefill_s": 0.05, "elapsed_s": 0.25}
    base = {"num_tokens": 21, "prefill_s": 0.002, "elapsed_s": 0.202}  # 10 ms a step
    assert measured_speedup(answer, base) == pytest.approx((0.05 + 40 * 0.010) / 0.25)
    # tokens/s alone would credit the baseline with the prefill the answer paid for it
    assert measured_speedup(answer, base) > (41 / 0.25) / (21 / 0.202)
    assert measured_speedup(answer, {"num_tokens": 1, "prefill_s": 0.1, "elapsed_s": 0.1}) is None
    assert measured_speedup({"num_tokens": 0, "elapsed_s": 0.0}, base) is None
