"""Stage 2: target features for training, cached on disk outside git.

One target forward over prompt + response per conversation gives what training needs per token:
the aux hidden states (inputs of the capture layers, `[T, num_aux * hidden]`), the final normed
hidden (the aux-off head's input, and the source of target logits on the draft vocabulary, which
training recomputes as `final @ W_lm[hot_ids]`), and the target's full-vocabulary argmax (to mask
positions whose target token is outside the draft vocabulary and to measure accuracy).
Shards are written one by one, so an interrupted run resumes. Not here: training.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..kv_cache import causal_mask
from ..models.target import TargetModel


@dataclass(slots=True)
class Sample:
    ids: torch.Tensor  # [T] int64 prompt + response tokens
    loss_mask: torch.Tensor  # [T] bool, True on response tokens
    aux: torch.Tensor  # [T, num_aux * hidden] bf16
    final: torch.Tensor  # [T, hidden] bf16 normed last hidden
    argmax: torch.Tensor  # [T] int64 target argmax at each position


def row_ids(row: dict, max_tokens: int) -> list[int]:
    """Prompt + response ids of one conversation, cut at `max_tokens`."""
    return (row["prompt_ids"] + row["response_ids"])[:max_tokens]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


@torch.inference_mode()
def extract(model: TargetModel, rows: list[dict], aux_ids: tuple[int, ...], out_dir: Path,
            shard_size: int = 128, max_tokens: int = 1024) -> list[Path]:
    """Write shards `features_{i:04d}_{rows}.pt` (lists of Sample dicts); returns all shard paths.
    The row count in the name makes a shard written before more rows arrived get rewritten."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in tqdm(range(0, len(rows), shard_size), desc="target features"):
        chunk = rows[start:start + shard_size]
        path = out_dir / f"features_{start // shard_size:04d}_{len(chunk)}.pt"
        shards.append(path)
        if path.exists():
            continue
        samples = []
        for row in chunk:
            ids = row_ids(row, max_tokens)
            T = len(ids)
            x = torch.tensor([ids], device=model.device)
            cache = model.new_cache(max_len=T)
            out = model(x, torch.arange(T, device=model.device)[None], cache, 0,
                        causal_mask(T, 0, model.device), aux_ids)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[len(row["prompt_ids"]):] = True
            samples.append({"ids": x[0].cpu(), "loss_mask": mask,
                            "aux": out.aux_hidden[0].to(torch.bfloat16).cpu(),
                            "final": out.final_hidden[0].to(torch.bfloat16).cpu(),
                            "argmax": out.logits[0].argmax(-1).cpu()})
        torch.save(samples, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return shards


def load_samples(shards: list[Path]) -> list[Sample]:
    out = []
    for path in shards:
        out += [Sample(**d) for d in torch.load(path, weights_only=True)]
    return out
