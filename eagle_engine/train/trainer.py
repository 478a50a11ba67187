"""Stage 4: training-time-test (TTT) training of EAGLE-3 heads on target features.

Step 0 at position t sees (target feature at t, token t+1) and learns the target's distribution
for token t+2; steps k = 1..ttt_length-1 feed the draft's own pre-norm output back as the hidden,
with RoPE position t+k, attending to the step-0 keys at positions <= t plus the "diagonal" keys of
its own earlier steps at t — exactly what a decode step sees at inference. Loss per step is the
soft cross-entropy against the target restricted to the draft vocabulary (renormalized), weighted
0.8^k; positions whose target argmax is outside the draft vocabulary are masked. Checkpoints and
a JSONL log per head are written to the run directory; an interrupted run resumes from the last
checkpoint. Several heads (aux on/off, layer counts) can train on the same batches. Not here:
where features come from (`features.py` caches them, `online.py` computes them per batch) or
evaluation.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ConfigError
from ..models.draft_model import DraftLayer, Eagle3Draft
from .features import Sample


@dataclass(frozen=True)
class TrainParams:
    epochs: float = 3.0
    lr: float = 1e-3
    warmup_steps: int = 10
    tokens_per_batch: int = 8192
    ttt_length: int = 6
    step_decay: float = 0.8
    grad_clip: float = 0.5
    seed: int = 0
    max_seq_len: int = 1024
    max_minutes: float | None = None  # time budget: shortens the schedule after 13 steps


@dataclass(slots=True)
class Batch:
    """One step's padded features, shared by every head trained on it (they share the draft
    vocabulary); `ttt_loss` picks `aux` or `final` as the input by the head's config."""
    ids: torch.Tensor  # [B, T] int64 (0-padded)
    aux: torch.Tensor  # [B, T, num_aux * Ht] target aux hidden states
    final: torch.Tensor  # [B, T, Ht] normed target hidden (the aux-off input, and target logits)
    valid: torch.Tensor  # [B, T] bool: response token with a target inside the draft vocab
    argmax: torch.Tensor  # [B, T] int64 target argmax


def group_batches(lengths: list[int], tokens_per_batch: int, rng: random.Random
                  ) -> list[list[int]]:
    """Indices of sequences (of `lengths` tokens) grouped by similar length into batches of
    about `tokens_per_batch` padded tokens, in shuffled order. Only indices: tensors are built
    per step (`collate`, `online.online_batch`), so an epoch never holds a second, padded copy
    of the features in memory."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur, longest = [], [], 0
    for i in order:
        T = lengths[i]
        if cur and max(longest, T) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, T)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(samples: list[Sample], group: list[int], in_vocab: torch.Tensor) -> Batch:
    """Pad the cached samples of one group to a `Batch`."""
    T = max(samples[i].ids.numel() for i in group)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, T - t.shape[0])) if t.dim() == 2 else F.pad(
            t, (0, T - t.shape[0]))
    valid = [samples[i].loss_mask & in_vocab[samples[i].argmax] for i in group]
    for v in valid:
        v[-1] = False  # the last token's target predicts past the end of the response
    return Batch(ids=torch.stack([pad(samples[i].ids) for i in group]),
                 aux=torch.stack([pad(samples[i].aux) for i in group]),
                 final=torch.stack([pad(samples[i].final) for i in group]),
                 valid=torch.stack([pad(v) for v in valid]),
                 argmax=torch.stack([pad(samples[i].argmax) for i in group]))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  block: int = 128) -> torch.Tensor:
    """q [B, H, T, d]; keys/values: per TTT step [B, KVH, T, d]. Step-0 keys are attended
    causally, later steps only at the query's own position (its own draft chain). Runs SDPA per
    block of `block` queries over [step-0 keys up to the block's end | the block's own keys of
    each later step], so no [T, T] score matrix is built (it took gigabytes of memory per step
    on long conversations)."""
    T = q.shape[2]
    out = []
    for a in range(0, T, block):
        b = min(a + block, T)
        k = torch.cat([keys[0][:, :, :b], *(x[:, :, a:b] for x in keys[1:])], dim=2)
        v = torch.cat([values[0][:, :, :b], *(x[:, :, a:b] for x in values[1:])], dim=2)
        causal = torch.ones(b - a, b, dtype=torch.bool, device=q.device).tril(a)  # [b-a, b]
        own = torch.eye(b - a, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal, *[own] * (len(keys) - 1)], dim=1)  # [b-a, k.shape[2]]
        out.append(F.scaled_dot_product_attention(q[:, :, a:b], k, v, attn_mask=mask,
                                                  enable_gqa=True))
    return torch.cat(out, dim=2)


def layer_step(layer: DraftLayer, model: Eagle3Draft, h: torch.Tensor, embeds: torch.Tensor,
               positions: torch.Tensor, kv: tuple[list, list]) -> torch.Tensor:
    """One draft layer at one TTT step; appends this step's keys/values to `kv`."""
    attn = layer.self_attn
    if layer.is_input_layer:
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], dim=-1)
    else:
        x = layer.input_layernorm(h)
    B, T, _ = x.shape
    nq, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    rope = model.rope.table(positions, x.dtype)
    q = rope.apply(q.view(B, T, nq, hd).transpose(1, 2))
    k = rope.apply(k.view(B, T, nkv, hd).transpose(1, 2))
    kv[0].append(k)
    kv[1].append(v.view(B, T, nkv, hd).transpose(1, 2))
    out = ttt_attention(q, kv[0], kv[1])
    h = h + attn.o_proj(out.transpose(1, 2).reshape(B, T, nq * hd))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_hidden(model: Eagle3Draft, batch: Batch, num_steps: int) -> Iterator[torch.Tensor]:
    """Yield the draft's pre-norm hidden [B, T, Hd] after each TTT step; step k at position t
    consumes token t+k+1 (teacher-forced) and predicts token t+k+2."""
    B, T = batch.ids.shape
    h = model.project(batch.aux if model.cfg.use_aux_hidden_state else batch.final)
    kv = [([], []) for _ in model.layers]
    base_pos = torch.arange(T, device=batch.ids.device)[None].expand(B, T)
    for k in range(num_steps):
        ids = F.pad(batch.ids[:, k + 1:], (0, k + 1))
        embeds = model.embed_tokens(ids).to(h.dtype)
        for layer, cache in zip(model.layers, kv):
            h = layer_step(layer, model, h, embeds, base_pos + k, cache)
        yield h


def ttt_loss(model: Eagle3Draft, batch: Batch, target_head: torch.Tensor, params: TrainParams
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """-> (weighted loss, per-step loss, per-step top-1 accuracy vs the target argmax)."""
    K = min(params.ttt_length, batch.ids.shape[1] - 2)
    hot = model.hot_ids
    total, losses, accs = 0.0, [], []
    for k, h in enumerate(ttt_hidden(model, batch, K)):
        shift = k + 1  # step k's output at position t is scored against the target at t+k+1
        valid = F.pad(batch.valid[:, shift:], (0, shift))  # [B, T]
        final = F.pad(batch.final[:, shift:], (0, 0, 0, shift))[valid]  # [n, Ht]
        logits = model.lm_head(model.norm(h[valid])).float()  # [n, Vd] only where scored
        with torch.no_grad():
            p = torch.softmax((final.to(target_head.dtype) @ target_head.T).float(), -1)
        n = max(int(valid.sum()), 1)
        # -(p * log_softmax(logits)).sum() with rows of p summing to 1, without building the
        # [n, Vd] log-probabilities (on the CPU each such tensor costs page faults)
        loss_k = (torch.logsumexp(logits, -1).sum() - torch.dot(p.flatten(), logits.flatten())) / n
        total = total + params.step_decay ** k * loss_k
        target_tok = F.pad(batch.argmax[:, shift:], (0, shift))[valid]
        losses.append(float(loss_k.detach()))
        accs.append(float((hot[logits.argmax(-1)] == target_tok).sum()) / n)
    return total, losses, accs


def lr_at(step: int, total: int, params: TrainParams) -> float:
    if step < params.warmup_steps:
        return params.lr * (step + 1) / params.warmup_steps
    progress = (step - params.warmup_steps) / max(1, total - params.warmup_steps)
    return params.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model: Eagle3Draft, opt: torch.optim.Optimizer, trainable: list[torch.Tensor],
               batch: Batch, target_head: torch.Tensor, params: TrainParams, lr: float
               ) -> tuple[torch.Tensor, list[float], list[float]]:
    """One optimizer step (bf16 autocast on the batch's device) -> `ttt_loss`'s results."""
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(batch.ids.device.type, dtype=torch.bfloat16):
        loss, losses, accs = ttt_loss(model, batch, target_head, params)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip)
    opt.step()
    return loss.detach(), losses, accs


def new_optimizer(model: Eagle3Draft, params: TrainParams
                  ) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """AdamW over every parameter but the (frozen, shared) embedding -> (optimizer, params)."""
    trainable = [p for n, p in model.named_parameters() if not n.startswith("embed_tokens")]
    return torch.optim.AdamW(trainable, lr=params.lr, betas=(0.9, 0.95), weight_decay=0.0), \
        trainable


@dataclass
class Head:
    """One head being trained: its model, optimizer and log rows."""
    name: str
    model: Eagle3Draft
    opt: torch.optim.Optimizer
    trainable: list[torch.Tensor]
    target_head: torch.Tensor  # [Vd, Ht] bf16 target lm_head rows of the draft vocabulary
    log: list[dict]


def new_head(name: str, model: Eagle3Draft, target_lm_head: torch.Tensor, params: TrainParams
             ) -> Head:
    opt, trainable = new_optimizer(model, params)
    return Head(name, model, opt, trainable,
                target_lm_head[model.hot_ids].to(torch.bfloat16), [])


def train(heads: list[Head], lengths: list[int], make_batch: Callable[[list[int]], Batch],
          run_dir: Path, params: TrainParams, deadline: float | None = None) -> bool:
    """Train every head in place on the same batches (fp32 master weights, bf16 autocast).
    `make_batch(indices)` builds a step's `Batch` from sequence indices (cached features or a
    target forward). Resumes from `run_dir/checkpoint.pt`; stops early, checkpointed, once
    `time.time()` passes `deadline`. Returns True when the schedule is complete."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    epochs = math.ceil(params.epochs)
    per_epoch = len(group_batches(lengths, params.tokens_per_batch, random.Random(0)))
    total_steps = int(per_epoch * params.epochs)
    ckpt = run_dir / "checkpoint.pt"
    logs = {h.name: run_dir / f"train_log_{h.name}.jsonl" for h in heads}
    step, budget_set = 0, params.max_minutes is None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        missing = sorted({h.name for h in heads} - set(state.get("heads", {})))
        if missing:
            raise ConfigError(f"{ckpt} holds no state for heads {missing} (another run or an "
                              "older format): remove it or use another --work-dir")
        step, total_steps, budget_set = state["step"], state["total_steps"], state["budget_set"]
        for h in heads:
            h.model.load_state_dict(state["heads"][h.name]["model"], strict=False)
            h.opt.load_state_dict(state["heads"][h.name]["opt"])
            # a run stopped before its first step has a checkpoint but no log yet
            text = logs[h.name].read_text() if logs[h.name].exists() else ""
            h.log = [r for r in (json.loads(x) for x in text.split("\n")
                                 if x.strip()) if r["step"] <= step]  # later rows are redone
            logs[h.name].write_text("".join(json.dumps(r) + "\n" for r in h.log))

    def save() -> None:
        torch.save({"step": step, "total_steps": total_steps, "budget_set": budget_set,
                    "heads": {h.name: {"model": h.model.state_dict(), "opt": h.opt.state_dict()}
                              for h in heads}}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").rename(ckpt)

    t0 = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc=f"train {run_dir.name}")
    for epoch in range(epochs):
        groups = group_batches(lengths, params.tokens_per_batch, rng)
        for i, group in enumerate(groups):
            if epoch * per_epoch + i < step:
                continue
            if step >= total_steps or (deadline is not None and time.time() > deadline):
                break
            batch = make_batch(group)
            lr = lr_at(step, total_steps, params)
            rows = []
            for h in heads:
                loss, losses, accs = train_step(h.model, h.opt, h.trainable, batch,
                                                h.target_head, params, lr)
                rows.append({"step": step + 1, "epoch": epoch, "loss": float(loss),
                             "step_loss": losses, "step_acc": accs, "lr": lr,
                             "tokens": int(batch.valid.sum()),
                             "wall_s": time.perf_counter() - t0})
            step += 1
            if step == 3:
                t3 = time.perf_counter()
            if not budget_set and step == 13:  # fit the schedule to the time budget
                per_step = (time.perf_counter() - t3) / 10  # steps 4..13: warmed up
                left = params.max_minutes * 60 - (time.perf_counter() - t0)
                total_steps = max(step + 1, min(total_steps, step + int(left / per_step)))
                bar.total, budget_set = total_steps, True
            for h, row in zip(heads, rows):
                h.log.append(row)
                with logs[h.name].open("a") as f:
                    f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{rows[0]['loss']:.3f}", acc0=f"{rows[0]['step_acc'][0]:.3f}")
            if step % 50 == 0 or step == total_steps:
                save()
    bar.close()
    save()
    return step >= total_steps
