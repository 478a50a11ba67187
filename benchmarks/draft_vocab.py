"""Does a larger draft vocabulary raise a trained head's held-out accuracy?

    PYTHONPATH=. python benchmarks/draft_vocab.py --sizes 16384,24576 \
        --prompts ../shared/data/prompts/mtbench.jsonl [--head eagle3-aux-1layer] [--out runs/vocab]

Grows a trained head's draft vocabulary the way a warm start does (`train --init-from HEAD
--draft-vocab N`: its ids kept, the most frequent other ids of the saved answers in
`data/answers/` added, AlpacaEval answers left out; lm_head rows carried id by id and new rows
mapped from the target's, `vocab.carry_rows`), with no training, writes each grown head to
`--out/grown-N`, and measures each with eval-head's own function (`heldout_accuracy`, first
12 MT-bench questions): per-step accuracy over the tokens the vocabulary holds, over every
answer token (the comparable figure), and the coverage. One JSON line per head. tau of a grown
head: `python -m eagle_engine bench --heads HEAD,DIR ...`. Not a test.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from pathlib import Path

import torch

from eagle_engine.bench import load_rows
from eagle_engine.chat import encode_chat, stop_token_ids
from eagle_engine.engine import DEFAULT_HEAD, head_source
from eagle_engine.models.draft_io import load_draft, save_draft
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.loader import load_target, load_tokenizer, resolve_target
from eagle_engine.train.evaluate import heldout_accuracy
from eagle_engine.train.pipeline import inherited_vocab, init_head
from eagle_engine.train.trainer import train_dtype
from eagle_engine.train.vocab import token_counts

ANSWERS = Path("data/answers/smollm2-135m-instruct.jsonl.gz")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16384,24576")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--head", default=DEFAULT_HEAD)
    p.add_argument("--answers", type=Path, default=ANSWERS)
    p.add_argument("--out", type=Path, default=Path("runs/vocab"))
    p.add_argument("--limit", type=int, default=12)
    args = p.parse_args()
    directory = resolve_target("bundled")
    target = load_target(directory, train_dtype(torch.device("cpu")), "cpu", 2048)
    tokenizer = load_tokenizer(directory)
    with gzip.open(args.answers, "rt") as f:
        rows = [json.loads(line) for line in f]
    counts = token_counts([r["response_ids"] for r in rows if r["source"] != "alpaca_eval"])
    source = head_source(args.head)
    heads = {str(source): source}
    base = load_draft(source, target.cfg, target.embed_tokens, target.lm_head, 4096,
                      torch.float32)
    for size in map(int, args.sizes.split(",")):
        model = Eagle3Draft(dataclasses.replace(base.cfg, draft_vocab_size=size), 4096).float()
        hot = inherited_vocab(Path(source), counts, size, target.cfg.vocab_size)
        init_head(model, target, hot, Path(source))
        model.share_embedding(target.embed_tokens)  # the target's, not saved with the head
        out = args.out / f"grown-{size}"
        save_draft(model, target.cfg, out, 8192)
        heads[str(out)] = out
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": r["turns"][0]}])
               for r in load_rows(args.prompts, args.limit)]
    eos = stop_token_ids(target.cfg.eos_token_ids, tokenizer)
    for name, path in heads.items():
        model = load_draft(path, target.cfg, target.embed_tokens, target.lm_head, 4096,
                           torch.float32)
        accs, every, n, coverage = heldout_accuracy(model, target, prompts, eos, 160, 4)
        print(json.dumps({"head": name, "draft_vocab": model.cfg.draft_vocab_size,
                          "scored_tokens": n, "step_accuracy": [round(a, 3) for a in accs],
                          "step_accuracy_every_token": [round(a, 3) for a in every],
                          "draft_vocab_coverage": round(coverage, 4)}), flush=True)


if __name__ == "__main__":
    main()
