"""The page: the sidebar's controls, the main panel and how the events are wired to the
handlers (`build_demo`).
Not here: what the handlers do (`handlers.py`) or drawing (`ui_render.py`).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from eagle_engine.config import (
    CHAIN_SURE,
    TreeParams,
)

from . import ui_render as ui
from .handlers import FRAME_INTERVAL_S, OUTPUTS, PANEL_INTERVAL_S, Playground
from .serving import EngineThread, Visitors
from .speed_estimate import VerifyCost

ROOT = Path(__file__).resolve().parent.parent
CSS = ROOT / "assets" / "style.css"
RACE_JS = ROOT / "assets" / "race.js"  # the compare panel's replay of the race
MAX_NEW_TOKENS = 2048  # the slider's top
NEW_TOKENS = 512  # its start: room for a whole function or a few paragraphs; Continue goes on
# Gradio's progress display on the status line while an answer streams. "full" animates an
# overlay there: with a browser on the same cores, the browser uses ~12% more CPU and the engine
# runs ~7% slower than with "minimal" (the elapsed time alone). The
# status line itself says what the engine is doing.
PROGRESS = "minimal"
# Pages at most this wide (phones) open with the sidebar closed: open, it covers the chat.
NARROW_PX = 768
# Copying an answer copies its text. An answer is token spans (`ui_render`), and Gradio's
# "Copy message" / "Copy conversation" buttons copy that HTML, rejected drafts included;
# selecting the answer and pressing Ctrl+C copies the struck-through drafts too. Gradio has no
# hook for what it copies, so the page cleans the text on its way to the clipboard: the
# Clipboard API's writeText, Gradio's fallback (a hidden textarea; pages served over plain
# HTTP to another machine have no Clipboard API) and a selection within the chat or the
# compare panel.
COPY_AS_TEXT_JS = (ROOT / "assets" / "copy_as_text.js").read_text()
# A token's details (and a speed tile's) are its `title`, which touch screens never show: a
# tap on it shows them in a small popover, and a tap elsewhere hides it.
TAP_DETAILS_JS = (ROOT / "assets" / "tap_details.js").read_text()
# Each has a sensible greedy answer from the bundled q4 target (tests/test_app_startup.py). Not
# "What is the capital of France?": q4 answers it with a loop of "la France, ...", as
# llama.cpp does on the same GGUF (bf16 weights say Paris).
EXAMPLES = ["Write a Python function that reverses a string.",
            "Give me three tips for staying productive.",
            "Explain photosynthesis in two sentences."]




def tree_limits(topk: int, num_steps: int, num_draft_tokens: int) -> dict:
    cap = min(64, TreeParams(topk, num_steps, 2).capacity + 1)
    return gr.update(maximum=cap, value=min(num_draft_tokens, cap),
                     info=f"tree nodes incl. the root; at most {cap} for this topk and depth")


def sampling_state(temperature: float) -> list[dict]:
    info = None if temperature > 0 else "used when temperature > 0"
    return [gr.update(interactive=temperature > 0, info=info)] * 2


def _sidebar(pg: Playground) -> dict[str, Any]:
    """Sidebar controls keyed by Settings field name (plus the status and the race toggle). It
    leads with the head and the tree's shape (topk, steps, draft tokens), then the finer tree
    settings in a closed "Advanced tree" group, sampling and the target's weights; the tree
    sliders start at the default engine's default tree (smaller with q4 weights)."""
    weights, engine = next(iter(pg.engines.items()))
    tree = engine.default_tree
    default = ui.default_head(pg.heads)
    aux, layers = (default.use_aux, default.num_layers) if default else (True, 1)
    drafts = bool(pg.heads)  # the draft settings apply only with a head
    c: dict[str, Any] = {}
    with gr.Sidebar(label="Settings", open=True, width=340, elem_id="sidebar"):
        c["engine_status"] = gr.Markdown(pg.engine_status(weights), elem_id="engine-status")
        c["spec"] = gr.Checkbox(bool(pg.heads), label="Speculative decoding (EAGLE-3)",
                                interactive=bool(pg.heads), elem_id="spec")
        c["aux"] = gr.Checkbox(aux, label="Aux hidden states", elem_id="aux")
        c["layers"] = gr.Radio(ui.layer_choices(pg.heads, aux) or [layers], value=layers,
                               label="Draft layers", elem_id="layers")
        c["note"] = gr.Markdown(elem_id="head-note")
        c["topk"] = gr.Slider(1, 10, tree.topk, step=1, precision=0, label="topk",
                              interactive=drafts, elem_id="topk")
        c["num_steps"] = gr.Slider(1, 10, tree.num_steps, step=1, precision=0,
                                   label="Draft steps (depth)", interactive=drafts,
                                   elem_id="num-steps")
        c["num_draft_tokens"] = gr.Slider(2, 64, tree.num_draft_tokens, step=1,
                                          precision=0, label="Draft tokens", interactive=drafts,
                                          elem_id="draft-tokens")
        with gr.Accordion("Advanced tree", open=False, elem_id="advanced-tree"):
            c["min_score"] = gr.Slider(
                0, 0.5, tree.min_score, step=0.01, label="Min draft probability",
                interactive=drafts, elem_id="min-score", info="verify only drafts whose path "
                "probability is at least this: an unsure draft then costs no verify row (0: "
                "always the full tree)")
            c["context_drafts"] = gr.Checkbox(
                tree.context_drafts, label="Drafts from context", interactive=drafts,
                elem_id="context-drafts",
                info="also draft what followed the latest earlier occurrence of the text's end "
                "(prompt and answer so far); it competes for the same draft tokens")
            c["context_extra"] = gr.Slider(
                0, 16, tree.context_extra, step=1, precision=0, label="Sure context drafts "
                "past the tree", interactive=drafts, elem_id="context-extra", info="verify up "
                f"to this many more drafts from context past Draft tokens, each at least "
                f"{CHAIN_SURE:g} likely (0: none)")
            c["step_cut"] = gr.Slider(
                0, 0.9, tree.step_cut, step=0.05, label="Min path probability for a deeper "
                "draft step", interactive=drafts, elem_id="step-cut", info="run the head's "
                "draft steps past the first only while its best draft so far is at least this "
                "likely: a deeper step then runs where it can pay (0: every step)")
        c["temperature"] = gr.Slider(0, 1.5, 0.0, step=0.05, label="Temperature (0 = greedy)",
                                     elem_id="temperature")
        c["top_p"] = gr.Slider(0.05, 1, 1.0, step=0.05, label="top-p", elem_id="top-p")
        c["max_new_tokens"] = gr.Slider(1, MAX_NEW_TOKENS, NEW_TOKENS, step=1, precision=0,
                                        label="Max new tokens", elem_id="max-new-tokens",
                                        info="an answer that reaches it can go on with "
                                        "Continue")
        c["seed"] = gr.Number(0, precision=0, label="Seed", elem_id="seed")
        c["weights"] = gr.Radio(list(pg.engines), value=weights, label="Target weights",
                                info=(engine.tuned and engine.tuned.weights_info())
                                or "q4: the GGUF's 4-bit codes (fast on CPU); bf16 / fp32: "
                                "dense copies", visible=len(pg.engines) > 1,
                                elem_id="weights")
        c["compare"] = gr.Checkbox(False, label="Race plain decoding after each answer",
                                   info="runs the target alone on the same prompt after the "
                                   "answer, measures the speedup and replays both side by side",
                                   interactive=drafts, elem_id="compare")
    return c


def _main_panel() -> dict[str, Any]:
    o: dict[str, Any] = {"history": gr.State([])}
    # touch screens tap a token instead of hovering it (style.css swaps the two words)
    gr.Markdown("## EAGLE-3 Playground\nA small draft head proposes a tree of tokens; the "
                "target verifies it in one forward pass. <span class='on-hover'>Hover</span>"
                "<span class='on-touch'>Tap</span> a token for its step and depth.",
                elem_id="intro")
    with gr.Row(elem_id="legend-row"):
        gr.HTML(ui.legend_html(), elem_id="legend")
        o["show_rejected"] = gr.Checkbox(True, label="Show rejected drafts", elem_id="show-rej",
                                         container=False, scale=0, min_width=190)
    # no visible label: Gradio draws it over the answer's first line
    o["chat"] = gr.Chatbot(label="Chat", show_label=False, height=420, render_markdown=False,
                           elem_id="chat")
    # one line to start: Enter sends and Shift+Enter breaks the line, as in chat apps (Gradio
    # sends on Shift+Enter instead once a box starts with more lines); the box grows to 8
    o["prompt"] = gr.Textbox(label="Message", placeholder="Ask something… (Enter sends)",
                             lines=1, max_lines=8, elem_id="prompt")
    with gr.Row(elem_id="actions"):  # one line on a desktop with Continue shown too
        button = dict(min_width=100)
        o["send"] = gr.Button("Send", variant="primary", elem_id="send", **button)
        # shown after an answer that reached its max new tokens (`handlers.OUTPUTS`)
        o["more"] = gr.Button("Continue", visible=False, elem_id="continue", **button)
        o["stop"] = gr.Button("Stop", variant="stop", elem_id="stop", **button)
        o["regen"] = gr.Button("Regenerate", elem_id="regen", **button)
        o["clear"] = gr.Button("Clear", elem_id="clear", **button)
        o["race"] = gr.Button("Race plain decoding", elem_id="race-btn", **button)
    gr.Examples(EXAMPLES, inputs=[o["prompt"]], label="Examples (fill the message box)",
                elem_id="examples")
    o["status"] = gr.Markdown("Ready.", label="Status line", elem_id="status")
    o["tiles"] = gr.HTML(ui.tiles_html({}, False), label="stats", elem_id="tiles")
    # side by side where both fit their min_width, else one above the other
    with gr.Row(elem_id="step-panels"):
        # no fixed height: with one, Gradio's block cuts off the x axis's labels and title
        o["plot"] = gr.BarPlot(ui.steps_frame([]), x="step", y="accepted",
                               **ui.steps_axes([]), label="Accepted draft tokens per step",
                               elem_id="step-plot",
                               min_width=320)
        o["timing"] = gr.HTML(ui.timing_html({}), label="Per-phase timing", elem_id="timing",
                              min_width=320)
    o["tree"] = gr.HTML(ui.tree_svg([]), label="Latest draft tree", elem_id="tree")
    # the race of an answer and plain decoding, replayed by the page (assets/race.js)
    o["compare"] = gr.HTML("", label="EAGLE-3 vs plain decoding", elem_id="compare-out",
                           js_on_load=RACE_JS.read_text())
    with gr.Accordion("Last run (JSON)", open=False, elem_id="run-record"):
        o["run"] = gr.JSON(label="Last run", elem_id="run-json")
    return o


def build_demo(engines: Sequence[Any], worker: EngineThread | None = None,
               frame_interval: float = FRAME_INTERVAL_S,
               costs: dict[str, VerifyCost | None] | None = None, max_batch: int = 1,
               progress: str = PROGRESS, panel_interval: float = PANEL_INTERVAL_S,
               visitors: Visitors | None = None, startup: Any = None) -> gr.Blocks:
    """The Blocks over `engines` (the first is the default "Target weights"); `costs`: their
    verify costs in plain steps measured at warm-up (`speed_estimate.measure`), keyed like
    engines (a measurement that ends later joins the same dict);
    `max_batch`: how many visitors are answered at once (the chat handlers' concurrency);
    `progress`: Gradio's `show_progress` on the status line while an answer streams;
    `panel_interval`: how often the panels under the chat move while an answer streams;
    `visitors`, `startup`: the answers streaming and the measurements made once the page
    serves (`background.StartupWork`), which each page shows as it opens."""
    pg = Playground(engines, worker or EngineThread(), frame_interval, costs, max_batch,
                    panel_interval, visitors, startup)
    with gr.Blocks(title="EAGLE-3 Playground", analytics_enabled=False) as demo:
        c = _sidebar(pg)
        o = _main_panel()
        settings = [c[n] for n in ui.SETTING_NAMES]
        outputs = [o[n] for n in OUTPUTS]
        engine_kw = dict(outputs=outputs, concurrency_id="engine", concurrency_limit=max_batch,
                         show_progress_on=[o["status"]], show_progress=progress)
        # one event for Send and Enter: Gradio ignores both while it runs
        runs = [gr.on([o["send"].click, o["prompt"].submit], pg.send,
                      [o["prompt"], o["history"], *settings], api_name="chat", **engine_kw),
                o["regen"].click(pg.regenerate, [o["history"], *settings], api_name="regenerate",
                                 **engine_kw),
                o["more"].click(pg.continue_answer, [o["history"], *settings],
                                api_name="continue", **engine_kw),
                o["race"].click(pg.race, [o["history"]], api_name="race", **engine_kw)]
        # queued, for its toast (Gradio shows none from an unqueued event), in a group of its
        # own that never waits behind the answers
        o["stop"].click(pg.stop, None, None, api_name="stop", concurrency_id="stop",
                        concurrency_limit=None).then(
            None, None, None, cancels=runs, queue=False, api_visibility="private")
        # Clear stops a streaming answer the same way first: cancelled, its late frames
        # could draw over the cleared page (and leave the same "Error" badge)
        o["clear"].click(pg.end, None, None, queue=False, api_visibility="private").then(
            pg.clear, None, outputs, cancels=runs, queue=False, api_name="clear")
        _wire_sidebar(pg, c, demo)
        o["show_rejected"].change(
            None, o["show_rejected"], None, queue=False,
            js="(v) => { document.body.classList.toggle('hide-rejected', !v); }")
        demo.load(None, None, None, queue=False, js=COPY_AS_TEXT_JS)
        demo.load(None, None, None, queue=False, js=TAP_DETAILS_JS)
    return demo


def _wire_sidebar(pg: Playground, c: dict[str, Any], demo: gr.Blocks) -> None:
    quiet = dict(queue=False, api_visibility="private", show_progress="hidden")
    head_io = ([c["spec"], c["aux"], c["layers"]], [c["aux"], c["layers"], c["note"]])
    for trigger in (c["spec"].change, c["aux"].change, c["layers"].change, demo.load):
        trigger(pg.sidebar_state, *head_io, **quiet)
    draft_only = [c[n] for n in ("topk", "num_steps", "num_draft_tokens", "context_drafts",
                                 "min_score", "context_extra", "step_cut", "compare")]
    c["spec"].change(lambda on: [gr.update(interactive=on)] * 7 + [gr.update(
        interactive=on, value=False)], c["spec"], draft_only, **quiet)
    tree_io = [c["topk"], c["num_steps"], c["num_draft_tokens"]]
    for trigger in (c["topk"].change, c["num_steps"].change):
        trigger(tree_limits, tree_io, c["num_draft_tokens"], **quiet)
    tree_all = [*tree_io, c["min_score"], c["context_extra"], c["step_cut"]]
    c["weights"].change(pg.weights_changed, c["weights"], tree_all, **quiet)
    # a page opened after the start-up measurement shows its choice of weights and tree
    demo.load(pg.page_state, None, [c["engine_status"], c["weights"], *tree_all], **quiet)
    c["temperature"].change(sampling_state, c["temperature"], [c["top_p"], c["seed"]], **quiet)
    demo.load(sampling_state, c["temperature"], [c["top_p"], c["seed"]], **quiet)
    # on a phone the open sidebar covers the whole page: it starts closed there
    demo.load(None, None, None, queue=False, js=f"""() => {{
        if (window.innerWidth <= {NARROW_PX})
            document.querySelector('#sidebar.open .toggle-button')?.click(); }}""")
