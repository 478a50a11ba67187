"""Stage 1: self-distillation data. Samples prompts from prompt files (each mixed by source so
that GSM8K does not dominate) and has the target answer them with its own chat template, in
batches of similar length, mostly greedy with a share of sampled answers; more than one answer
per prompt (per source: open-ended prompts gain most) adds sampled answers (ids `{id}#{j}`), new
contexts without new prompts. Appends to a JSONL file and skips answers already written, so an
interrupted run resumes (and more answers per prompt only generates the new ones); saved sets
(`data/answers/`) can seed it. `teacher_rows` is the other source: conversations whose answers
someone else wrote (`data/corpus/`), cut into the same rows for teacher-forced training on their
own text, with no generation. Not here: features or training."""
from __future__ import annotations

import gzip
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..baseline import generate_batch
from ..chat import encode_chat
from ..config import ConfigError, SamplingParams
from ..models.target import TargetModel


def copy_responses(sources: list[Path], dst: Path) -> None:
    """Start a work directory's answers from saved sets (plain or gzipped JSONL), one after
    the other."""
    with dst.open("w") as out:
        for src in sources:
            opener = gzip.open if src.suffix == ".gz" else open
            with opener(src, "rt") as f:
                text = f.read()
            out.write(text if not text or text.endswith("\n") else text + "\n")


def teacher_rows(path: Path, tokenizer: Any, limit: int, seed: int, max_prompt_tokens: int = 512,
                 max_tokens: int = 1024) -> list[dict]:
    """Up to `limit` conversations of a JSONL file (plain or gzipped) of
    `{"id", "source", "messages": [{"role", "content"}...]}` as training rows: `prompt_ids` are
    the first user turn with the assistant header, `response_ids` the rest of the conversation as
    the chat template writes it (answers and later user turns, all scored), cut at `max_tokens`
    in all. Chosen in a seeded order; conversations whose first turn exceeds `max_prompt_tokens`
    or whose template is not prefix-stable are skipped. `temperature` is None: not sampled."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        convs = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(convs)
    rows = []
    for conv in convs:
        if len(rows) == limit:
            break
        msgs = conv["messages"]
        prompt = encode_chat(tokenizer, msgs[:1])
        full = encode_chat(tokenizer, msgs, generation_prompt=False)
        if len(prompt) > max_prompt_tokens or full[:len(prompt)] != prompt \
                or len(full) <= len(prompt) + 1:
            continue
        rows.append({"id": conv["id"], "source": conv["source"], "prompt_ids": prompt,
                     "response_ids": full[len(prompt):max_tokens], "temperature": None})
    return rows


def select_prompts(path: Path, limit: int, seed: int, max_share: float = 0.35) -> list[dict]:
    """Up to `limit` prompts of a JSONL file (plain or gzipped) of `{"id", "source", "turns"}`;
    where the file holds several sources, none takes more than `max_share` of them."""
    by_source: dict[str, list[dict]] = defaultdict(list)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    for line in text.split("\n"):  # not splitlines(): prompts contain U+2028
        if not line.strip():
            continue
        row = json.loads(line)
        by_source[row["source"]].append(row)
    rng = random.Random(seed)
    cap = max(1, int(limit * max_share)) if len(by_source) > 1 else limit
    chosen: list[dict] = []
    for source in sorted(by_source, key=lambda s: len(by_source[s])):
        rows = by_source[source]
        rng.shuffle(rows)
        room = limit - len(chosen)
        chosen += rows[:min(cap, room, len(rows))]
    rng.shuffle(chosen)
    return chosen


def select_prompt_files(files: list[tuple[Path, int]], seed: int) -> list[dict]:
    """`select_prompts` of each (file, limit), in order: adding a file leaves the prompts drawn
    from the others as they were. Refuses an id drawn twice (the same file given twice)."""
    chosen = [row for path, limit in files for row in select_prompts(path, limit, seed)]
    counts = Counter(row["id"] for row in chosen)
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:
        raise ConfigError(f"{len(repeated)} prompt ids drawn twice from the --prompts files "
                          f"{[str(p) for p, _ in files]}, e.g. {repeated[0]!r}")
    return chosen


def answer_ids(prompts: list[dict], samples: Callable[[str], int]) -> list[str]:
    """Ids of the answers wanted: `{id}` and `{id}#{j}` for j < samples(source)."""
    return [row["id"] if j == 0 else f"{row['id']}#{j}"
            for row in prompts for j in range(samples(row["source"]))]


def generate_responses(model: TargetModel, tokenizer: Any, prompts: list[dict], out_path: Path,
                       max_new_tokens: int, batch_size: int, sampled_share: float, seed: int,
                       samples: Callable[[str], int] = lambda source: 1,
                       max_prompt_tokens: int = 512, deadline: float | None = None) -> bool:
    """Append {id, source, prompt_ids, response_ids, temperature} rows to `out_path`, for
    `samples(source)` answers per prompt; `response_ids` end with the stop token unless the
    answer was cut at `max_new_tokens`. The first answer to a prompt is sampled with
    probability `sampled_share`, every further one always. Starts no batch after `deadline`
    (`time.time()`); returns True when every answer is written."""
    done = set()
    if out_path.exists():
        done = {json.loads(l)["id"] for l in out_path.read_text().split("\n") if l.strip()}
    todo = []
    rng = random.Random(seed)
    for row in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        first_temp = 0.7 if rng.random() < sampled_share else 0.0
        if len(ids) > max_prompt_tokens:
            continue
        for j, rid in enumerate(answer_ids([row], samples)):
            if rid not in done:
                todo.append((first_temp if j == 0 else 0.7, len(ids), rid, row, ids))
    todo.sort(key=lambda t: (t[0], t[1]))  # batch by mode, then by prompt length
    eos = tuple(tokenizer.convert_tokens_to_ids([tokenizer.eos_token]))
    gen = torch.Generator(model.device).manual_seed(seed)
    with out_path.open("a") as f, tqdm(total=len(todo), desc="self-distillation") as bar:
        for i in range(0, len(todo), batch_size):
            if deadline is not None and time.time() > deadline:
                return False
            chunk = todo[i:i + batch_size]
            temp = chunk[0][0]
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp,
                                    top_p=0.95 if temp else 1.0)
            outs = generate_batch(model, [c[4] for c in chunk], params, eos, gen)
            for (t, _, rid, row, ids), resp in zip(chunk, outs):
                stop = list(eos[:1]) if len(resp) < max_new_tokens else []  # not when cut off
                f.write(json.dumps({"id": rid, "source": row["source"], "prompt_ids": ids,
                                    "response_ids": resp + stop, "temperature": t}) + "\n")
            f.flush()
            bar.update(len(chunk))
    return True
