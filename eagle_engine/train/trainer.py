"""Stage 4: training-time-test (TTT) training of EAGLE-3 heads on target features.

Step 0 at position t sees (target feature at t, token t+1) and learns the target's distribution
for token t+2; steps k = 1..ttt_length-1 feed the draft's own output back as the hidden (pre-norm,
or norm(h) for a head with `norm_output`, as the engine recycles it), with RoPE position t+k,
attending to the step-0 keys at positions <= t plus the "diagonal" keys of its own earlier steps
at t — exactly what a decode step sees at inference. Loss per step is the soft cross-entropy
against the target restricted to the draft vocabulary (renormalized), weighted 0.8^k; positions
whose target argmax is outside the draft vocabulary are masked. A per-head `Recipe` varies that:
a total-variation term, feature noise, scoring the masked positions too. Checkpoints and a JSONL
log per head are written to the run directory; an interrupted run resumes from the last
checkpoint. Several heads (aux on/off, layer counts, recipes) can train on the same batches;
with `TrainParams.holdout` each keeps its best state by held-out accuracy (early stopping). Not
here: where features come from (`features.py` caches them, `online.py` computes them per batch)
or the `eval-head` command (`evaluate.py`).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from ..config import ConfigError, parse_dtype, resolve_dtype
from ..models.draft_model import DraftLayer, Eagle3Draft
from .allocator import purge_freed_pages
from .features import Sample


# steps between returns of jemalloc's kept pages (`allocator.py`): without them a CPU run's
# resident memory grows ~0.3 GB a step
PURGE_EVERY = 10
# the attention kernels `ttt_attention` may use: every one but cuDNN's (its docstring says why)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    holdout: int = 0  # sequences kept out of the batches (their batches stay in memory)
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end)


@dataclass(frozen=True)
class Recipe:
    """One head's training options (the defaults are the plain recipe), so that recipe A/Bs
    train as several heads on the same batches. With p the target distribution over the draft
    vocabulary and q = softmax(draft logits) at a scored position:

        loss_k = mean(-sum_v p_v log q_v) + tv_weight * mean(1 - sum_v min(p_v, q_v))

    (1 - sum min(p, q) = TV(p, q) = 0.5 * sum |p - q| is one minus the expected acceptance of
    sampled drafting: KL plus a total-variation term, the "LK loss" of arXiv 2602.23881).
    `feature_noise` adds N(0, (feature_noise * rms)^2) to the head's input features in training
    only, rms taken over each token's aux chunk (each target layer has its own scale; the whole
    final hidden for an aux-off head). `mask_outside_vocab=False` also scores the response
    tokens whose target argmax lies outside the draft vocabulary (toward the renormalized p).
    Architecture flags (aux input, fc_norm, norm_output) belong to the head's `DraftConfig`,
    since the engine must follow them too."""
    tv_weight: float = 0.0
    feature_noise: float = 0.0
    mask_outside_vocab: bool = True


@dataclass(slots=True)
class Batch:
    """One step's padded features, shared by every head trained on it (they share the draft
    vocabulary); `ttt_loss` picks `aux` or `final` as the input by the head's config."""
    ids: torch.Tensor  # [B, T] int64 (0-padded)
    aux: torch.Tensor  # [B, T, num_aux * Ht] target aux hidden states
    final: torch.Tensor  # [B, T, Ht] normed target hidden (the aux-off input, and target logits)
    response: torch.Tensor  # [B, T] bool: response token whose next token is in the sequence
    in_vocab_target: torch.Tensor  # [B, T] bool: target argmax inside the draft vocabulary
    argmax: torch.Tensor  # [B, T] int64 target argmax

    @property
    def valid(self) -> torch.Tensor:
        """[B, T] bool: the positions scored by default and counted by the accuracy."""
        return self.response & self.in_vocab_target


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
    response = [samples[i].loss_mask.clone() for i in group]
    for r in response:
        r[-1] = False  # the last token's target predicts past the end of the response
    return Batch(ids=torch.stack([pad(samples[i].ids) for i in group]),
                 aux=torch.stack([pad(samples[i].aux) for i in group]),
                 final=torch.stack([pad(samples[i].final) for i in group]),
                 response=torch.stack([pad(r) for r in response]),
                 in_vocab_target=torch.stack([pad(in_vocab[samples[i].argmax]) for i in group]),
                 argmax=torch.stack([pad(samples[i].argmax) for i in group]))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  block: int = 128) -> torch.Tensor:
    """q [B, H, T, d]; keys/values: per TTT step [B, KVH, T, d]. Step-0 keys are attended
    causally, later steps only at the query's own position (its own draft chain). Runs SDPA per
    block of `block` queries over [step-0 keys up to the block's end | the block's own keys of
    each later step], so no [T, T] score matrix is built (one takes gigabytes of memory per
    step on long conversations). Never cuDNN's attention: it builds a plan for every new shape,
    and the blocks' shapes change with each block and batch, so planning would cost a training
    step many times its GPU time in host time."""
    T = q.shape[2]
    out = []
    with sdpa_kernel(SDPA_BACKENDS):
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


def input_features(model: Eagle3Draft, batch: Batch) -> torch.Tensor:
    """The batch's features the head reads: [B, T, num_aux * Ht] aux states, or [B, T, Ht]."""
    return batch.aux if model.cfg.use_aux_hidden_state else batch.final


def add_feature_noise(model: Eagle3Draft, features: torch.Tensor, scale: float,
                      generator: torch.Generator) -> torch.Tensor:
    """features [B, T, A * W] (A aux chunks, or A = 1 for an aux-off head) plus Gaussian noise of
    standard deviation `scale` times the RMS of each token's chunk."""
    chunks = model.cfg.num_aux if model.cfg.use_aux_hidden_state else 1
    x = features.unflatten(-1, (chunks, -1))  # [B, T, A, W]
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, A, 1]
    eps = torch.randn(x.shape, generator=generator, device=x.device)  # [B, T, A, W] float32
    return (x + (scale * rms * eps).to(x.dtype)).flatten(-2)


def ttt_hidden(model: Eagle3Draft, batch: Batch, num_steps: int,
               features: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Yield the draft's pre-norm hidden [B, T, Hd] after each TTT step; step k at position t
    consumes token t+k+1 (teacher-forced) and predicts token t+k+2. The next step reads this
    hidden back, or norm(h) with `model.cfg.norm_output` (as `Eagle3Draft.forward` recycles
    it). `features`: the input in place of `input_features(model, batch)` (noised ones)."""
    B, T = batch.ids.shape
    features = input_features(model, batch) if features is None else features  # cached in bf16
    x = model.project(features.to(model.lm_head.weight.dtype))
    kv = [([], []) for _ in model.layers]
    base_pos = torch.arange(T, device=batch.ids.device)[None].expand(B, T)
    for k in range(num_steps):
        ids = F.pad(batch.ids[:, k + 1:], (0, k + 1))
        embeds = model.embed_tokens(ids).to(x.dtype)
        h = x
        for layer, cache in zip(model.layers, kv):
            h = layer_step(layer, model, h, embeds, base_pos + k, cache)
        yield h
        x = model.norm(h) if model.cfg.norm_output else h  # [B, T, Hd] the next step's input


def ttt_loss(model: Eagle3Draft, batch: Batch, target_head: torch.Tensor, params: TrainParams,
             recipe: Recipe = Recipe(), noise: torch.Generator | None = None
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """-> (weighted loss, per-step loss, per-step top-1 accuracy vs the target argmax over the
    `batch.valid` positions, whatever `recipe.mask_outside_vocab` scores). `noise` draws the
    recipe's feature noise: training passes one (`train_step`); None (evaluation) adds none."""
    K = min(params.ttt_length, batch.ids.shape[1] - 2)
    hot = model.hot_ids
    features = None
    if noise is not None and recipe.feature_noise:
        features = add_feature_noise(model, input_features(model, batch), recipe.feature_noise,
                                     noise)
    total, losses, accs = 0.0, [], []
    for k, h in enumerate(ttt_hidden(model, batch, K, features)):
        shift = k + 1  # step k's output at position t is scored against the target at t+k+1
        valid = F.pad(batch.valid[:, shift:], (0, shift))  # [B, T]
        scored = valid if recipe.mask_outside_vocab else F.pad(batch.response[:, shift:],
                                                               (0, shift))  # [B, T]
        final = F.pad(batch.final[:, shift:], (0, 0, 0, shift))[scored]  # [n, Ht]
        logits = model.lm_head(model.norm(h[scored])).float()  # [n, Vd] only where scored
        with torch.no_grad():
            p = torch.softmax((final.to(target_head.dtype) @ target_head.T).float(), -1)
        n = max(int(scored.sum()), 1)
        # -(p * log_softmax(logits)).sum() with rows of p summing to 1, without building the
        # [n, Vd] log-probabilities (on the CPU each such tensor costs page faults)
        loss_k = (torch.logsumexp(logits, -1).sum() - torch.dot(p.flatten(), logits.flatten())) / n
        if recipe.tv_weight:
            q = torch.softmax(logits, -1)  # [n, Vd]
            loss_k = loss_k + recipe.tv_weight * (1 - torch.minimum(p, q).sum(-1)).sum() / n
        total = total + params.step_decay ** k * loss_k
        target_tok = F.pad(batch.argmax[:, shift:], (0, shift))[scored]  # [n]
        hit = (hot[logits.argmax(-1)] == target_tok)[valid[scored]]  # [n_valid]
        losses.append(float(loss_k.detach()))
        accs.append(float(hit.sum()) / max(int(valid.sum()), 1))
    return total, losses, accs


@torch.no_grad()
def step_accuracy(model: Eagle3Draft, batches: Iterable[Batch], target_head: torch.Tensor,
                  params: TrainParams) -> list[float]:
    """Top-1 accuracy per TTT step over the `valid` positions of `batches` as `ttt_loss` counts
    it (no feature noise; `autocast` as in training), each batch weighed by its positions."""
    hits, counts = [0.0] * params.ttt_length, [0] * params.ttt_length
    for batch in batches:
        with autocast(batch.ids.device):
            _, _, accs = ttt_loss(model, batch, target_head, params)
        for k, a in enumerate(accs):  # step k scores the valid positions from k+1 on
            w = int(batch.valid[:, k + 1:].sum())
            hits[k] += a * w
            counts[k] += w
    return [h / max(c, 1) for h, c in zip(hits, counts)]


def train_dtype(device: torch.device) -> torch.dtype:
    """The engine's 'auto' dtype (`config.resolve_dtype`): bf16 where its products are native
    (CUDA; CPUs with AVX512-BF16 or AMX), else float32: on an AVX2-only CPU a bf16-autocast
    step of 2048 tokens takes over 10 minutes, a float32 one ~27 s."""
    return parse_dtype(resolve_dtype("auto", str(device)))


def autocast(device: torch.device) -> torch.autocast:
    """The training and evaluation autocast: to `train_dtype`, off where that is float32."""
    dtype = train_dtype(device)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def lr_at(step: int, total: int, params: TrainParams) -> float:
    if step < params.warmup_steps:
        return params.lr * (step + 1) / params.warmup_steps
    progress = (step - params.warmup_steps) / max(1, total - params.warmup_steps)
    return params.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model: Eagle3Draft, opt: torch.optim.Optimizer, trainable: list[torch.Tensor],
               batch: Batch, target_head: torch.Tensor, params: TrainParams, lr: float,
               recipe: Recipe = Recipe(), noise: torch.Generator | None = None
               ) -> tuple[torch.Tensor, list[float], list[float]]:
    """One optimizer step (`autocast` on the batch's device) -> `ttt_loss`'s results."""
    for g in opt.param_groups:
        g["lr"] = lr
    with autocast(batch.ids.device):
        loss, losses, accs = ttt_loss(model, batch, target_head, params, recipe, noise)
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
    """One head being trained: its model, optimizer, recipe, log rows and, with held-out
    evaluation, its best state so far."""
    name: str
    model: Eagle3Draft
    opt: torch.optim.Optimizer
    trainable: list[torch.Tensor]
    target_head: torch.Tensor  # [Vd, Ht] target lm_head rows of the draft vocabulary, train_dtype
    log: list[dict]
    recipe: Recipe = Recipe()
    best_step: int = 0  # step of the best held-out score (0: not evaluated yet)
    best_score: float = -1.0
    best_state: dict[str, torch.Tensor] | None = None  # `head_state` at best_step


def new_head(name: str, model: Eagle3Draft, target_lm_head: torch.Tensor, params: TrainParams,
             recipe: Recipe = Recipe()) -> Head:
    opt, trainable = new_optimizer(model, params)
    return Head(name, model, opt, trainable,
                target_lm_head[model.hot_ids].to(train_dtype(target_lm_head.device)), [], recipe)


def head_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """A copy of the head's own tensors (all but the shared, frozen embedding)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not k.startswith("embed_tokens")}


def evaluate_heldout(head: Head, batches: list[Batch], params: TrainParams, step: int) -> dict:
    """Score `head` on the held-out batches, keep its state when the score is its best so far
    -> the log entries {heldout_acc: per-step accuracy, heldout_score: their step_decay^k-
    weighted mean}."""
    accs = step_accuracy(head.model, batches, head.target_head, params)
    weights = [params.step_decay ** k for k in range(len(accs))]
    score = sum(w * a for w, a in zip(weights, accs)) / sum(weights)
    if score > head.best_score:
        head.best_step, head.best_score, head.best_state = step, score, head_state(head.model)
    return {"heldout_acc": accs, "heldout_score": score}


def train(heads: list[Head], lengths: list[int], make_batch: Callable[[list[int]], Batch],
          run_dir: Path, params: TrainParams, deadline: float | None = None) -> bool:
    """Train every head in place on the same batches (fp32 master weights, `autocast`).
    `make_batch(indices)` builds a step's `Batch` from sequence indices (cached features or a
    target forward). Resumes from `run_dir/checkpoint.pt`; stops early, checkpointed, once
    `time.time()` passes `deadline`. Returns True when the schedule is complete.

    With `params.holdout` = N > 0, N sequences drawn by the seed never enter a training batch;
    every `params.eval_every` steps and at the end of the schedule each head's `step_accuracy`
    on them is logged in that step's row (`evaluate_heldout`) and its best-scoring state kept,
    in the checkpoint too; on return each evaluated head's model holds its best state."""
    if not 0 <= params.holdout < len(lengths):
        raise ConfigError(f"--holdout {params.holdout} must be >= 0 and leave some of the "
                          f"{len(lengths)} conversations to train on")
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    held = set(random.Random(params.seed).sample(range(len(lengths)), params.holdout))
    kept = [i for i in range(len(lengths)) if i not in held]  # training sequences
    held_idx = sorted(held)
    held_batches = [make_batch([held_idx[j] for j in g]) for g in group_batches(
        [lengths[i] for i in held_idx], params.tokens_per_batch, random.Random(0))]
    kept_lengths = [lengths[i] for i in kept]
    epochs = math.ceil(params.epochs)
    per_epoch = len(group_batches(kept_lengths, params.tokens_per_batch, random.Random(0)))
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
        if state.get("holdout", 0) != params.holdout:
            raise ConfigError(f"{ckpt} was trained with --holdout {state.get('holdout', 0)}, "
                              f"not {params.holdout}: use the same or another --work-dir")
        step, total_steps, budget_set = state["step"], state["total_steps"], state["budget_set"]
        for h in heads:
            saved = state["heads"][h.name]
            h.model.load_state_dict(saved["model"], strict=False)
            h.opt.load_state_dict(saved["opt"])
            if "best_state" in saved:
                h.best_step, h.best_score = saved["best_step"], saved["best_score"]
                h.best_state = saved["best_state"]
            # a run stopped before its first step has a checkpoint but no log yet
            text = logs[h.name].read_text() if logs[h.name].exists() else ""
            h.log = [r for r in (json.loads(x) for x in text.split("\n")
                                 if x.strip()) if r["step"] <= step]  # later rows are redone
            logs[h.name].write_text("".join(json.dumps(r) + "\n" for r in h.log))

    def head_checkpoint(h: Head) -> dict:
        best = {} if h.best_state is None else {
            "best_step": h.best_step, "best_score": h.best_score, "best_state": h.best_state}
        return {"model": head_state(h.model), "opt": h.opt.state_dict(), **best}

    def save() -> None:
        torch.save({"step": step, "total_steps": total_steps, "budget_set": budget_set,
                    "holdout": params.holdout,
                    "heads": {h.name: head_checkpoint(h) for h in heads}},
                   ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").rename(ckpt)

    t0 = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc=f"train {run_dir.name}")
    for epoch in range(epochs):
        groups = group_batches(kept_lengths, params.tokens_per_batch, rng)
        for i, group in enumerate(groups):
            if epoch * per_epoch + i < step:
                continue
            if step >= total_steps or (deadline is not None and time.time() > deadline):
                break
            batch = make_batch([kept[j] for j in group])
            lr = lr_at(step, total_steps, params)
            rows = []
            for h in heads:
                # the same draws for every head (a common-noise A/B), redrawn alike on resume
                noise = torch.Generator(batch.ids.device).manual_seed(
                    1_000_003 * params.seed + step)
                loss, losses, accs = train_step(h.model, h.opt, h.trainable, batch,
                                                h.target_head, params, lr, h.recipe, noise)
                rows.append({"step": step + 1, "epoch": epoch, "loss": float(loss),
                             "step_loss": losses, "step_acc": accs, "lr": lr,
                             "tokens": int(batch.valid.sum()),
                             "wall_s": time.perf_counter() - t0})
            step += 1
            if step % PURGE_EVERY == 0:  # a no-op unless jemalloc is preloaded
                purge_freed_pages()
            if step == 3:
                t3 = time.perf_counter()
            if not budget_set and step == 13:  # fit the schedule to the time budget
                per_step = (time.perf_counter() - t3) / 10  # steps 4..13: warmed up
                left = params.max_minutes * 60 - (time.perf_counter() - t0)
                total_steps = max(step + 1, min(total_steps, step + int(left / per_step)))
                bar.total, budget_set = total_steps, True
            if held_batches and (step == total_steps or (
                    params.eval_every and step % params.eval_every == 0)):
                for h, row in zip(heads, rows):
                    row.update(evaluate_heldout(h, held_batches, params, step))
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
    for h in heads:
        if h.best_state is not None:
            h.model.load_state_dict(h.best_state, strict=False)
    return step >= total_steps
