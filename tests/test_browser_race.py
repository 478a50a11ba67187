"""The race in the browser, over a fake engine with fixed events (no model: the recorded times
are the events' own, so the replay's outcome is known): with "compare" on, the race plays by
itself when it arrives, EAGLE-3's pane advancing a verified step at a time; both panes end with
the same text (greedy); the pane whose recorded time is shorter finishes first, and the result
line says by how much; Replay plays it again. Nothing of the outcome (the verdict, the result,
each side's stats and finish, the measured speedup tile) shows before the replay's end, after
"compare" and after the Race button. The replay runs at 1×, 2× or 4× on the race's clock: 4×
ends as 1× does, a change mid-replay goes on from the clock's time (on the page's fake clock:
no test here reads the wall clock), and Regenerate during a replay shows the finished race. The
finished panel is compared with assets/screenshots/race_ref.png (UPDATE_SCREENSHOTS=1 rewrites
it).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from eagle_engine.config import EngineConfig
from eagle_engine.events import StepEvent, TokenSpan
from playground import layout
from tests.app_fixtures import ARTIFACTS, REPO

pytest_plugins = ["tests.app_fixtures"]
PLAIN_TOKENS = ["def", " f", "(x)", ":", "\n   ", " return", " x"]
# every class change of the race and its visible EAGLE-3 tokens, as the page drew them
RECORD_JS = """() => {
  window.__race = {classes: [], shown: []};
  new MutationObserver(() => {
    const race = document.querySelector('#compare-out .race');
    if (!race) return;
    window.__race.classes.push(race.className);
    window.__race.shown.push(
      race.querySelectorAll('#compare-eagle .spec-answer > :not(.race-hidden)').length);
  }).observe(document.querySelector('#compare-out'),
             {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
}"""
# at every change of the race, what of its outcome a visitor can see
OUTCOME_JS = """() => {
  const seen = (e) => !!e && e.checkVisibility({visibilityProperty: true});
  window.__outcome = [];
  new MutationObserver(() => {
    const race = document.querySelector('#compare-out .race');
    if (!race) return;
    window.__outcome.push({
      classes: race.className,
      verdict: seen(race.querySelector('.compare-verdict')),
      result: seen(race.querySelector('.race-result')),
      meta: [...race.querySelectorAll('.compare-meta')].some(seen),
      done: [...race.querySelectorAll('.race-done')].some((e) => seen(e) && e.textContent),
      held: !!document.querySelector('#tile-speedup .race-held'),
      tile: document.querySelector('#tile-speedup .tile-value').innerText});
  }).observe(document.querySelector('#compare-out'),
             {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
}"""
# presses Regenerate; what the race shows in that same moment
REGENERATE_JS = """() => {
  const seen = (e) => e.checkVisibility({visibilityProperty: true});
  const race = document.querySelector('#compare-out .race');
  document.querySelector('#regen').click();
  return {classes: race.className, verdict: seen(race.querySelector('.compare-verdict')),
          result: seen(race.querySelector('.race-result')),
          done: [...race.querySelectorAll('.race-done')].map((e) => seen(e) && e.textContent),
          clock: race.querySelector('.race-clock').textContent,
          finished: [...race.querySelectorAll('[data-lane]')].map(
            (e) => e.classList.contains('done'))};
}"""
RATIO = re.compile(r"\d+\.\d\d×")
# a pane's text as read: rejected drafts left out
TEXT_JS = """(e) => { const c = e.cloneNode(true);
  c.querySelectorAll('.tok-rej').forEach((t) => t.remove()); return c.textContent; }"""


def stats(t: float, prefill: float, n: int, steps: int) -> dict:
    return {"elapsed_s": t, "prefill_s": prefill, "num_tokens": n, "num_steps": steps,
            "step_tokens": n - 1, "tau": (n - 1) / steps if steps else 0.0,
            "tokens_per_s": n / t, "acceptance_per_depth": [0.5, 0.25]}


def eagle_events(scale: float) -> list[StepEvent]:
    """Three verified steps after the first token; times in seconds times `scale`."""
    t, p = TokenSpan, 0.1 * scale
    return [StepEvent(0, "eagle", [t(1, "def", "target", 0)], "def",
                      stats=stats(p, p, 1, 0)),
            StepEvent(1, "eagle", [t(2, " f", "accepted", 1), t(3, "(x)", "accepted", 2),
                                   t(4, ":", "bonus", 0)], " f(x):",
                      rejected=[t(9, " g", "rejected", 3)], stats=stats(0.3 * scale, p, 4, 1)),
            StepEvent(2, "eagle", [t(5, "\n   ", "accepted", 1), t(6, " return", "bonus", 0)],
                      "\n    return", stats=stats(0.5 * scale, p, 6, 2)),
            StepEvent(3, "eagle", [t(7, " x", "bonus", 0)], " x",
                      stats=stats(0.6 * scale, p, 7, 3), finished="length")]


def plain_events() -> list[StepEvent]:
    """One token a step, 0.12 s apart, after a cached prompt's 0.01 s prefill."""
    n = len(PLAIN_TOKENS)
    return [StepEvent(i, "ar", [TokenSpan(i + 1, tok, "target", 0)], tok,
                      stats=stats(0.01 + 0.12 * i, 0.01, i + 1, i),
                      finished="length" if i == n - 1 else None)
            for i, tok in enumerate(PLAIN_TOKENS)]


class RaceEngine:
    """Just enough engine for the app: one head; fixed EAGLE-3 events, or fixed plain ones."""

    config = EngineConfig(target="fake", dtype="fp32")
    tuned = None
    default_tree = config.default_tree

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.trees: list[Any] = []  # the tree of each request, as the page sent it

    def head_info(self) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(name="eagle3-aux-1layer", num_layers=1, use_aux=True,
                                draft_vocab_size=8)]

    def encode(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3]

    def stream(self, ids: list[int], params: Any, tree: Any, head: str | None
               ) -> Iterator[StepEvent]:
        self.trees.append(tree)
        yield from eagle_events(self.scale) if head else plain_events()


@pytest.fixture
def race_page(chromium: Any, request: pytest.FixtureRequest) -> Iterator[tuple[Any, RaceEngine]]:
    """A page (a `PageProbe`), with motion allowed, on the app over `RaceEngine(request.param)`,
    and that engine."""
    import gradio as gr

    from tests.app_fixtures import open_page

    engine = RaceEngine(request.param)
    demo = layout.build_demo([engine])
    demo.queue(max_size=16, default_concurrency_limit=1)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True,
                            theme=gr.themes.Soft(), css_paths=[layout.CSS])  # as `app.main`
    probe = open_page(chromium, url, reduced_motion="no-preference")
    yield probe, engine
    probe.page.context.close()
    demo.close()


def expect() -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect


@pytest.mark.parametrize("race_page, first, result", [
    (1.0, "eagle", "EAGLE-3 finished 0.22 s earlier (1.37× faster)."),
    (2.0, "plain", "Plain decoding finished 0.28 s earlier (EAGLE-3 ran at 0.77×)."),
], indirect=["race_page"], ids=["eagle-faster", "eagle-slower"])
def test_the_race_plays_from_the_recorded_times(race_page: tuple[Any, RaceEngine], first: str,
                                                result: str) -> None:
    probe, ex = race_page[0], expect()
    page = probe.page
    page.locator("#compare input").check()
    page.evaluate(RECORD_JS)
    page.fill("#prompt textarea", "hello")
    page.click("#send")
    race = page.locator("#compare-out .race")
    ex(race).to_have_class("compare race finished", timeout=30_000)
    data = json.loads(race.get_attribute("data-race"))
    ends = {name: lane["t"][-1] + lane["offset"] for name, lane in data.items()}
    assert min(ends, key=ends.get) == first
    assert race.get_attribute("data-order") == ",".join(sorted(ends, key=ends.get))
    ex(race.locator(".race-result")).to_have_text(result)
    ex(race.locator(".race-clock")).to_have_text(f"{max(ends.values()):.2f} s")
    eagle, plain = (race.locator(f"#compare-{lane} .spec-answer") for lane in ("eagle", "base"))
    assert eagle.evaluate(TEXT_JS) == plain.evaluate(TEXT_JS) == "".join(PLAIN_TOKENS)
    assert race.locator(".race-hidden").count() == 0
    seen = page.evaluate("window.__race")
    assert any("playing" in c for c in seen["classes"]), "the race arrived and played"
    shown = [n for n, c in zip(seen["shown"], seen["classes"]) if "playing" in c]
    steps = set(data["eagle"]["n"]) | {0}
    assert shown and set(shown) <= steps, (shown, steps)  # a verified step at a time
    assert shown == sorted(shown)
    done = {lane: float(race.locator(f"[data-lane={lane}]").get_attribute("data-done-at"))
            for lane in ("eagle", "plain")}
    assert done[first] <= min(done.values())
    page.evaluate(RECORD_JS)
    race.locator(".race-play").click()  # Replay: plays again, in the page alone
    ex(race).to_have_class("compare race finished", timeout=30_000)
    assert any("playing" in c for c in page.evaluate("window.__race")["classes"])
    assert race.get_attribute("data-order") == ",".join(sorted(ends, key=ends.get))
    assert probe.external_requests == [] and probe.console_errors == []
    if first == "eagle":
        from tests.test_browser import matches_reference
        matches_reference(page, page.locator("#compare-out"), "race")


SIDEBAR_ORDER = ["spec", "aux", "layers", "head-note", "topk", "num-steps", "draft-tokens",
                 "advanced-tree", "temperature", "top-p", "max-new-tokens", "seed", "weights",
                 "compare"]
ADVANCED = ["min-score", "context-drafts", "context-extra", "step-cut"]


@pytest.mark.parametrize("race_page", [1.0], indirect=True)
def test_sidebar_leads_with_the_head_and_the_trees_shape(race_page: tuple[Any, RaceEngine]
                                                        ) -> None:
    """The head (aux states, draft layers), topk, steps and draft tokens come first; the finer
    tree settings wait, with their notes, in a closed "Advanced tree" group, before sampling
    and the target's weights."""
    (probe, engine), ex = race_page, expect()
    page = probe.page
    page.fill("#prompt textarea", "hello")  # the closed group's settings reach the engine
    page.click("#send")
    ex(page.locator("#status")).to_contain_text("Done", timeout=30_000)
    assert engine.trees == [RaceEngine.default_tree]
    ids = page.locator("#sidebar [id]").evaluate_all("(es) => es.map((e) => e.id)")
    shown = [i for i in ids if i in SIDEBAR_ORDER]
    # one target here: no "Target weights" choice to draw
    assert shown == [i for i in SIDEBAR_ORDER if i != "weights"], shown
    advanced = page.locator("#advanced-tree")
    for elem_id in ADVANCED:  # closed: Gradio draws a closed group's contents once opened
        ex(page.locator(f"#{elem_id}")).to_be_hidden()
    advanced.get_by_text("Advanced tree").click()
    for elem_id in ADVANCED:
        ex(page.locator(f"#{elem_id}")).to_be_visible()
    inside = advanced.locator("[id]").evaluate_all("(es) => es.map((e) => e.id)")
    assert [i for i in inside if i in ADVANCED] == ADVANCED
    ex(page.locator("#min-score")).to_contain_text("an unsure draft then costs no verify row")
    ex(page.locator("#step-cut")).to_contain_text("a deeper step then runs where it can pay")


def assert_outcome_only_at_the_end(samples: list[dict]) -> None:
    """While the race waits or plays nothing of its outcome shows, the tile's measured speedup
    held (sent, hidden); once it finished, all of it shows."""
    hidden = [x for x in samples if re.search(r"\b(waiting|playing)\b", x["classes"])]
    assert any("playing" in x["classes"] and x["held"] for x in hidden), samples
    for x in hidden:
        assert not (x["verdict"] or x["result"] or x["meta"] or x["done"]), x
        assert not RATIO.search(x["tile"]), x
    last = samples[-1]
    assert last["classes"] == "compare race finished", samples
    assert last["verdict"] and last["result"] and last["meta"] and last["done"], last
    assert RATIO.fullmatch(last["tile"]), last


@pytest.mark.parametrize("race_page", [1.0], indirect=True)
def test_no_verdict_before_the_replays_end(race_page: tuple[Any, RaceEngine]) -> None:
    """With "compare" on, then with the Race button: the status line after the recording says
    nothing of the outcome, and the panel and the tiles show it only when both sides have
    finished in the replay; on a page that asks for reduced motion, at once."""
    probe, ex = race_page[0], expect()
    page = probe.page
    race = page.locator("#compare-out .race")
    page.locator("#compare input").check()
    page.evaluate(OUTCOME_JS)
    page.fill("#prompt textarea", "hello")
    page.click("#send")
    ex(race).to_have_class("compare race finished", timeout=30_000)
    assert_outcome_only_at_the_end(page.evaluate("window.__outcome"))
    ex(page.locator("#tile-speedup .race-held")).to_have_text(RATIO)
    page.locator("#compare input").uncheck()
    page.evaluate(OUTCOME_JS)
    page.click("#race-btn")
    ex(page.locator("#status")).to_have_text("Race recorded · see the replay below.",
                                             timeout=30_000)
    ex(race).to_have_class("compare race finished", timeout=30_000)
    assert_outcome_only_at_the_end(page.evaluate("window.__outcome"))
    ex(race.locator(".race-result")).to_be_visible()
    assert "×" not in page.locator("#status").inner_text()
    page.emulate_media(reduced_motion="reduce")  # the race shows finished, its outcome at once
    page.evaluate(OUTCOME_JS)
    page.click("#race-btn")
    ex(page.locator("#status")).to_have_text("Race recorded · see the replay below.",
                                             timeout=30_000)
    ex(race).to_have_class("compare race")
    for shown in (".compare-verdict", ".race-result", ".race-done", ".compare-meta"):
        ex(race.locator(shown).first).to_be_visible()
    ex(page.locator("#tile-speedup .race-held")).to_be_visible()
    assert not any("playing" in x["classes"] for x in page.evaluate("window.__outcome"))
    assert probe.external_requests == [] and probe.console_errors == []


def race_end(race: Any) -> dict:
    """What a finished replay ends on: the order, the clock, each side's finish, the result."""
    return {"order": race.get_attribute("data-order"),
            "clock": race.locator(".race-clock").inner_text(),
            "done": race.locator(".race-done").all_inner_texts(),
            "result": race.locator(".race-result").inner_text()}


def clock_s(race: Any) -> float:
    return float(race.locator(".race-clock").inner_text().removesuffix(" s"))


@pytest.mark.parametrize("race_page", [1.0], indirect=True)
def test_the_replay_runs_at_the_chosen_speed_on_the_races_clock(
        race_page: tuple[Any, RaceEngine]) -> None:
    """A 4× replay ends as the 1× one did; a change of speed mid-replay goes on from the clock's
    time (the page's clock is Playwright's fake one there: 16 ms a frame); Regenerate during a
    replay shows the finished race at once, and the next race keeps the chosen speed
    (UPDATE_SCREENSHOTS=1 writes the race mid-way to assets/screenshots/race_midway.png)."""
    probe, ex = race_page[0], expect()
    page = probe.page
    race = page.locator("#compare-out .race")
    speeds = race.locator(".race-speed button")
    page.locator("#compare input").check()
    page.fill("#prompt textarea", "hello")
    page.click("#send")
    ex(race).to_have_class("compare race finished", timeout=30_000)
    at_1x = race_end(race)
    assert at_1x["order"] == "eagle,plain" and at_1x["clock"] == "0.82 s", at_1x
    ex(speeds).to_have_text(["1×", "2×", "4×"])
    race.locator(".race-speed [data-speed='4']").click()
    assert [b.get_attribute("aria-pressed") for b in speeds.all()] == ["false", "false", "true"]
    page.evaluate(RECORD_JS)
    race.locator(".race-play").click()
    ex(race).to_have_class("compare race finished", timeout=30_000)
    assert any("playing" in c for c in page.evaluate("window.__race")["classes"])
    assert race_end(race) == at_1x
    page.clock.install()
    page.clock.pause_at(page.evaluate("Date.now()") / 1000 + 1)  # no frame runs unless told
    race.locator(".race-speed [data-speed='1']").click()
    race.locator(".race-play").click()
    page.clock.run_for(16 * 13)  # the first frame starts the clock, 12 more move it
    at_switch = clock_s(race)
    assert 0.15 <= at_switch <= 0.25, at_switch
    race.locator(".race-speed [data-speed='4']").click()
    page.clock.run_for(16 * 4)
    moved = clock_s(race) - at_switch
    # 4 frames of 16 ms at 4×: 0.256 s (at 1×: 0.064 s; from the start at 4×: 1.024 s)
    assert 0.2 <= moved <= 0.3, moved
    assert "playing" in race.get_attribute("class")
    ex(race.locator(".compare-verdict")).to_be_hidden()
    shot = race.screenshot(animations="disabled", caret="hide")  # mid-way, as a visitor sees it
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "race_midway.png").write_bytes(shot)
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        (REPO / "assets" / "screenshots" / "race_midway.png").write_bytes(shot)
    # Regenerate ends the replay: the finished race shows at once, before the server answers
    assert page.evaluate(REGENERATE_JS) == {"classes": "compare race", "verdict": True,
                                            "result": True, "done": at_1x["done"],
                                            "clock": at_1x["clock"], "finished": [True, True]}
    page.clock.resume()
    ex(race).to_have_class("compare race finished", timeout=30_000)  # the regenerated race
    assert [b.get_attribute("aria-pressed") for b in speeds.all()] == ["false", "false", "true"]
    assert race_end(race) == at_1x
    assert probe.external_requests == [] and probe.console_errors == []
