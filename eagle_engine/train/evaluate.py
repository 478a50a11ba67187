"""`python -m eagle_engine eval-head`: a head's held-out accuracy, measured the way training does.

The target answers held-out prompts greedily, features are extracted as for training, and the
head's per-step top-1 accuracy against the target (step 0 = first draft token, later steps fed
their own outputs, as in training-time test) is computed by the trainer's own loss function
(`trainer.step_accuracy`, as in training's held-out evaluation) over the answer tokens whose
target choice lies in the draft vocabulary, beside how often it does (the coverage) and the
accuracy over every answer token, which compares heads of different draft vocabularies.
Set beside the training log's accuracy it shows how much of a head's skill is memorized.
Not here: speed or tree acceptance (`tools/bench.py`).
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from ..baseline import generate_batch
from ..chat import encode_chat, stop_token_ids
from ..config import SamplingParams
from ..models.draft_io import load_draft
from ..models.draft_model import Eagle3Draft
from ..models.loader import load_target, load_tokenizer, resolve_target
from ..models.target import TargetModel
from .features import extract, load_samples
from .trainer import TrainParams, collate, group_batches, step_accuracy, train_dtype


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-head", help="held-out per-step accuracy of a draft head")
    p.add_argument("--draft", required=True, help="head directory or bundled head name")
    p.add_argument("--prompts", type=Path, required=True, help="prompt JSONL (first turns)")
    p.add_argument("--target", default="bundled")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--ttt-length", type=int, default=4)
    p.set_defaults(func=cmd_eval_head)


@torch.no_grad()
def heldout_accuracy(model: Eagle3Draft, target: TargetModel, prompts: list[list[int]],
                     eos_ids: tuple[int, ...], max_new_tokens: int, ttt_length: int
                     ) -> tuple[list[float], list[float], int, float]:
    """-> (top-1 accuracy per TTT step over the scored answer tokens, the same over every answer
    token, number of scored tokens, share of the answer tokens, the target's greedy choices, that
    lie in the draft vocabulary)."""
    answers = generate_batch(target, prompts, SamplingParams(max_new_tokens=max_new_tokens),
                             eos_ids)
    rows = [{"prompt_ids": p, "response_ids": a} for p, a in zip(prompts, answers)]
    aux_ids = model.cfg.resolve_aux_layer_ids(target.cfg) if model.cfg.use_aux_hidden_state \
        else target.cfg.default_aux_layer_ids()
    with tempfile.TemporaryDirectory() as tmp:
        samples = load_samples(extract(target, rows, aux_ids, Path(tmp)))
    hot = model.hot_ids
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    in_vocab[hot] = True
    target_head = target.lm_head.weight[hot].to(train_dtype(target.lm_head.weight.device))
    params = TrainParams(ttt_length=ttt_length)
    lengths = [s.ids.numel() for s in samples]
    batches = [collate(samples, group, in_vocab)
               for group in group_batches(lengths, params.tokens_per_batch, random.Random(0))]
    n = sum(int(b.valid.sum()) for b in batches)
    tokens = torch.tensor([t for a in answers for t in a], dtype=torch.long)
    coverage = float(in_vocab[tokens].float().mean()) if tokens.numel() else 0.0
    accs = step_accuracy(model, batches, target_head, params)
    every = [a * sum(int(b.valid[:, k + 1:].sum()) for b in batches)
             / max(sum(int(b.response[:, k + 1:].sum()) for b in batches), 1)
             for k, a in enumerate(accs)]  # a miss wherever the choice lies outside the vocab
    return accs, every, n, coverage


def cmd_eval_head(args: argparse.Namespace) -> None:
    from ..chat import load_rows
    from ..engine import head_source

    rows = load_rows(args.prompts, args.limit)
    directory = resolve_target(args.target)
    target = load_target(directory, train_dtype(torch.device("cpu")), "cpu", 2048)
    tokenizer = load_tokenizer(directory)
    head = head_source(args.draft)
    model = load_draft(head, target.cfg, target.embed_tokens, target.lm_head, 4096,
                       torch.float32, "cpu")
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": r["turns"][0]}])
               for r in rows]
    eos = stop_token_ids(target.cfg.eos_token_ids, tokenizer)
    accs, every, n, coverage = heldout_accuracy(model, target, prompts, eos,
                                                args.max_new_tokens, args.ttt_length)
    print(json.dumps({"head": str(head), "prompts": len(prompts), "scored_tokens": n,
                      "step_accuracy": [round(a, 3) for a in accs],
                      "step_accuracy_every_token": [round(a, 3) for a in every],
                      "draft_vocab_coverage": round(coverage, 4)}))
