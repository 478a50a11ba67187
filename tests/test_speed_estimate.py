"""The speedup estimate (playground/speed_estimate.py): the verify-cost table measured at
start-up (rows and context interpolation, its build from timings), the estimate's arithmetic
(plain step = an answer's verify time over what those forwards cost in plain steps), that a
load slowing every forward alike leaves the estimate unchanged, the cases without one, and the
measured speedup of a compare run. Fixed numbers throughout: nothing here times anything; the
estimate against measured runs is `benchmarks/speedup_estimate.py`."""
from __future__ import annotations

from pathlib import Path

import pytest

from eagle_engine.events import StepEvent, TokenSpan, TreeNode
from playground.speed_estimate import (
    WARMUP_ROWS,
    CostTable,
    Verify,
    VerifyCost,
    cost_table,
    estimate,
    measure,
    measured_speedup,
    plain_step_ms,
    verify_of,
    warmup_tree,
)


def test_cost_table_interpolates_in_rows_and_goes_on_past_the_largest() -> None:
    table = CostTable(100.0, (1, 2, 4, 8), (1.1, 1.2, 1.6, 2.4))
    assert table.at(1) == pytest.approx(1.1) and table.at(0.5) == pytest.approx(1.1)
    assert table.at(3) == pytest.approx(1.4)
    assert table.at(8) == pytest.approx(2.4)
    assert table.at(12) == pytest.approx(3.2)  # the last segment's slope, 0.2 a row
    assert CostTable(10.0, (4,), (1.5,)).at(40) == pytest.approx(1.5)


def test_verify_cost_is_linear_in_the_context_between_tables_and_flat_outside() -> None:
    short = CostTable(20.0, (1, 9), (1.0, 2.0))
    long = CostTable(220.0, (1, 9), (1.0, 1.5))
    cost = VerifyCost((short, long))
    assert cost.ratio(9, 20) == pytest.approx(2.0)
    assert cost.ratio(9, 120) == pytest.approx(1.75)
    assert cost.ratio(5, 120) == pytest.approx((1.5 + 1.25) / 2)
    assert cost.ratio(9, 5) == pytest.approx(2.0) and cost.ratio(9, 4000) == pytest.approx(1.5)


@pytest.mark.parametrize("make, message", [
    (lambda: CostTable(1.0, (), ()), "as many ratios"),
    (lambda: CostTable(1.0, (2, 2), (1.0, 1.0)), "rows must increase"),
    (lambda: CostTable(1.0, (1, 2), (1.0, 0.0)), "positive"),
    (lambda: VerifyCost(()), "at least one table"),
    (lambda: VerifyCost((CostTable(9.0, (1,), (1.0,)), CostTable(3.0, (1,), (1.0,)))),
     "increasing contexts"),
    (lambda: cost_table(10.0, 0.0, [(1, 1.0)]), "positive plain step"),
    (lambda: cost_table(10.0, 4.0, []), "verify timings"),
])
def test_bad_tables_are_refused_by_name(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_cost_table_takes_the_median_per_row_count_and_never_falls_with_more_rows() -> None:
    timings = [(1, 5.0), (1, 5.4), (1, 50.0),  # a first call that paid for its shape
               (2, 6.0), (4, 5.8), (8, 9.0), (8, 11.0)]
    table = cost_table(30.0, 5.0, timings)
    assert table.rows == (1, 2, 4, 8)
    assert table.ratios == pytest.approx((5.4 / 5, 6.0 / 5, 6.0 / 5, 10.0 / 5))
    assert table.context == 30.0


def verifies(rows: list[int], ms_per_plain_step: float, cost: VerifyCost, prompt_len: int,
             tokens_per_step: int = 3) -> list[Verify]:
    """Verify forwards of a machine whose plain step takes `ms_per_plain_step` and whose
    verify costs exactly `cost`'s ratio of it."""
    return [Verify(ms_per_plain_step * cost.ratio(r, prompt_len + i * tokens_per_step), r,
                   i * tokens_per_step, 1) for i, r in enumerate(rows)]


def test_estimate_recovers_the_plain_step_from_the_answers_verify_forwards() -> None:
    cost = VerifyCost((CostTable(50.0, (1, 4, 8), (1.0, 1.3, 1.9)),))
    vs = verifies([4, 8, 6, 1], 7.0, cost, prompt_len=50)
    stats = {"num_tokens": 13, "prefill_s": 0.05, "elapsed_s": 0.07}
    est = estimate(cost, 50, vs, stats)
    assert est is not None
    assert est.ms_per_token == pytest.approx(7.0)
    assert est.plain_s == pytest.approx(0.05 + 12 * 0.007)
    assert est.speedup == pytest.approx((0.05 + 12 * 0.007) / 0.07)
    assert est.rows == pytest.approx(19 / 4)
    assert est.verify_ms == pytest.approx(sum(v.ms for v in vs) / 4)
    assert est.ratio == pytest.approx((1.3 + 1.9 + 1.6 + 1.0) / 4)
    text = est.explain(13, 0.07)
    assert "Estimated, not measured" in text and "12 steps × 7.0 ms" in text


def test_a_load_that_slows_every_forward_alike_leaves_the_estimate_unchanged() -> None:
    """The start-up measurement ran quiet; this answer ran with everything 2.5x slower (a
    browser on the same cores). A plain speed from start-up would read 2.5x too low; the
    ratio-based estimate reads the same speedup as on the quiet machine."""
    cost = VerifyCost((CostTable(20.0, (1, 8), (1.0, 1.8)), CostTable(420.0, (1, 8), (1.0, 1.4))))
    rows = [8, 5, 8, 3, 8, 8, 2, 8]
    quiet_stats = {"num_tokens": 25, "prefill_s": 0.04, "elapsed_s": 0.10}
    loaded_stats = {"num_tokens": 25, "prefill_s": 0.10, "elapsed_s": 0.25}
    quiet = estimate(cost, 200, verifies(rows, 4.0, cost, 200), quiet_stats)
    loaded = estimate(cost, 200, verifies(rows, 10.0, cost, 200), loaded_stats)
    assert quiet is not None and loaded is not None
    assert loaded.ms_per_token == pytest.approx(2.5 * quiet.ms_per_token)
    assert loaded.speedup == pytest.approx(quiet.speedup)


def test_the_plain_step_follows_the_context_the_answer_reached() -> None:
    """Ratios fall with the context (attention over a long context weighs on one row as on
    several): the same verify time at a longer context means a slower plain step."""
    cost = VerifyCost((CostTable(0.0, (1, 8), (1.0, 2.0)), CostTable(1000.0, (1, 8), (1.0, 1.0))))
    vs = [Verify(8.0, 8, 0, 1)]
    stats = {"num_tokens": 3, "prefill_s": 0.0, "elapsed_s": 0.01}
    assert estimate(cost, 0, vs, stats).ms_per_token == pytest.approx(4.0)
    assert estimate(cost, 500, vs, stats).ms_per_token == pytest.approx(8.0 / 1.5)
    assert estimate(cost, 1000, vs, stats).ms_per_token == pytest.approx(8.0)


def test_no_estimate_without_a_cost_a_verify_engine_time_or_with_a_shared_step() -> None:
    cost = VerifyCost((CostTable(0.0, (1,), (1.0,)),))
    stats = {"num_tokens": 5, "prefill_s": 0.01, "elapsed_s": 0.05}
    alone = [Verify(3.0, 1, 0, 1)]
    assert estimate(cost, 10, alone, stats) is not None
    assert estimate(None, 10, alone, stats) is None
    assert estimate(cost, 10, [], stats) is None
    assert estimate(cost, 10, alone, {"num_tokens": 0, "elapsed_s": 0.0}) is None
    assert estimate(cost, 10, alone + [Verify(3.0, 1, 1, 2)], stats) is None


def test_verify_of_reads_the_verify_phase_and_the_tree_of_an_eagle_iteration() -> None:
    tree = [TreeNode(5, "a", -1, 0, True, 1.0), TreeNode(6, "b", 0, 1, True, 0.9),
            TreeNode(7, "c", 0, 1, False, 0.1)]
    ev = StepEvent(3, "eagle", [TokenSpan(6, "b", "accepted", 1)], "b", tree=tree,
                   timings_ms={"draft": 1.0, "verify": 4.5, "extend": 0.5}, batch=1)
    assert verify_of(ev, 12) == Verify(4.5, 3, 12, 1)
    first = StepEvent(0, "eagle", [TokenSpan(5, "a", "target", 0)], "a",
                      timings_ms={"prefill": 30.0})
    plain = StepEvent(1, "ar", [TokenSpan(5, "a", "target", 0)], "a",
                      timings_ms={"decode": 3.0})
    assert verify_of(first, 0) is None and verify_of(plain, 1) is None


def test_plain_step_is_the_median_gap_between_decode_events() -> None:
    times = [0.050, 0.054, 0.058, 0.063, 0.067, 0.090]  # prefill, then steps (one slow)
    events = [StepEvent(i, "ar", [], "", stats={"elapsed_s": t}) for i, t in enumerate(times)]
    assert plain_step_ms(events) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="no step to time"):
        plain_step_ms(events[:2])


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


def test_measure_tables_every_warmup_tree_at_a_short_and_a_long_context(tmp_path: Path) -> None:
    """On a tiny engine: each warm-up tree verifies the rows it is named for, and the table
    has a ratio for each, at two contexts; without a head there is nothing to measure."""
    from tests.helpers import tiny_engine

    engine = tiny_engine(tmp_path, weight_scale=1.0, vocab_size=256)
    ids = engine.encode("Hi")
    for n in WARMUP_ROWS:
        events = engine.generate(ids, _params(), warmup_tree(n), "head", keep_events=True).events
        assert {v.rows for ev in events if (v := verify_of(ev, 0))} == {n}
    cost = measure(engine, "head", tokens=8)
    assert cost is not None and len(cost.tables) == 2
    assert cost.tables[0].context < cost.tables[1].context
    for table in cost.tables:
        assert table.rows == WARMUP_ROWS and all(r > 0 for r in table.ratios)
    assert measure(engine, None) is None


def _params():
    from eagle_engine.config import SamplingParams

    return SamplingParams(max_new_tokens=8, ignore_eos=True)
