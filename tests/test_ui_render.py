"""What `playground/ui_render.py` draws, on fixed data: a rejected draft in prose never breaks
the answer's lines (its line breaks and a draft of whitespace alone show as glyphs; in code it
stays an empty marker), a tree's shape in words beside its compact label, and token counts in
the singular for one. No app, no engine.
"""
from __future__ import annotations

import html
import re

import pytest

from eagle_engine.config import TreeParams
from eagle_engine.events import StepEvent
from eagle_engine.events import TokenSpan as T
from eagle_engine.tools.autotune import tree_label
from playground import ui_render as ui


@pytest.mark.parametrize("text, shown", [
    ("\n", "⏎"), ("\n\n", "⏎⏎"), (" ", "␣"), ("  ", "␣␣"), ("\t", "⇥"), ("\n  ", "⏎␣␣"),
    (" good", " good"), ("\n\nThe", "⏎⏎The"), ("end.\n", "end.⏎"),
])
def test_a_rejected_draft_shows_its_whitespace_as_glyphs(text: str, shown: str) -> None:
    assert ui.rejected_text(text) == shown
    span = ui.span_html(text, "rejected", 2, 1)
    tip = "rejected draft · step 2 · depth 1"
    assert span == f'<del class="tok tok-rej" title="{tip}">{shown}</del>'


def rejected_newline_events() -> list[StepEvent]:
    """"Jane: I'm a tech" then "Bob" on a line of its own, with rejected drafts of a line break
    after "Jane", of " good" before " tech" and of a blank line before "Bob"."""
    return [StepEvent(0, "eagle", [T(1, "Jane", "target", 0)], "Jane"),
            StepEvent(1, "eagle", [T(2, ":", "bonus", 0)], ":",
                      rejected=[T(3, "\n", "rejected", 1)]),
            StepEvent(2, "eagle", [T(4, " I'm", "accepted", 1), T(5, " a", "accepted", 2),
                                   T(6, " tech", "bonus", 0)], " I'm a tech",
                      rejected=[T(7, " good", "rejected", 3)]),
            StepEvent(3, "eagle", [T(8, "\n", "accepted", 1), T(9, "Bob", "bonus", 0)], "\nBob",
                      rejected=[T(10, "\n\n", "rejected", 2)])]


def test_rejected_drafts_leave_the_answers_line_breaks_where_the_answer_has_them() -> None:
    view = ui.AnswerView()
    for ev in rejected_newline_events():
        view.add(ev)
    page = view.html()
    rejected = re.findall(r'<del class="tok tok-rej"[^>]*>(.*?)</del>', page)
    assert rejected == ["⏎", " good", "⏎⏎"]
    shown = html.unescape(re.sub(r"<[^>]+>", "", page))  # what the page shows, drafts included
    assert shown.count("\n") == view.text.count("\n") == 1
    assert shown.split("\n") == ["Jane⏎: I'm a good tech", "⏎⏎Bob"]
    assert view.text == "Jane: I'm a tech\nBob"


def test_in_code_a_rejected_line_break_stays_an_empty_marker() -> None:
    span = ui.span_html("\n", "rejected", 4, 2, in_code=True)
    assert span.endswith("></del>") and "⏎" not in span
    assert "title=\"rejected draft · step 4 · depth 2: &#x27;\\n&#x27;\"" in span


def test_tree_labels_show_whitespace_as_the_rejected_drafts_do() -> None:
    from eagle_engine.events import TreeNode

    svg = ui.tree_svg([TreeNode(1, " a", -1, 0, True, 1.0), TreeNode(2, "\n\t", 0, 1, False, 0.3)])
    assert ">␣a</text>" in svg and ">⏎⇥</text>" in svg


@pytest.mark.parametrize("tree, words, label", [
    (TreeParams(1, 1, 2, False), "chain of 1 draft", "k1 s1 n2"),
    (TreeParams(1, 1, 2, True, context_extra=8), "chain of 1 draft + context drafts",
     "k1 s1 n2 +ctx+8"),
    (TreeParams(1, 3, 4, False), "chain of 3 drafts", "k1 s3 n4"),
    (TreeParams(3, 2, 5, False), "tree: 3 wide, 2 deep, 5 nodes", "k3 s2 n5"),
    (TreeParams(3, 2, 5, True, 0.1, 8, 0.5), "tree: 3 wide, 2 deep, 5 nodes + context drafts",
     "k3 s2 n5 min0.1 step0.5 +ctx+8"),
    (TreeParams(4, 3, 2, False), "chain of 1 draft", "k4 s3 n2"),  # room for one draft only
])
def test_tree_words_name_the_shape_and_the_label_keeps_the_details(
        tree: TreeParams, words: str, label: str) -> None:
    assert ui.tree_words(tree) == words
    assert tree_label(tree) == label


def test_one_token_is_singular() -> None:
    assert [ui.tokens_text(n) for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
