"""The race in the browser, over a fake engine with fixed events (no model: the recorded times
are the events' own, so the replay's outcome is known): with "compare" on, the race plays by
itself when it arrives, EAGLE-3's pane advancing a verified step at a time; both panes end with
the same text (greedy); the pane whose recorded time is shorter finishes first, and the result
line says by how much; Replay plays it again. The finished panel is compared with
assets/screenshots/race_ref.png (UPDATE_SCREENSHOTS=1 rewrites it).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from eagle_engine.config import EngineConfig
from eagle_engine.events import StepEvent, TokenSpan
from playground import layout

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
