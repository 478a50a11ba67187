"""Plain autoregressive decoding with the target alone: the reference the speculative engine must
match, and the batched generator the training pipeline uses to build self-distillation data.

`generate_batch` decodes ragged prompts together (left padding, per-row RoPE positions, padded
cache rows masked out). The engine's plain decoding, streamed, runs in its scheduler
(`scheduler.py`), as EAGLE-3 does. Not here: sampling math (`sampling.py`).
"""
from __future__ import annotations

import torch

from .config import SamplingParams
from .kv_cache import causal_mask
from .models.target import TargetModel
from .sampling import next_token


@torch.inference_mode()
def generate_batch(model: TargetModel, prompts: list[list[int]], params: SamplingParams,
                   eos_ids: tuple[int, ...], generator: torch.Generator | None = None
                   ) -> list[list[int]]:
    """Decode every prompt; returns the generated ids of each row (stop token excluded).
    Finished rows leave the batch (with their cache rows) once an eighth of it has finished, so
    long answers do not keep paying for short ones."""
    B, P = len(prompts), max(len(p) for p in prompts)
    dev = model.device
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)  # [b] left padding per row
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
    positions = (torch.arange(P, device=dev)[None] - pad[:, None]).clamp_min(0)  # [b, P]
    cache = model.new_cache(batch=B, max_len=P + params.max_new_tokens)
    out = model(ids, positions, cache, 0, causal_mask(P, 0, dev, pad), last_only=True)
    eos = torch.tensor(eos_ids or (-1,), device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # [b]
    rows = torch.arange(B, device=dev)  # [b] prompt index of each batch row
    results: list[list[int]] = [[] for _ in prompts]
    for step in range(params.max_new_tokens):
        tok = next_token(out.logits[:, -1], params, generator)  # [b]
        tok = torch.where(done, eos[0], tok)
        for r, t, d in zip(rows.tolist(), tok.tolist(), done.tolist()):
            if not d:
                results[r].append(t)
        done |= torch.isin(tok, eos)
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        if int(done.sum()) >= max(1, done.numel() // 8):
            keep = (~done).nonzero()[:, 0]  # [b']
            cache = cache.keep_batch_rows(keep)
            tok, pad, positions, rows = tok[keep], pad[keep], positions[keep], rows[keep]
            done = done[keep]
        pos = positions[:, -1:] + step + 1  # [b, 1]
        start = P + step
        out = model(tok[:, None], pos, cache, start, causal_mask(1, start, dev, pad))
    return [r[:next((i for i, t in enumerate(r) if t in eos_ids), len(r))] for r in results]
