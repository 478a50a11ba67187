"""A visitor's first answer in the browser while the start-up measurement is still running
(`playground/background.py`, its measurement stubbed to go on until released): the answer
streams, the speedup tile says "estimate after start-up measurement" instead of a number, the
sidebar says the measurement runs between visitors' answers; a page opened after it ended shows
no such line. Over the race's fake engine (`tests/test_browser_race.py`): no model runs.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from playground import background, layout, serving
from tests.test_browser_race import RaceEngine
from tests.test_startup_work import Held

pytest_plugins = ["tests.app_fixtures"]


@pytest.fixture
def measuring_app(chromium: Any, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[tuple[str, background.StartupWork, Held]]:
    import gradio as gr

    held = Held()
    monkeypatch.setattr(background, "measure", held.measure)
    engine, worker, visitors = RaceEngine(1.0), serving.EngineThread(), serving.Visitors()
    costs: dict = {}
    work = background.StartupWork([engine], "eagle3-aux-1layer", worker, visitors, costs,
                                  tune=False)
    demo = layout.build_demo([engine], worker, costs=costs, visitors=visitors, startup=work)
    demo.queue(max_size=16, default_concurrency_limit=1)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True,
                            theme=gr.themes.Soft(), css_paths=[layout.CSS])  # as `app.main`
    work.start()
    try:
        yield url, work, held
    finally:
        held.release.set()
        demo.close()


def test_the_first_answer_comes_before_the_start_up_measurement_ends(
        chromium: Any, measuring_app: tuple[str, background.StartupWork, Held]) -> None:
    from playwright.sync_api import expect

    from tests.app_fixtures import open_page

    url, work, held = measuring_app
    probe = open_page(chromium, url)
    page = probe.page
    expect(page.locator("#engine-status")).to_contain_text(
        "Start-up measurement measuring the fp32 target's verify cost, between visitors' "
        "answers (yours come first)")
    page.fill("#prompt textarea", "Write a function.")
    page.click("#send")
    expect(page.locator("#status")).to_contain_text("Done", timeout=60_000)
    expect(page.locator('#chat [data-testid="bot"]').last).to_contain_text("return x")
    expect(page.locator("#tile-speedup")).to_contain_text("estimate after start-up measurement")
    assert not work.done.is_set() and held.units > 0
    held.release.set()
    assert work.done.wait(30)
    page.reload()
    expect(page.locator("#engine-status")).to_contain_text("Target")
    expect(page.locator("#engine-status")).not_to_contain_text("Start-up measurement")
    assert probe.console_errors == []
    page.context.close()


def test_a_cpu_where_eagle3_cannot_pay_says_why_under_the_tiles(chromium: Any) -> None:
    """A start-up measurement in which every tree ran slower than plain decoding (a Zen 1's
    figures, `test_startup_work.slower_tuned`) and its verify costs: the answer's tiles carry
    the sentence that says why (UPDATE_SCREENSHOTS=1 writes docs/screenshots/slower_note.png)."""
    import os

    import gradio as gr
    from playwright.sync_api import expect

    from tests.app_fixtures import ARTIFACTS, REPO, open_page
    from tests.test_startup_work import COST, slower_tuned

    engine = RaceEngine(1.0)
    engine.tuned = slower_tuned("fp32", "eagle3-aux-1layer")
    demo = layout.build_demo([engine], costs={"fp32": COST})
    demo.queue(max_size=16, default_concurrency_limit=1)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True,
                            theme=gr.themes.Soft(), css_paths=[layout.CSS])
    try:
        page = open_page(chromium, url).page
        page.fill("#prompt textarea", "Write a function.")
        page.click("#send")
        expect(page.locator("#status")).to_contain_text("Done", timeout=60_000)
        note = page.locator("#tiles-note")
        expect(note).to_be_visible()
        expect(note).to_contain_text("EAGLE-3 runs at 0.87× plain decoding (measured at start-up")
        expect(note).to_contain_text("each draft token 0.58 of a step")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = page.locator("#tiles").screenshot(path=str(ARTIFACTS / "slower_note.png"))
        if os.environ.get("UPDATE_SCREENSHOTS") == "1":
            (REPO / "docs" / "screenshots" / "slower_note.png").write_bytes(shot)
        page.context.close()
    finally:
        demo.close()
