"""What the playground draws from the engine's `StepEvent`s: HTML token spans (accepted draft,
draft from the context, rejected draft, bonus and target tokens; a rejected draft never breaks
the answer's lines), the legend, stat tiles, the latest draft tree as SVG (nodes from the context
marked), per-phase timings and the per-step plot data; a tree's shape in words; plus the mapping
of the sidebar's values to an engine request (which loaded head an (aux, layers) choice means).
Pure functions of plain data: no Gradio, no tensors. Every piece of model and user text is
HTML-escaped here. Not here: decoding (`engine.py`), the EAGLE-3 vs plain comparison and its
race (`race.py`) or Gradio wiring (`layout.py`, `handlers.py`)."""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import pandas as pd

from eagle_engine.config import CONTEXT_DRAFTS, ConfigError, SamplingParams, TreeParams
from eagle_engine.engine import DEFAULT_HEAD
from eagle_engine.events import StepEvent, TreeNode
from eagle_engine.tools.autotune import tree_label

from .speed_estimate import Estimate, Verify, verify_of

KIND_CLASS = {"accepted": "tok-acc", "context": "tok-ctx", "rejected": "tok-rej",
              "bonus": "tok-bonus", "target": "tok-target"}
KIND_LABEL = {"accepted": "accepted draft", "context": "draft from context",
              "rejected": "rejected draft", "bonus": "target token (bonus)",
              "target": "target token"}
FINISH_TEXT = {"eos": "end of answer", "stop": "stop string", "context": "context window full"}
LEGEND_HINT = {"accepted": "solid underline", "context": "double underline",
               "rejected": "struck through", "bonus": "dotted underline", "target": "plain"}
SOURCE_TEXT = {"context": "drafted from the context", "both": "head and context agreed"}
DRAFTED = ("accepted", "context")  # the kinds of accepted draft tokens
STEPS_SHOWN, ACCEPTED_SHOWN = 20, 5  # the step plot's axes span at least these (`steps_axes`)
# Whitespace as a visible glyph: in tree labels, and in rejected drafts (`rejected_text`)
GLYPHS = str.maketrans({"\n": "⏎", " ": "␣", "\t": "⇥"})


class HeadLike(Protocol):
    name: str
    num_layers: int
    use_aux: bool
    draft_vocab_size: int


def rejected_text(text: str) -> str:
    """A rejected draft's text as prose shows it: its line breaks as "⏎", so that it never
    starts a line the answer does not have, and a draft of whitespace alone as glyphs ("␣" a
    space), which would otherwise show as nothing."""
    if text.isspace():
        return text.translate(GLYPHS)
    return text.replace("\n", "⏎")


def span_html(text: str, kind: str, step: int, depth: int, in_code: bool = False,
              source: str = "") -> str:
    """One token as an escaped span with its kind's class and a (kind, step, depth, who
    drafted it) tooltip. A rejected draft in prose shows its whitespace as glyphs
    (`rejected_text`); inside a code block tokens get the `in-code` class (monospace), and a
    rejected draft becomes an empty marker whose tooltip holds its text, so the code reads as
    code."""
    if not text:
        return ""
    tip = (f"{KIND_LABEL[kind]} · step {step}" + (f" · depth {depth}" if depth else "")
           + (f" · {SOURCE_TEXT[source]}" if source in SOURCE_TEXT and kind != "context"
              else ""))
    cls = f"tok {KIND_CLASS[kind]}" + (" in-code" if in_code else "")
    if kind == "rejected" and in_code:
        tip = html.escape(f"{tip}: {text!r}")
        return f'<del class="{cls} rej-mark" title="{tip}" aria-label="{tip}"></del>'
    if kind == "rejected":
        return f'<del class="{cls}" title="{tip}">{html.escape(rejected_text(text))}</del>'
    return f'<span class="{cls}" title="{tip}">{html.escape(text)}</span>'


def in_code_block(text: str) -> bool:
    """Whether text that follows `text` lies inside a Markdown fenced code block (an odd
    number of ``` fences so far)."""
    return text.count("```") % 2 == 1


def legend_html() -> str:
    items = "".join(
        f'<span class="legend-item"><span class="tok {KIND_CLASS[k]}">{KIND_LABEL[k]}</span>'
        f'<span class="legend-hint">{LEGEND_HINT[k]}</span></span>' for k in KIND_CLASS)
    return f'<div class="legend" role="list" aria-label="token legend">{items}</div>'


def user_html(text: str) -> str:
    return html.escape(text)


def chat_display(turns: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Chatbot messages of a session's turns: escaped user text, rendered answer spans."""
    return [m for t in turns for m in ({"role": "user", "content": user_html(t["user"])},
                                       {"role": "assistant", "content": t["html"]})]


def engine_status(config: Any, num_heads: int, weights: Sequence[str],
                  tuned: str | None = None, measuring: str | None = None) -> str:
    """Markdown naming the target, heads, device, dtype, the target weights the app holds
    (`EngineConfig.weights_label` of each), whether CUDA graphs run and, when the fastest
    weights and tree were measured on this machine (`autotune.Tuned.summary` with trees named
    by `tree_named`: figures and escaped names), what was measured; `measuring`: the start-up
    measurement running now."""
    target = ("SmolLM2-135M-Instruct (bundled)" if config.target == "bundled"
              else html.escape(str(config.target)))
    graphs = "on" if config.cuda_graphs and str(config.device).startswith("cuda") else "off"
    return (f"**Target** {target}  \n**Draft heads loaded** {num_heads}  \n"
            f"**Device** {config.device} · **dtype** {config.dtype} · **target weights** "
            f"{' / '.join(weights)} · **CUDA graphs** {graphs}"
            + (f"  \n**Measured at start-up, on short fixed prompts** {weights[0]} weights, "
               f"{tuned}" if tuned else "")
            + (f"  \n**Start-up measurement** {html.escape(measuring, quote=False)}, between "
               "visitors' answers (yours come first); until it ends the tree is this CPU's "
               "default"
               if measuring else ""))


@dataclass
class AnswerView:
    """Accumulates one answer's events: rendered spans, plain text, its token ids, per-step
    counts, last tree, its verify forwards (`speed_estimate.Verify`) and per event its time and
    the token elements drawn so far (`race.Lane`). An answer that continues another starts with
    `shown` set to that answer's text (whether it goes on inside a code block)."""

    parts: list[str] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    shown: str = ""  # the kept spans' text: `text` less what a stop string held back
    ids: list[int] = field(default_factory=list)  # the answer's token ids (no rejected draft)
    accepted_per_step: list[int] = field(default_factory=list)
    tree: list[TreeNode] = field(default_factory=list)
    tree_step: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    finished: str | None = None
    verifies: list[Verify] = field(default_factory=list)  # its verify forwards (the estimate)
    # per event: the engine's seconds on the answer after it, and the token elements (non-empty
    # parts) drawn so far (the race replays them)
    marks: list[tuple[float, int]] = field(default_factory=list)
    elements: int = 0

    def _add(self, text: str, kind: str, step: int, depth: int, source: str = "") -> None:
        """Append a span; the answer's kept text so far says whether it is inside code."""
        part = span_html(text, kind, step, depth, in_code_block(self.shown), source)
        self.parts.append(part)
        self.elements += bool(part)
        self.spans.append({"text": text, "kind": kind, "step": step, "depth": depth,
                           "source": source})
        if kind != "rejected":
            self.shown += text

    def add(self, ev: StepEvent) -> None:
        """Accepted drafts, then the rejected drafts the bonus token replaced, then the bonus."""
        if (verify := verify_of(ev, self.num_tokens)) is not None:
            self.verifies.append(verify)
        n_acc = sum(t.kind in DRAFTED for t in ev.tokens)
        has_bonus = any(t.kind == "bonus" for t in ev.tokens)
        for t in ev.tokens:
            self.ids.append(t.token_id)
            if t.kind == "bonus":
                for r in ev.rejected:
                    self._add(r.text, "rejected", ev.step, r.depth, r.source)
            self._add(t.text, t.kind, ev.step, n_acc + 1 if t.kind == "bonus" else t.depth,
                      t.source)
        if ev.rejected and not has_bonus and not ev.finished:
            for r in ev.rejected:
                self._add(r.text, "rejected", ev.step, r.depth, r.source)
        self.text += ev.text
        if ev.mode == "eagle" and ev.step > 0 and (ev.tokens or ev.tree):
            self.accepted_per_step.append(n_acc)
        if ev.tree:
            self.tree, self.tree_step = ev.tree, ev.step
        self.stats, self.finished = ev.stats, ev.finished
        self.marks.append((float(ev.stats.get("elapsed_s", 0.0)), self.elements))

    def html(self) -> str:
        """The spans only, no wrapper: a growing answer is then an append-only string, which
        Gradio streams as small `append` diffs."""
        return "".join(self.parts)

    @property
    def num_tokens(self) -> int:
        return int(self.stats.get("num_tokens", 0))


def acceptance_rate(stats: dict[str, Any]) -> float | None:
    """Accepted draft tokens / draft positions offered (steps x depth)."""
    per_depth = stats.get("acceptance_per_depth") or []
    return sum(per_depth) / len(per_depth) if per_depth else None


def _tile(tile_id: str, value: str, label: str, hint: str) -> str:
    return (f'<div class="tile" id="{tile_id}" title="{html.escape(hint)}">'
            f'<div class="tile-value">{value}</div><div class="tile-label">{label}</div></div>')


def speedup_tile(speedup: float | None, estimate: Estimate | None,
                 stats: dict[str, Any], unknown: str | None = None, held: bool = False
                 ) -> str:
    """The measured speedup when the race ran (with the estimate beside it), else the
    estimate, each named for what it is; else `unknown`, why there is no figure. `held`: the
    measured value sits in a `race-held` element, hidden while the race panel replays the two
    runs (assets/style.css)."""
    if speedup:
        shown = (f"; estimated ≈{estimate.speedup:.2f}×" if estimate
                 else f"; {unknown}" if unknown == MACHINE_BUSY else "")
        value = f"{speedup:.2f}×"
        value = f'<span class="race-held">{value}</span>' if held else value
        return _tile("tile-speedup", value, f"this answer, raced{shown}",
                     ("plain decoding's time for these tokens ÷ this answer's engine time, both "
                      "measured on this prompt; both count this answer's prefill (plain "
                      "decoding ran second, with the prompt already cached)"))
    if estimate:
        hint = estimate.explain(int(stats.get("num_tokens", 0)), stats.get("elapsed_s", 0.0))
        return _tile("tile-speedup", f"≈{estimate.speedup:.2f}×",
                     'this answer vs plain, <span class="est-badge">estimated</span>',
                     hint + " " + ESTIMATE_VS_STARTUP)
    if unknown:
        return _tile("tile-speedup", "…" if unknown == ESTIMATE_PENDING else "busy", unknown,
                     UNKNOWN_HINT[unknown])
    return _tile("tile-speedup", "—", "speedup vs plain",
                 "shown for EAGLE-3 answers: estimated from this answer's verify forwards (none "
                 "when another visitor's request shared its steps), or measured by racing plain "
                 "decoding")


# Why an EAGLE-3 answer's speedup tile has no figure (`speedup_tile`'s `unknown`).
ESTIMATE_PENDING = "estimate after start-up measurement"
MACHINE_BUSY = "the machine is busy; timings are unreliable"
UNKNOWN_HINT = {
    ESTIMATE_PENDING: "the estimate needs what a verify forward costs on this machine, measured "
    "once after start-up between visitors' answers; the next answers show it",
    MACHINE_BUSY: "other work took this machine's cores during the answer (the engine got much "
    "less CPU time than it asked for), so its times say more about the load than about "
    "speculative decoding",
}
ESTIMATE_VS_STARTUP = ("The sidebar's start-up figures time short, fixed prompts; this answer's "
                       "estimate uses its own steps, so the two differ.")


def tiles_html(stats: dict[str, Any], eagle: bool, speedup: float | None = None,
               estimate: Estimate | None = None, unknown: str | None = None,
               note: str | None = None, held: bool = False) -> str:
    """The answer's tiles; `unknown`: why an EAGLE-3 answer shows no speedup (`speedup_tile`);
    `note`: a sentence under them (why EAGLE-3 cannot pay on this machine); `held`: a raced
    speedup hidden until the race's replay ends."""
    rate = acceptance_rate(stats) if eagle else None
    tau = stats.get("tau", 0.0)
    tiles = [
        _tile("tile-tps", f"{stats.get('tokens_per_s', 0.0):.1f}", "tokens/s",
              "generated tokens / engine time, prefill included (drawing the page not counted)"),
        _tile("tile-tau", f"{tau:.2f}" if eagle and tau else "—", "mean accepted length τ",
              "tokens per target forward (accepted drafts + 1)"),
        _tile("tile-acc", f"{100 * rate:.0f}%" if rate is not None else "—", "acceptance rate",
              "accepted draft tokens / (steps × draft depth)"),
        speedup_tile(speedup, estimate if eagle else None, stats, unknown if eagle else None,
                     held),
    ]
    below = f'<div class="tiles-note" id="tiles-note">{html.escape(note)}</div>' if note else ""
    return f'<div class="tiles">{"".join(tiles)}</div>{below}'


def timing_html(stats: dict[str, Any]) -> str:
    phases = {k: v for k, v in (stats.get("phase_s") or {}).items() if v > 0}
    if not phases:
        return '<div class="timing empty">Per-phase timing appears after a run.</div>'
    total = sum(phases.values())
    steps = max(int(stats.get("num_steps", 0)), 1)
    rows = "".join(
        f'<tr><td>{html.escape(k)}</td><td>{1000 * v:.1f}</td>'
        f'<td>{"—" if k == "prefill" else f"{1000 * v / steps:.2f}"}</td>'
        f'<td><span class="bar" style="width:{100 * v / total:.0f}%"></span> '
        f'{100 * v / total:.0f}%</td></tr>' for k, v in phases.items())
    return ('<table class="timing"><thead><tr><th>phase</th><th>total ms</th><th>ms / step</th>'
            f'<th>share</th></tr></thead><tbody>{rows}</tbody></table>')


def steps_frame(accepted_per_step: Sequence[int]) -> pd.DataFrame:
    return pd.DataFrame({"step": list(range(1, len(accepted_per_step) + 1)),
                         "accepted": list(accepted_per_step)})


def steps_axes(accepted_per_step: Sequence[int]) -> dict[str, list[float]]:
    """The step plot's axis limits: at least STEPS_SHOWN steps and ACCEPTED_SHOWN accepted
    tokens, so a short answer's ticks fall on whole numbers (fitted to 3 steps, the chart puts
    them at 0.8, 1.0, 1.2, ...)."""
    return {"x_lim": [0, max(len(accepted_per_step), STEPS_SHOWN) + 1],
            "y_lim": [0, max(max(accepted_per_step, default=0), ACCEPTED_SHOWN)]}


def _tree_rows(nodes: Sequence[TreeNode]) -> list[int]:
    """Row of each node: children are stacked in their parent's order, so edges rarely cross."""
    order: list[int] = []
    children: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent, []).append(i)
    stack = list(reversed(children.get(-1, [])))
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children.get(i, [])))
    rows, next_row = [0] * len(nodes), {}
    for i in order:
        d = nodes[i].depth
        rows[i] = next_row.get(d, 0)
        next_row[d] = rows[i] + 1
    return rows


def _label(text: str) -> str:
    shown = text.translate(GLYPHS)
    return html.escape(shown if len(shown) <= 9 else shown[:8] + "…")


def tree_svg(nodes: Sequence[TreeNode], step: int = 0) -> str:
    """The verified draft tree: one column per depth, accepted path bold with a check mark;
    nodes drafted from the context have a dashed outline (dash-dot where the head proposed
    the same token), and their tooltip says so."""
    if not nodes:
        return '<div class="tree empty">The latest draft tree shows here during an EAGLE run.</div>'
    rows = _tree_rows(nodes)
    col_w, row_h, box_w = 104, 26, 88
    pos = [(8 + n.depth * col_w, 6 + r * row_h) for n, r in zip(nodes, rows)]
    edges, boxes = [], []
    for i, n in enumerate(nodes):
        x, y = pos[i]
        if n.parent >= 0:
            px, py = pos[n.parent]
            cls = "edge acc" if n.accepted and nodes[n.parent].accepted else "edge"
            edges.append(f'<line class="{cls}" x1="{px + box_w}" y1="{py + 10}" x2="{x}" '
                         f'y2="{y + 10}"/>')
        cls = "node" + " acc" * n.accepted + {"context": " ctx", "both": " ctx both"}.get(
            n.source, "")
        mark = "✓ " if n.accepted and n.parent >= 0 else ""
        state = "accepted" if n.accepted else "not accepted"
        source = f" · {SOURCE_TEXT[n.source]}" if n.source in SOURCE_TEXT else ""
        boxes.append(f'<g class="{cls}"><title>depth {n.depth} · draft path probability '
                     f'{n.score:.2f}{source} · {state}: '
                     f'{html.escape(repr(n.text))}</title><rect x="{x}" y="{y}" width="{box_w}" '
                     f'height="20" rx="4"/><text x="{x + 5}" y="{y + 14}">{mark}'
                     f'{_label(n.text)}</text></g>')
    width = 16 + (max(n.depth for n in nodes) + 1) * col_w
    height = 12 + (max(rows) + 1) * row_h
    from_context = sum(n.source in SOURCE_TEXT for n in nodes)
    caption = (f"Draft tree of step {step}: {len(nodes)} nodes; accepted path bold with ✓ "
               "(root = last committed token)"
               + (f"; {from_context} from the context, dashed outline" if from_context else ""))
    return (f'<div class="tree"><div class="tree-caption">{caption}</div><svg role="img" '
            f'aria-label="{caption}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">{"".join(edges)}{"".join(boxes)}</svg></div>')


def tree_words(tree: TreeParams) -> str:
    """A tree's shape as visitors read it: "chain of 1 draft" (one draft a step), "tree: 3 wide,
    2 deep, 5 nodes" (nodes counting the root), with " + context drafts" when it also drafts
    from the context. Tooltips hold the compact label (`autotune.tree_label`, "k1 s1 n2
    +ctx+8") with the finer settings."""
    drafts = tree.num_draft_tokens - 1
    shape = (f"chain of {drafts} draft{'s' * (drafts != 1)}" if tree.topk == 1 or drafts == 1
             else f"tree: {tree.topk} wide, {tree.num_steps} deep, {tree.num_draft_tokens} nodes")
    return shape + (" + context drafts" if tree.context_drafts else "")


def tree_named(tree: TreeParams) -> str:
    """`tree_words` with the compact label as its tooltip (HTML)."""
    return (f'<span class="tree-name" title="{html.escape(tree_label(tree))}">'
            f"{html.escape(tree_words(tree))}</span>")


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokens_text(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


@dataclass(frozen=True)
class Settings:
    """The sidebar values, in the order of the event inputs after the prompt and the history."""

    spec: bool
    aux: bool
    layers: int
    topk: int
    num_steps: int
    num_draft_tokens: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: float | None
    compare: bool
    weights: str  # `EngineConfig.weights_label` of the target to run
    context_drafts: bool = CONTEXT_DRAFTS  # add the context's suffix-match chain to the tree
    min_score: float = 0.0  # verify only drafts whose path probability reaches this
    context_extra: int = 0  # the context's chain past num_draft_tokens, where it is sure
    step_cut: float = 0.0  # head steps past the first only while the best path reaches this

    def request(self, heads: list[Any]) -> tuple[SamplingParams, TreeParams, str | None]:
        """Engine parameters; top_p and seed only apply when sampling. Raises ConfigError."""
        sampling_on = bool(self.temperature and self.temperature > 0)
        sampling = SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_p=self.top_p if sampling_on else 1.0,
            seed=int(self.seed) if sampling_on and self.seed is not None else None)
        tree = TreeParams(self.topk, self.num_steps, self.num_draft_tokens,
                          bool(self.context_drafts), float(self.min_score or 0.0),
                          int(self.context_extra or 0), float(self.step_cut or 0.0))
        if not self.spec:
            if self.compare:
                raise ConfigError("compare needs speculative decoding on: with it off the "
                                  "answer already is the baseline")
            return sampling, tree, None
        head = pick_head(heads, self.aux, self.layers)
        if head is None:
            raise ConfigError(head_note(heads, True, self.aux, self.layers))
        return sampling, tree, head


SETTING_NAMES = [f.name for f in fields(Settings)]


def run_record(view: AnswerView, head: str | None, speedup: float | None,
               base: AnswerView | None, greedy: bool, weights: str,
               estimate: Estimate | None = None,
               race: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON summary of a finished answer (and its baseline run and their race's recorded
    timings, `race.race_data`, when compared)."""
    return {"head": head, "weights": weights, "text": view.text, "spans": view.spans,
            "stats": view.stats,
            "finished": view.finished, "speedup": speedup,
            "speedup_estimate": estimate and estimate.speedup,
            "baseline": base and {"text": base.text, "stats": base.stats},
            "greedy_identical": base.text == view.text if base and greedy else None,
            "race": race}


def pick_head(heads: Iterable[HeadLike], aux: bool, layers: int) -> str | None:
    """Name of the loaded head with this aux setting and layer count, if any."""
    return next((h.name for h in heads if h.use_aux == aux and h.num_layers == layers), None)


def same_controls(heads: Iterable[HeadLike]) -> str | None:
    """Why the sidebar cannot reach every head, if it cannot: it picks one by aux on/off and
    layer count, so two heads with the same pair leave the second unreachable."""
    seen: dict[tuple[bool, int], str] = {}
    for h in heads:
        if (other := seen.setdefault((h.use_aux, h.num_layers), h.name)) != h.name:
            return (f"heads {other!r} and {h.name!r} both have aux hidden states "
                    f"{'on' if h.use_aux else 'off'} and {h.num_layers} layer(s); the sidebar "
                    "picks a head by those two, so load one of them")
    return None


def default_head(heads: Sequence[HeadLike]) -> HeadLike | None:
    """The engine's default head (aux, one layer) when loaded, else the first one."""
    return next((h for h in heads if h.name == DEFAULT_HEAD), heads[0] if heads else None)


def layer_choices(heads: Iterable[HeadLike], aux: bool) -> list[int]:
    return sorted({h.num_layers for h in heads if h.use_aux == aux})


def head_note(heads: Sequence[HeadLike], spec: bool, aux: bool, layers: int) -> str:
    """Markdown saying which head the sidebar selects, or why none applies."""
    if not heads:
        return "No draft head is loaded: only the baseline (target alone) can run."
    if not spec:
        return "Speculative decoding is off: the target decodes alone; draft settings don't apply."
    name = pick_head(heads, aux, layers)
    if name is None:
        have = ", ".join(f"{h.name} ({h.num_layers} layer, aux {'on' if h.use_aux else 'off'})"
                         for h in heads)
        return (f"No head with aux {'on' if aux else 'off'} and {layers} layer(s) is loaded. "
                f"Loaded: {have}.")
    h = next(h for h in heads if h.name == name)
    return (f"Draft head **{name}**: {h.num_layers} layer(s), aux hidden states "
            f"{'on' if h.use_aux else 'off'}, draft vocab {h.draft_vocab_size}.")
