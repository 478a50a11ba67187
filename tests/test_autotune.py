"""`autotune`: the measured choice of weights and tree, cached per machine.

On tiny engines: `tune` measures plain decoding and the candidate trees, keeps only trees whose
greedy output equals plain decoding, orders the weight formats by speed, caches the result
(a second call reads it without decoding) and `apply` gives each engine its chosen tree. On
fixed samples: `choose` keeps the static default tree unless another wins beyond the noise.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from eagle_engine.config import TreeParams
from eagle_engine.tools import autotune
from tests.helpers import tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture()
def quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "NEW_TOKENS", 12)
    monkeypatch.setattr(autotune, "STARVED_BELOW", 0.0)  # other tests may load the cores
    monkeypatch.setattr(autotune, "FIRST_ANSWER", 8)
    monkeypatch.setattr(autotune, "CANDIDATES", {
        "q4": (TreeParams(2, 2, 3), TreeParams(1, 2, 3, context_extra=8, step_cut=0.5)),
        "dense": (TreeParams(4, 3, 8), TreeParams(2, 2, 4, min_score=0.3))})


DENSE = [TreeParams(4, 3, 8), TreeParams(2, 2, 4, min_score=0.3)]  # the candidates above


@pytest.mark.usefixtures("quick")
def test_tune_measures_caches_and_applies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    engine = tiny_engine(tmp_path, max_len=128, vocab_size=256)
    tuned = autotune.tune([engine], "head")
    m = tuned.measured["fp32"]
    assert tuned.order == ["fp32"] and m.plain_tok_s > 0
    assert set(m.tree_tok_s) | set(m.incorrect) == {autotune.tree_label(t) for t in DENSE}
    assert not m.incorrect  # greedy speculation equals plain decoding on every tree
    best = m.best_tree()
    assert best in DENSE  # min_score included
    assert autotune.cache_path([engine], "head").exists()
    assert f"tree {autotune.tree_label(best)}: " in tuned.summary("fp32")
    # a tree's speed depends on how sure a context chain must be to pass the budget
    with monkeypatch.context() as m_sure:
        m_sure.setattr(autotune, "CHAIN_SURE", autotune.CHAIN_SURE + 0.1)
        assert not autotune.cache_path([engine], "head").exists()

    def no_decoding(*_: object) -> None:
        raise AssertionError("a cached measurement decoded again")
    monkeypatch.setattr(autotune, "speeds", no_decoding)
    again = autotune.tune([engine], "head")
    assert again.measured["fp32"].tree_tok_s == m.tree_tok_s
    assert autotune.apply([engine], again) == [engine]
    assert engine.default_tree == best and engine.tuned is again
    out = engine.generate(engine.encode("hi"), autotune.SamplingParams(max_new_tokens=4),
                          head="head", keep_events=True)  # the engine's tree: the measured one
    sizes = {len(ev.tree) for ev in out.events if ev.tree}
    assert max(sizes) <= best.num_draft_tokens
    assert best.min_score > 0 or sizes == {best.num_draft_tokens}


@pytest.mark.usefixtures("quick")
def test_incorrect_trees_are_never_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A tree whose output differs from plain decoding (simulated) is reported and skipped."""
    engine = tiny_engine(tmp_path, max_len=128, vocab_size=256)
    real = engine.generate

    def wrong_for_k2(ids, params, tree=None, head=None, **kw):  # noqa: ANN001, ANN202
        out = real(ids, params, tree, head, **kw)
        if tree == DENSE[1]:
            out.token_ids = [t + 1 for t in out.token_ids]
        return out
    monkeypatch.setattr(engine, "generate", wrong_for_k2)
    m = autotune.tune([engine], "head").measured["fp32"]
    assert m.incorrect == [autotune.tree_label(DENSE[1])]
    assert m.best_tree() == DENSE[0]


def test_retrained_weights_under_the_same_name_are_measured_anew(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """The cache key holds the head's file bytes: new weights in a bundled head's directory (a
    retrained default head) miss the old measurement; a hub id is keyed by its name."""
    import shutil

    from eagle_engine import engine as engine_mod

    assets = tmp_path / "heads"
    shutil.copytree(engine_mod.ASSETS / "eagle3-aux-1layer", assets / "h")
    monkeypatch.setattr(engine_mod, "ASSETS", assets)
    before = autotune.head_digest("h")
    assert autotune.head_digest("h") == before
    weights = assets / "h" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert autotune.head_digest("h") != before
    assert autotune.head_digest("org/some-head") == "org/some-head"
    assert autotune.head_digest(None) is None


DEFAULT = [100.0, 120.0, 90.0, 110.0, 105.0, 95.0]  # decoding tok/s, paired samples
NOISY = [r * f for r, f in zip(DEFAULT, (1.10, 0.94, 1.08, 0.97, 1.09, 0.98))]  # +2.4% +- 2.8%
STEADY = [r * f for r, f in zip(DEFAULT, (1.03, 1.04, 1.02, 1.03, 1.05, 1.03))]  # +3.3% +- 0.4%
AHEAD = [r * 1.2 for r in DEFAULT]


def test_the_static_default_stays_unless_another_tree_wins_beyond_the_noise() -> None:
    """A tree whose mean is higher only within the noise of the paired samples (three standard
    errors: five candidates face the default) does not replace the default; a steadily faster
    one does, and of two such the larger gain wins; a tree steadily slower never does. Without
    the default (its output was wrong) the fastest wins."""
    assert autotune.mean_rate(NOISY) > autotune.mean_rate(DEFAULT)
    assert autotune.paired_gain(NOISY, DEFAULT) == pytest.approx((0.0243, 0.0283), abs=1e-4)
    assert autotune.paired_gain(STEADY, DEFAULT) == pytest.approx((0.0327, 0.0041), abs=1e-4)
    assert autotune.paired_gain([1.0], [2.0])[1] == float("inf")  # one pair: no noise estimate
    assert autotune.choose("default", {"default": DEFAULT, "noisy": NOISY}) == "default"
    assert autotune.choose("default", {"default": DEFAULT, "noisy": NOISY,
                                       "steady": STEADY}) == "steady"
    assert autotune.choose("default", {"default": DEFAULT, "steady": STEADY,
                                       "ahead": AHEAD}) == "ahead"
    slower = [r * 0.97 for r in DEFAULT]
    assert autotune.choose("default", {"slower": slower, "default": DEFAULT}) == "default"
    assert autotune.choose("default", {"noisy": NOISY, "steady": STEADY}) == "steady"
    # +2.4% at 2.6 standard errors: beyond two, within the three that five candidates need
    near = [r * f for r, f in zip(DEFAULT, (1.05, 1.0, 1.045, 0.995, 1.035, 1.02))]
    gain, noise = autotune.paired_gain(near, DEFAULT)
    assert 2 * noise < gain < 3 * noise
    assert autotune.choose("default", {"default": DEFAULT, "near": near}) == "default"


def test_measure_judges_against_the_static_default_not_the_last_choice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose tree an earlier `tune` replaced is judged again against its config's
    static default; a noisy lead neither keeps the old choice nor makes a new one."""
    engine = tiny_engine(tmp_path, max_len=128, vocab_size=256)
    static = engine.config.default_tree
    other = TreeParams(2, 2, 4, min_score=0.3)
    engine.default_tree = other  # an earlier measurement chose it
    samples = {autotune.tree_label(static): DEFAULT, autotune.tree_label(other): NOISY}
    monkeypatch.setattr(autotune, "speeds", lambda *_: (DEFAULT, samples, []))
    m = autotune.measure(engine, "head", [static, other], [[1, 2, 3]], 2)
    assert m.chosen == autotune.tree_label(static) and m.best_tree() == static
    assert m.tree_tok_s[autotune.tree_label(other)] > m.tree_tok_s[m.chosen]


def test_a_tree_round_trips_through_its_spec_and_its_label_names_each_setting() -> None:
    tree = TreeParams(3, 2, 5, min_score=0.1, context_extra=8, step_cut=0.5)
    assert TreeParams.parse(tree.spec()) == tree
    assert autotune.tree_label(tree) == "k3 s2 n5 min0.1 step0.5 +ctx+8"
    assert autotune.tree_label(TreeParams(2, 1, 3, context_drafts=False)) == "k2 s1 n3"


class BusyClock:
    """A `CpuClock` on a machine whose other work takes half of the cores."""

    def __enter__(self) -> BusyClock:
        return self

    def __exit__(self, *exc: object) -> None:
        from eagle_engine.cpu_share import CpuShare

        self.reading = CpuShare(cpu_s=1.0, wall_s=1.0, threads=2)


@pytest.mark.usefixtures("quick")
def test_a_measurement_under_load_keeps_the_static_default_and_caches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the process gets half of its cores, `tune` stops, says so, caches nothing, and
    `apply` leaves the engine's static tree; every decoding went through `call`."""
    engine = tiny_engine(tmp_path, max_len=128, vocab_size=256)
    static = engine.default_tree
    monkeypatch.setattr(autotune, "CpuClock", BusyClock)
    monkeypatch.setattr(autotune, "STARVED_BELOW", 0.8)
    units = []
    tuned = autotune.tune([engine], "head", call=lambda unit: units.append(unit) or unit())
    assert tuned.loaded and tuned.cpu_share == 0.5 and len(units) == 1  # stopped at once
    assert not autotune.cache_path([engine], "head").exists()
    assert autotune.apply([engine], tuned) == [engine]
    assert engine.default_tree == static and engine.tuned is tuned
    assert "machine was busy" in tuned.summary("fp32") and "50%" in tuned.summary("fp32")
    assert tuned.weights_info() is None


def test_the_meter_judges_the_share_once_enough_is_measured() -> None:
    from eagle_engine.cpu_share import CpuShare

    class Engine:  # its decoding's readings are the `Clock`'s
        scheduler = type("S", (), {"governor": None})

        def generate(self) -> str:
            return "out"

    readings = iter([])
    meter, engine = autotune.Meter(), Engine()

    class Clock:
        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc: object) -> None:
            self.reading = next(readings)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(autotune, "CpuClock", Clock)
        readings = iter([CpuShare(0.4, 0.4, 2)])  # 0.8 core-seconds: not yet judged
        assert meter.generate(engine) == "out" and meter.share == 0.5
        readings = iter([CpuShare(0.4, 0.4, 2)])  # 1.6 core-seconds at half: loaded
        with pytest.raises(autotune.Loaded, match="got 50% of its cores"):
            meter.generate(engine)
        quiet = autotune.Meter()
        readings = iter([CpuShare(3.9, 2.0, 2)])
        assert quiet.generate(engine) == "out" and quiet.share == pytest.approx(0.975)
