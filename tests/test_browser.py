"""Browser tests: Debian's Chromium (pip playwright, `executable_path`) on the app launched by
tests/app_fixtures.py. A person's path through the page: it loads offline with a legend and a
sidebar (closed on a phone), a typed prompt streams an answer with the token kinds in the
legend's styles, the sidebar controls show their effect, the step plot counts whole steps, Stop
freezes the answer without an error badge and the page keeps working (Enter sends, Shift+Enter
breaks the line), the next message can be typed while an answer streams, Clear during an answer
leaves an empty page, bad input gives a toast and a status line without an error badge, two
tabs keep their own chats, copying an answer copies its text, another target without heads
answers alone, the race of an answer and its plain decoding replays with the shorter recorded
run first, Continue grows an answer cut at its max new tokens in the same turn. On a phone the
message box, Send and the speed tiles are on the first screen and a tap on a token shows its
details. The token pane is compared with assets/screenshots/token_pane_ref.png, a rejected
line-break draft leaves the answer's lines as they are, and a code answer shows an estimated
speedup and reads as code, then the Race button measures it (UPDATE_SCREENSHOTS=1 rewrites the
token pane reference and the README's shots: app_answer.png, race.png, sidebar.png). The race
over fixed timings and the sidebar's order: tests/test_browser_race.py.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.app_fixtures import STORY

if TYPE_CHECKING:
    from tests.app_fixtures import AppServer, PageProbe

pytest_plugins = ["tests.app_fixtures"]
REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "assets" / "screenshots"
ARTIFACTS = REPO / "tests" / "artifacts"
UPDATE = os.environ.get("UPDATE_SCREENSHOTS") == "1"
DONE_TIMEOUT_MS = 120_000
PIXEL_THRESHOLD = 16  # max channel difference that counts as a changed pixel
MAX_CHANGED_FRACTION = 0.001
# Records, in the page, when Send is pressed and when the first token span appears in the chat.
TTFT_JS = """() => {
  window.__ttft = {};
  const chat = document.querySelector('#chat');
  const before = chat.querySelectorAll('.tok').length;
  document.querySelector('#send').addEventListener('click',
      () => { window.__ttft.click = performance.now(); }, {capture: true, once: true});
  new MutationObserver((_, obs) => {
    if (chat.querySelectorAll('.tok').length > before) {
      window.__ttft.token = performance.now(); obs.disconnect(); }
  }).observe(chat, {childList: true, subtree: true, characterData: true});
}"""


def expect() -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect


def set_number(page: Any, elem_id: str, value: float) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def ask(page: Any, prompt: str, max_new_tokens: int) -> None:
    set_number(page, "max-new-tokens", max_new_tokens)
    page.fill("#prompt textarea", prompt)
    page.click("#send")


def wait_done(page: Any) -> None:
    expect()(page.locator("#status")).to_contain_text("Done", timeout=DONE_TIMEOUT_MS)


def last_answer(page: Any) -> Any:
    return page.locator('#chat [data-testid="bot"]').last


def test_page_loads_offline_with_legend_and_sidebar(probe: PageProbe) -> None:
    from playground.layout import NEW_TOKENS

    page = probe.page
    assert page.title() == "EAGLE-3 Playground"
    legend = page.locator("#legend")
    for label in ("accepted draft", "draft from context", "rejected draft",
                  "target token (bonus)", "target token"):
        expect()(legend).to_contain_text(label)
    expect()(page.locator("#legend-row #show-rej input")).to_be_checked()  # beside the legend
    expect()(page.locator("#intro")).to_contain_text("Hover a token for its step and depth",
                                                     use_inner_text=True)
    expect()(page.locator("#intro .on-touch")).to_be_hidden()  # a mouse hovers
    expect()(page.locator("#continue")).to_be_hidden()  # no answer was cut
    status = page.locator("#engine-status")
    expect()(status).to_contain_text("Device cpu")
    expect()(status).to_contain_text("CUDA graphs off")
    expect()(page.locator("#max-new-tokens input[type=number]")).to_have_value(str(NEW_TOKENS))
    toggle = page.get_by_label("Toggle Sidebar")
    toggle.click()
    page.wait_for_function("document.querySelector('#engine-status')"
                           ".getBoundingClientRect().right <= 0")
    toggle.click()
    page.wait_for_function("document.querySelector('#engine-status')"
                           ".getBoundingClientRect().left >= 0")
    assert probe.external_requests == [] and probe.console_errors == []


def test_another_target_without_heads_answers_alone(
        chromium: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--target` another model (here the bundled one's HF directory) and no `--draft`: the
    bundled heads stay out, the page offers the target alone with the draft settings off, and
    an example sent from it is answered. Without a head "Draft layers" once lost its choices
    and Gradio refused every Send with an "Error" toast."""
    from eagle_engine.models.loader import resolve_target
    from playground.layout import EXAMPLES
    from tests.app_fixtures import open_page, running_app

    args = ["--target", str(resolve_target("bundled")), "--no-tune", "--max-len", "512"]
    with running_app(tmp_path_factory, args) as (url, _):
        probe = open_page(chromium, url)
        page, ex = probe.page, expect()
        ex(page.locator("#spec input")).not_to_be_checked()
        ex(page.locator("#spec input")).to_be_disabled()
        ex(page.locator("#head-note")).to_contain_text("No draft head is loaded")
        ex(page.locator("#topk input[type=number]")).to_be_disabled()
        set_number(page, "max-new-tokens", 16)
        page.get_by_text(EXAMPLES[-1]).click()
        ex(page.locator("#prompt textarea")).to_have_value(EXAMPLES[-1])
        page.click("#send")
        wait_done(page)
        ex(page.locator("#status")).to_contain_text("baseline")
        ex(last_answer(page)).to_contain_text("Photosynthesis")
        assert page.get_by_test_id("toast-body").count() == 0
        assert probe.external_requests == [] and probe.console_errors == []
        page.context.close()


def copied(page: Any, ready: Any, timeout_s: float = 10.0) -> str:
    """The clipboard's text once `ready(text)` holds (a copy writes it asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not ready(text := page.evaluate("navigator.clipboard.readText()")):
        assert time.monotonic() < deadline, f"clipboard still {text[:200]!r}"
        page.wait_for_timeout(50)
    return text


def test_copy_gives_the_answer_text(chromium: Any, app_server: AppServer) -> None:
    """Copying an answer copies its text, without the rejected drafts or the token markup:
    Gradio's "Copy message" and "Copy conversation" buttons (which copied the spans' HTML), a
    selection of the answer, in the chat or the compare panel, with Ctrl+C (which copied the
    struck-through drafts), and Gradio's fallback for pages without the Clipboard API (a hidden
    textarea it selects and copies)."""
    from tests.app_fixtures import open_page
    from tests.test_app_api import OUT

    question = "Write a Python function that reverses a string."
    expected = app_server.client().predict(question, max_new_tokens=60, temperature=0.0,
                                           api_name="/chat")[OUT["run"]]["text"]
    probe = open_page(chromium, app_server.url, permissions=["clipboard-read", "clipboard-write"])
    page = probe.page
    page.locator("#compare input").check()
    ask(page, question, 60)
    expect()(page.locator("#status")).to_contain_text("Done", timeout=DONE_TIMEOUT_MS)
    assert last_answer(page).locator(".tok-rej").count() > 0  # there are drafts to leave out
    last_answer(page).hover()
    page.locator('#chat button[aria-label="Copy message"]').last.click()
    assert copied(page, lambda t: "<span" not in t) == expected
    page.locator('#chat button[aria-label="Copy conversation"]').click()
    assert copied(page, lambda t: t.startswith("user:")) == (
        f"user: {question}\n\nassistant: {expected}")
    last_answer(page).evaluate("""(e) => {
        const r = document.createRange(); r.selectNodeContents(e);
        getSelection().removeAllRanges(); getSelection().addRange(r); }""")
    page.keyboard.press("Control+C")
    assert copied(page, lambda t: not t.startswith("user:")).strip() == expected.strip()
    page.evaluate("navigator.clipboard.writeText('')")
    page.locator("#compare-eagle .spec-answer").evaluate("""(e) => {
        const r = document.createRange(); r.selectNodeContents(e);
        getSelection().removeAllRanges(); getSelection().addRange(r); }""")
    page.keyboard.press("Control+C")
    assert copied(page, bool).strip() == expected.strip()  # the compare panel's answer
    page.evaluate("navigator.clipboard.writeText('')")
    markup = last_answer(page).locator(".md").first.inner_html()
    page.evaluate("""(markup) => { const box = document.createElement('textarea');
        box.value = markup; document.body.prepend(box); box.select();
        document.execCommand('copy'); box.remove(); }""", markup)
    assert copied(page, bool).strip() == expected.strip()
    assert probe.console_errors == []
    page.context.close()


def test_phone_opens_on_the_chat_and_the_sidebar_on_demand(chromium: Any,
                                                           app_server: AppServer) -> None:
    """On a phone the open sidebar covers the whole page: it starts closed there (and open on
    wider pages, `test_page_loads_offline_with_legend_and_sidebar`); an answer's tiles and
    timing fit the screen."""
    from tests.app_fixtures import open_page

    probe = open_page(chromium, app_server.url, width=390, height=844)
    page, sidebar = probe.page, "document.querySelector('#sidebar').classList"
    page.wait_for_function(f"!{sidebar}.contains('open')")
    page.locator("#prompt textarea").click(trial=True)  # reachable, not covered by the sidebar
    page.get_by_label("Toggle Sidebar").click()
    page.wait_for_function(f"{sidebar}.contains('open')")
    expect()(page.locator("#topk input[type=range]")).to_be_in_viewport()
    page.get_by_label("Toggle Sidebar").click()
    page.wait_for_function(f"!{sidebar}.contains('open')")
    page.locator("#prompt textarea").click(trial=True)
    ask(page, "Name three colors.", 24)
    wait_done(page)
    # the tiles two a row and the timing table below the plot: nothing cut at the right edge
    assert page.evaluate(PHONE_OVERFLOW_JS) == [], "cut off on a phone"
    page.context.close()


# The sidebar closed and at rest (it slides shut as a phone's page opens).
SIDEBAR_CLOSED_JS = """() => { const bar = document.querySelector('#sidebar');
  return !bar.classList.contains('open') && bar.getAnimations({subtree: true}).length === 0; }"""
# Where each part lies on the first screen: its box.
FIRST_SCREEN_JS = """(sels) => Object.fromEntries(sels.map((s) => {
  const r = document.querySelector(s).getBoundingClientRect();
  return [s, {top: r.top, bottom: r.bottom, left: r.left, right: r.right}]; }))"""


def test_phone_shows_the_message_box_send_and_the_tiles_on_the_first_screen(
        chromium: Any, app_server: AppServer) -> None:
    """A phone (390x844, touch): the chat, the message box, Send and the speed tiles lie inside
    the first screen without scrolling (the examples and the step panels come after them), the
    sidebar's toggle stays clear of the chat, and the intro says to tap a token
    (UPDATE_SCREENSHOTS=1 writes the screen to assets/screenshots/phone.png)."""
    from tests.app_fixtures import open_page

    probe = open_page(chromium, app_server.url, width=390, height=844, touch=True)
    page, ex = probe.page, expect()
    page.wait_for_function(SIDEBAR_CLOSED_JS)
    ex(page.locator("#intro")).to_contain_text("Tap a token for its step and depth",
                                               use_inner_text=True)
    ex(page.locator("#intro .on-hover")).to_be_hidden()
    parts = ["#chat", "#prompt textarea", "#send", "#tiles", "#examples", "#step-panels",
             "#sidebar .toggle-button"]
    box = page.evaluate(FIRST_SCREEN_JS, parts)
    assert page.evaluate("window.scrollY") == 0
    for part in ("#chat", "#prompt textarea", "#send", "#tiles"):
        assert 0 <= box[part]["top"] and box[part]["bottom"] <= 844, (part, box[part])
    assert box["#tiles"]["bottom"] <= box["#examples"]["top"] <= box["#step-panels"]["top"]
    assert box["#sidebar .toggle-button"]["right"] <= box["#chat"]["left"], box
    assert probe.external_requests == [] and probe.console_errors == []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)  # the phone's first screen, as a visitor sees it
    page.screenshot(path=str(ARTIFACTS / "phone.png"), animations="disabled", caret="hide")
    if UPDATE:
        (SHOTS / "phone.png").write_bytes((ARTIFACTS / "phone.png").read_bytes())
    page.context.close()


def test_a_tap_on_a_token_shows_its_details(chromium: Any, app_server: AppServer) -> None:
    """Touch screens never show a `title`: a tap on a token shows it in a popover below the
    token, and a tap elsewhere hides it."""
    from tests.app_fixtures import open_page

    probe = open_page(chromium, app_server.url, width=390, height=844, touch=True)
    page, ex = probe.page, expect()
    page.wait_for_function(SIDEBAR_CLOSED_JS)
    ask(page, "Name three colors.", 6)
    wait_done(page)
    token = last_answer(page).locator(".tok >> visible=true").first
    details = page.locator("#tap-details")
    ex(details).to_be_hidden()
    token.tap()
    ex(details).to_be_visible()
    ex(details).to_have_text(token.get_attribute("title"))
    assert re.search(r"step \d+", details.inner_text())
    assert details.bounding_box()["y"] >= token.bounding_box()["y"] + token.bounding_box()["height"]
    page.locator("#status").tap()
    ex(details).to_be_hidden()
    assert probe.console_errors == []
    page.context.close()


# Speed tiles whose text is wider than the tile, and parts of the page past the screen's edge.
PHONE_OVERFLOW_JS = """() => [
  ...[...document.querySelectorAll('#tiles .tile')].filter(t => t.scrollWidth > t.clientWidth)
     .map(t => 'tile: ' + t.innerText),
  ...['#tiles', '#timing table', '#step-plot'].filter(
     sel => document.querySelector(sel).getBoundingClientRect().right > window.innerWidth)]"""


def test_answer_streams_with_three_token_kinds(probe: PageProbe, app_server: AppServer) -> None:
    page = probe.page
    page.locator("#compare input").check()
    page.evaluate(TTFT_JS)
    # long enough to stream over several 0.25 s frames on the fastest CPUs here: a 48-token
    # answer of the default head on a VNNI CPU fit in one frame
    ask(page, STORY, 512)
    counts: list[int] = []
    while "Done" not in page.locator("#status").inner_text() and len(counts) < 2400:
        counts.append(page.locator("#chat .tok").count())
        page.wait_for_timeout(50)
    wait_done(page)
    ttft = page.evaluate("window.__ttft.token - window.__ttft.click")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "ttft_ms.txt").write_text(f"{ttft:.0f}\n")
    print(f"\ntime from Send to first token in the browser: {ttft:.0f} ms")
    assert len({c for c in counts if c}) >= 3, f"answer did not stream: {counts}"
    answer = last_answer(page)
    kinds = ["tok-target", "tok-bonus", "tok-rej"] + (
        ["tok-acc"] if app_server.trained_heads else [])
    colours = {}
    for kind in kinds:
        span = answer.locator(f".{kind} >> visible=true").first  # a newline span is invisible
        expect()(span).to_be_visible()
        legend_bg = page.locator(f"#legend .{kind}").evaluate(
            "e => getComputedStyle(e).backgroundColor")
        expect()(span).to_have_css("background-color", legend_bg)
        assert re.search(r"step \d+", span.get_attribute("title") or "")
        colours[kind] = legend_bg
    assert len(set(colours.values())) == len(colours), colours
    expect()(answer.locator(".tok-rej").first).to_have_css("text-decoration-line", "line-through")
    expect()(answer.locator(".tok-bonus").first).to_have_css("border-bottom-style", "dotted")
    tps = page.locator("#tile-tps .tile-value").inner_text()
    assert float(tps) > 0
    verdict = page.locator("#compare-out .compare-verdict")
    expect()(verdict).to_contain_text(re.compile(r"Greedy texts (are identical|differ from)"))
    expect()(page.locator("#compare-base .tok-target").first).to_be_attached()
    expect()(page.locator("#tree svg")).to_be_visible()
    expect()(page.locator("#timing")).to_contain_text("verify")
    ex = expect()
    ex(page.locator("#tile-speedup .tile-value")).to_have_text(re.compile(r"^\d+\.\d\d×$"))
    ex(page.locator("#tile-speedup")).to_contain_text("this answer, raced")
    # the race of the two real runs: Replay plays it (this page asks for reduced motion, so
    # it arrived finished); the pane with the shorter recorded time finishes first
    race = page.locator("#compare-out .race")
    race.locator(".race-play").click()
    ex(race).to_have_class("compare race finished", timeout=DONE_TIMEOUT_MS)
    data = json.loads(race.get_attribute("data-race"))
    ends = {name: lane["t"][-1] + lane["offset"] for name, lane in data.items()}
    assert race.get_attribute("data-order") == ",".join(sorted(ends, key=ends.get))
    texts = [race.locator(f"#compare-{lane} .spec-answer").evaluate(VISIBLE_TEXT_JS)
             for lane in ("eagle", "base")]
    if "identical" in verdict.inner_text():
        assert texts[0] == texts[1]
    assert probe.external_requests == [] and probe.console_errors == []


# an answer's text as read: rejected drafts left out
VISIBLE_TEXT_JS = """(e) => { const c = e.cloneNode(true);
  c.querySelectorAll('.tok-rej').forEach((t) => t.remove()); return c.textContent; }"""


# The chat's label must not lie over the answer's first line (it did, as an overlay).
LABEL_OVER_FIRST_LINE_JS = """() => {
  const tok = document.querySelector('#chat [data-testid="bot"] .tok');
  const t = tok.getBoundingClientRect();
  return [...document.querySelectorAll('#chat [data-testid="block-label"], #chat label')]
    .map(l => l.getBoundingClientRect())
    .filter(r => r.width > 0 && r.left < t.right && t.left < r.right && r.top < t.bottom
                 && t.top < r.bottom).length;
}"""


def test_code_answer_reads_as_code_with_an_estimated_speedup(probe: PageProbe) -> None:
    """A code question with "compare" off, as a visitor leaves it: the speedup tile shows an
    estimate, marked as one, whose tooltip says how it was computed; code tokens are
    monospace and rejected drafts inside the code are small markers holding their text in a
    tooltip; nothing covers the answer's first line. Then the Race button runs plain decoding
    of the same prompt: the tile shows the measured speedup with the estimate beside it, and
    the race panel holds both answers. The README's screenshots are this page (the answer with
    its tiles, the race panel, the sidebar)."""
    page, ex = probe.page, expect()
    question = ("Write a Python function that checks whether a string is a palindrome, ignoring "
                "punctuation and case, and explain it briefly.")
    ask(page, question, 160)
    wait_done(page)
    answer = last_answer(page)
    code = answer.locator(".tok.in-code >> visible=true").first
    ex(code).to_have_css("font-family", re.compile("monospace"))
    mark = answer.locator(".rej-mark").first
    ex(mark).to_be_visible()
    assert mark.inner_text() == ""
    from playground.ui_render import SOURCE_TEXT

    sources = "|".join(SOURCE_TEXT.values())  # named where the context drafted it
    assert re.search(rf"rejected draft · step \d+ · depth \d+( · ({sources}))?: '",
                     mark.get_attribute("title"))
    ex(mark).to_have_css("text-decoration-line", "none")
    tile = page.locator("#tile-speedup")
    # beside busy processes (`make test` under load) the tile says so instead of a ratio
    ex(tile.locator(".tile-value")).to_have_text(re.compile(r"^(≈\d+\.\d\d×|busy)$"))
    busy = tile.locator(".tile-value").inner_text() == "busy"
    if busy:
        ex(tile).to_contain_text("the machine is busy; timings are unreliable")
    else:
        ex(tile.locator(".est-badge")).to_have_text("estimated")
        assert "Estimated, not measured" in (tile.get_attribute("title") or "")
    page.locator("#chat [data-testid='bot']").first.scroll_into_view_if_needed()
    assert page.evaluate(LABEL_OVER_FIRST_LINE_JS) == 0
    estimated = tile.locator(".tile-value").inner_text()
    page.click("#race-btn")
    ex(page.locator("#status")).to_contain_text("Race recorded", timeout=DONE_TIMEOUT_MS)
    ex(tile.locator(".tile-value")).to_have_text(re.compile(r"^\d+\.\d\d×$"))
    ex(tile.locator(".race-held")).to_be_visible()  # reduced motion: the race shows finished
    ex(tile).to_contain_text("this answer, raced" if busy
                             else f"this answer, raced; estimated {estimated}")
    race = page.locator("#compare-out .race")
    ex(race.locator(".race-result")).to_contain_text("finished")
    ex(race.locator(".race-result")).to_be_visible()
    page.locator("#tiles").scroll_into_view_if_needed()
    page.locator("#sidebar").evaluate(  # from its top: setting max new tokens scrolled it
        "(e) => [e, ...e.querySelectorAll('*')].forEach((n) => { n.scrollTop = 0; })")
    page.mouse.move(0, 0)
    shots = {"app_answer.png": page, "race.png": page.locator("#compare-out"),
             "sidebar.png": page.locator("#sidebar")}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, target in shots.items():  # the page first: an element's shot scrolls to it
        target.screenshot(path=str(ARTIFACTS / name), animations="disabled", caret="hide")
        if UPDATE:
            (SHOTS / name).write_bytes((ARTIFACTS / name).read_bytes())
    assert probe.external_requests == [] and probe.console_errors == []


# the step plot's tick labels, and how far its chart reaches below its block (<= 0: inside)
STEP_PLOT_JS = """e => {
  const block = e.getBoundingClientRect(), chart = e.querySelector('svg.marks');
  return {labels: Array.from(e.querySelectorAll('.role-axis-label text'), t => t.textContent),
          below: chart ? chart.getBoundingClientRect().bottom - block.bottom : null}; }"""


def test_step_plot_shows_whole_steps_inside_its_block(probe: PageProbe) -> None:
    """A short answer's step plot: its ticks are whole steps and tokens (fitted to three
    steps, the chart put them at 0.8, 1.0, 1.2, ...) and its axes lie inside the block (with a
    fixed height, Gradio's block cut off the x axis's labels and title)."""
    page = probe.page
    ask(page, "Say hi.", 6)
    wait_done(page)
    page.locator("#step-plot .role-axis-label text").first.wait_for()
    got = page.locator("#step-plot").evaluate(STEP_PLOT_JS)
    assert got["labels"] and all(re.fullmatch(r"\d+", t) for t in got["labels"]), got
    assert got["below"] is not None and got["below"] <= 0, got


def test_sidebar_controls_show_their_effect(probe: PageProbe) -> None:
    page, ex = probe.page, expect()
    ask(page, "What is the capital of France?", 24)
    wait_done(page)
    rejected = last_answer(page).locator(".tok-rej >> visible=true").first
    ex(rejected).to_be_visible()
    page.locator("#show-rej input").uncheck()
    ex(rejected).to_be_hidden()
    page.locator("#show-rej input").check()
    ex(rejected).to_be_visible()
    page.locator("#spec input").uncheck()
    ex(page.locator("#topk input[type=range]")).to_be_disabled()
    ex(page.locator("#head-note")).to_contain_text("Speculative decoding is off")
    page.locator("#spec input").check()
    ex(page.locator("#topk input[type=range]")).to_be_enabled()
    page.locator("#aux input").uncheck()
    ex(page.locator("#head-note")).to_contain_text("eagle3-noaux-1layer")
    ex(page.locator("#layers label")).to_have_count(1)
    ex(page.locator("#layers")).to_contain_text("2 layers: needs aux hidden states on")
    page.locator("#aux input").check()
    ex(page.locator("#layers label")).to_have_count(2)
    ex(page.locator("#layers")).not_to_contain_text("needs aux hidden states")
    set_number(page, "topk", 3)  # change the tree, then set k2 s2
    set_number(page, "num-steps", 3)
    ex(page.locator("#draft-tokens input[type=number]")).to_have_attribute("max", "22")
    set_number(page, "topk", 2)
    set_number(page, "num-steps", 2)
    ex(page.locator("#draft-tokens input[type=number]")).to_have_attribute("max", "7")
    ex(page.locator("#top-p input[type=range]")).to_be_disabled()
    set_number(page, "temperature", 0.7)
    ex(page.locator("#top-p input[type=range]")).to_be_enabled()
    page.locator("#spec input").uncheck()
    set_number(page, "temperature", 0)
    ask(page, "Name a fruit.", 6)
    wait_done(page)
    ex(page.locator("#status")).to_contain_text("baseline")
    assert last_answer(page).locator(".tok-target").count() >= 1
    assert last_answer(page).locator(".tok-bonus, .tok-rej, .tok-acc").count() == 0


def test_target_weights_switch_the_target_and_its_tree(probe: PageProbe) -> None:
    """The sidebar offers the dense copy beside the default q4 target, and says which tree was
    measured fastest here (the app's first start, `eagle_engine/tools/autotune.py`): the tree
    sliders (the min draft probability too) start at it, choosing the dense copy moves them to
    the dense tree (the slower format's static default, the only tree measured for it) and the
    answer comes from the dense target; choosing q4 again brings the measured tree back. When
    other work took the cores during that measurement (`make test` beside busy processes),
    the sidebar says so and the tree is the CPU class's static default."""
    from eagle_engine.config import EngineConfig, TreeParams, q4_tree
    from eagle_engine.tools.autotune import tree_label

    dense = EngineConfig(weights="dense").weights_label
    page, ex = probe.page, expect()
    status = page.locator("#engine-status")
    ex(status).to_contain_text("Measured at start-up, on short fixed prompts q4 weights")
    if "the machine was busy" in status.inner_text():
        label = tree_label(q4_tree())
    else:  # the tree in words, its label in the tooltip
        label = status.locator(".tree-name").get_attribute("title") or ""
    measured = re.search(r"k(\d+) s(\d+) n(\d+)(?: min([\d.]+))?", label)
    assert measured is not None
    tokens = page.locator("#draft-tokens input[type=number]")
    page.locator("#advanced-tree").get_by_text("Advanced tree").click()  # closed at first
    cut = page.locator("#min-score input[type=number]")
    ex(tokens).to_have_value(measured.group(3))
    ex(page.locator("#topk input[type=number]")).to_have_value(measured.group(1))
    ex(cut).to_have_value(measured.group(4) or "0")
    page.locator("#weights label", has_text=dense).click()
    ex(tokens).to_have_value(str(TreeParams().num_draft_tokens))
    ex(cut).to_have_value("0")
    ask(page, "Name a fruit.", 8)
    wait_done(page)
    ex(page.locator("#status")).to_contain_text(f"{dense} target")
    page.locator("#weights label", has_text="q4").click()
    ex(tokens).to_have_value(measured.group(3))
    ex(cut).to_have_value(measured.group(4) or "0")


def test_stop_freezes_the_answer_and_page_keeps_working(probe: PageProbe) -> None:
    page, ex = probe.page, expect()
    ask(page, STORY, 512)
    ex(page.locator('#chat [data-testid="bot"] .tok').nth(5)).to_be_attached(timeout=60_000)
    page.click("#stop")
    ex(page.locator("#status")).to_contain_text("Stopped", timeout=10_000)
    frozen = last_answer(page).locator(".tok").count()
    page.wait_for_timeout(1500)
    assert last_answer(page).locator(".tok").count() == frozen
    # the answer ended itself: no "Error" badge from a run cancelled between frames
    ex(page.locator("#status")).not_to_contain_text("Error")
    set_number(page, "max-new-tokens", 6)
    box = page.locator("#prompt textarea")
    box.fill("Say")
    box.press("Shift+Enter")  # a new line, not a send
    box.press_sequentially(" hello.")
    ex(box).to_have_value("Say\n hello.")
    box.press("Enter")  # sends, as in chat apps
    wait_done(page)
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(2)


def test_the_next_message_can_be_typed_while_an_answer_streams(probe: PageProbe) -> None:
    """Only an answer's first frame empties the message box (it did every frame, so text typed
    during an answer vanished within 0.25 s); Send and Regenerate during the answer neither
    start a second one nor lose the text, which Enter sends once the answer is done."""
    page, ex = probe.page, expect()
    ask(page, STORY, 512)
    ex(page.locator('#chat [data-testid="bot"] .tok').nth(5)).to_be_attached(timeout=60_000)
    box = page.locator("#prompt textarea")
    box.fill("And a shorter one?")
    assert "Generating" in page.locator("#status").inner_text(), "typed while it streams"
    page.click("#send")  # ignored: Send and Enter are one event, and it runs
    page.click("#regen")  # refused: one answer at a time in a chat
    ex(page.get_by_test_id("toast-body").last).to_contain_text("still streaming")
    wait_done(page)
    ex(box).to_have_value("And a shorter one?")
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(1)
    set_number(page, "max-new-tokens", 6)
    box.press("Enter")
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(2)
    ex(box).to_have_value("")
    wait_done(page)


def test_clear_during_an_answer_leaves_an_empty_page(probe: PageProbe) -> None:
    """Clear stops the streaming answer first: a run cancelled between frames could draw a
    late frame over the cleared page, and left an "Error" badge on the status line."""
    page, ex = probe.page, expect()
    ask(page, STORY, 512)
    ex(page.locator('#chat [data-testid="bot"] .tok').nth(5)).to_be_attached(timeout=60_000)
    page.click("#clear")
    ex(page.locator("#status")).to_have_text("Cleared.", timeout=10_000)
    page.wait_for_timeout(1500)  # no late frame comes
    ex(page.locator("#status")).to_have_text("Cleared.")
    ex(page.locator('#chat [data-testid="bot"]')).to_have_count(0)
    ask(page, "Say hello.", 6)
    wait_done(page)
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(1)


def test_bad_input_gives_a_toast_and_keeps_the_chat(probe: PageProbe) -> None:
    """A refused request says why in a toast and on the status line, which shows no "Error"
    badge (Gradio leaves one after an error)."""
    page, ex = probe.page, expect()
    ask(page, "Say hi.", 4)
    wait_done(page)
    page.fill("#prompt textarea", "   ")
    page.click("#send")
    ex(page.get_by_test_id("toast-body").last).to_contain_text("Type a message first")
    ex(page.locator("#status")).to_have_text("Not sent: Type a message first.")
    page.fill("#prompt textarea", "word " * 1500)
    page.click("#send")
    ex(page.get_by_test_id("toast-body").last).to_contain_text("context window")
    ex(page.locator("#status")).to_contain_text("Not sent: prompt has")
    ex(page.locator("#status")).not_to_contain_text("Error")
    ex(page.locator("#prompt textarea")).to_have_value("word " * 1500)
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(1)
    ex(last_answer(page).locator(".tok").first).to_be_visible()
    ask(page, "Say bye.", 4)
    wait_done(page)
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(2)
    # Stop with nothing streaming says why (a message in the queue cannot be taken back); the
    # toast needs a queued Stop event: Gradio shows none from an unqueued one. The status line
    # says "Done" with the last frame, a moment before the run's own bookkeeping ends, and a Stop
    # in that moment ends the run silently; so Stop is pressed until the toast comes (never more
    # than a few times), and the toast is looked for among all toasts, which Gradio groups
    toast = page.get_by_test_id("toast-body").filter(has_text="Nothing of yours is streaming")
    for _ in range(10):
        page.click("#stop")
        try:
            ex(toast).to_have_count(1, timeout=3000)
            break
        except AssertionError:
            continue
    ex(toast).to_have_count(1)
    ex(page.locator("#status")).to_contain_text("Done")


def test_two_tabs_are_queued_and_keep_their_own_chats(chromium: Any,
                                                      app_server: AppServer) -> None:
    from tests.app_fixtures import open_page

    tabs = [open_page(chromium, app_server.url).page for _ in range(2)]
    prompts = ["What is the capital of France?", "Name three colors."]
    for page, prompt in zip(tabs, prompts):
        ask(page, prompt, 16)
    for page, own, other in zip(tabs, prompts, reversed(prompts)):
        wait_done(page)
        text = page.locator("#chat").inner_text()
        assert own in text and other not in text
        page.context.close()


def changed_fraction(actual: Path, expected: Path, diff_path: Path) -> float:
    import numpy as np
    from PIL import Image, ImageChops

    a, b = Image.open(actual).convert("RGB"), Image.open(expected).convert("RGB")
    if a.size != b.size:
        return 1.0
    diff = ImageChops.difference(a, b)
    diff.save(diff_path)
    changed = int((np.asarray(diff).max(axis=2) > PIXEL_THRESHOLD).sum())
    return changed / (a.size[0] * a.size[1])


def code_events() -> list[Any]:
    """A fixed code block after the fixed prose answer, with a rejected draft inside it."""
    from eagle_engine.events import StepEvent
    from eagle_engine.events import TokenSpan as T

    return [StepEvent(3, "eagle", [T(20, "\n```py\n", "bonus", 0), T(21, "def", "accepted", 1),
                                   T(22, " f(x):", "bonus", 0)], "\n```py\ndef f(x):",
                      rejected=[T(23, " g(", "rejected", 2)]),
            StepEvent(4, "eagle", [T(24, "\n    return", "accepted", 1),
                                   T(25, " x <b>\n```", "bonus", 0)],
                      "\n    return x <b>\n```", rejected=[T(26, " y", "rejected", 2)])]


def test_token_pane_matches_reference(probe: PageProbe, fixed_events: list[Any]) -> None:
    """Fixed events rendered by ui_render into the chat's answer bubble (prose, then a code
    block with its rejected drafts as markers), compared pixel-wise."""
    from playground import ui_render as ui

    page = probe.page
    ask(page, "Say hi.", 2)
    wait_done(page)
    view = ui.AnswerView()
    for ev in fixed_events + code_events():
        view.add(ev)
    answer = last_answer(page)
    answer.locator(".md").first.evaluate("(e, html) => { e.innerHTML = html; }", view.html())
    matches_reference(page, answer, "token_pane")


# Per line of an answer, the text of its kept tokens (rejected drafts left out), as drawn.
KEPT_LINES_JS = """(e) => {
  const lines = new Map();
  e.querySelectorAll('.tok:not(.tok-rej)').forEach((t) => {
    if (!t.textContent.trim()) return;  // a line break's own span
    const top = Math.round(t.getBoundingClientRect().top);
    lines.set(top, (lines.get(top) || '') + t.textContent); });
  return [...lines.keys()].sort((a, b) => a - b).map((top) => lines.get(top)); }"""


def test_a_rejected_line_break_leaves_the_answers_lines_as_they_are(probe: PageProbe) -> None:
    """A rejected draft of a line break after "Jane" (and one of a blank line before "Bob")
    shows as "⏎" on the line it was drafted on: the kept text keeps the answer's two lines,
    as with rejected drafts hidden."""
    from playground import ui_render as ui
    from tests.test_ui_render import rejected_newline_events

    page, ex = probe.page, expect()
    ask(page, "Say hi.", 2)
    wait_done(page)
    view = ui.AnswerView()
    for ev in rejected_newline_events():
        view.add(ev)
    answer = last_answer(page).locator(".md").first
    answer.evaluate("(e, html) => { e.innerHTML = html; }", view.html())
    expected = [line.replace(" ", "") for line in view.text.split("\n")]
    lines = answer.evaluate(KEPT_LINES_JS)
    assert [line.replace(" ", "") for line in lines] == expected == ["Jane:I'matech", "Bob"]
    ex(answer.locator(".tok-rej").first).to_have_text("⏎")
    page.locator("#show-rej input").uncheck()
    ex(answer.locator(".tok-rej").first).to_be_hidden()
    assert answer.evaluate(KEPT_LINES_JS) == lines


def test_continue_grows_an_answer_cut_at_its_max_new_tokens(probe: PageProbe) -> None:
    """An answer cut at a small cap says so and offers Continue, which goes on in the same
    turn: the answer so far stays, more follows, and no new message appears."""
    page, ex = probe.page, expect()
    ask(page, STORY, 8)
    wait_done(page)
    ex(page.locator("#status")).to_contain_text(
        "reached its limit of 8 tokens (Max new tokens): press Continue for more")
    answer = last_answer(page)
    before = answer.evaluate(VISIBLE_TEXT_JS)
    page.locator("#continue").click()
    ex(page.locator("#status")).to_contain_text("continued with 8 tokens",
                                                timeout=DONE_TIMEOUT_MS)
    ex(page.locator('#chat [data-testid="user"]')).to_have_count(1)
    ex(page.locator('#chat [data-testid="bot"]')).to_have_count(1)
    after = answer.evaluate(VISIBLE_TEXT_JS)
    assert after.startswith(before) and len(after) > len(before), (before, after)


def matches_reference(page: Any, target: Any, name: str) -> None:
    """`target` (a locator) screenshotted against `assets/screenshots/{name}_ref.png`: at most
    `MAX_CHANGED_FRACTION` of its pixels may differ (UPDATE_SCREENSHOTS=1 rewrites the
    reference; a missing one is written and the test fails until it is reviewed)."""
    page.mouse.move(0, 0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    actual, reference = ARTIFACTS / f"{name}.png", SHOTS / f"{name}_ref.png"
    target.screenshot(path=str(actual), animations="disabled", caret="hide")
    if UPDATE or not reference.exists():
        SHOTS.mkdir(parents=True, exist_ok=True)
        reference.write_bytes(actual.read_bytes())
        if not UPDATE:
            pytest.fail(f"no reference screenshot yet; wrote {reference}: review and commit it")
    fraction = changed_fraction(actual, reference, ARTIFACTS / f"{name}_diff.png")
    assert fraction <= MAX_CHANGED_FRACTION, (
        f"{100 * fraction:.2f}% of pixels differ from {reference}; see {ARTIFACTS}")
