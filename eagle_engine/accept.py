"""Accept phase: commit the accepted path, read the iteration's result back, refresh the draft.

`commit` makes the accepted tree rows of the target cache contiguous after the committed prefix
(rejected rows stay behind as garbage past the committed length; nothing else moves), on the
device. `readback_parts` / `parse_readback` are a request's share of the step's one host sync:
the emitted tokens, the accepted path and, when tracing, the verified tree. `extend_input`
pairs the accepted tokens with the target features before them, and `extend_forward` (the one
definition, over a batch of requests of one head, on either row placement of
`models/batched.py`) runs the draft over them, which rewrites the draft cache rows that
drafting used as scratch, and yields the next draft's input; `extend` is one request's, a
single C++ call for a head of q8 codes on a CPU. Not here: acceptance rules (`verify.py`).
"""
from __future__ import annotations

import torch

from .draft import top_children
from .io_struct import (EagleDraftExtendInput, EagleDraftInput, EagleVerifyInput,
                        EagleVerifyOutput, VerifyReadback)
from .kernels import TORCH, StepOps
from .kv_cache import KVCache
from .models.batched import OwnCaches, Placement
from .models.draft_model import Eagle3Draft


def commit(vin: EagleVerifyInput, vout: EagleVerifyOutput, cache: KVCache,
           ops: StepOps = TORCH) -> None:
    """Move the accepted path's rows to [seq_len, seq_len + W); slots past the path's end copy a
    row onto itself (it stays past the committed length), so the copy has a fixed size."""
    path = vout.accepted_nodes  # [W]
    slots = torch.arange(path.numel(), device=path.device)
    cache.commit_rows(vin.seq_len + torch.where(path >= 0, path, slots), vin.seq_len, ops)


def readback_parts(vin: EagleVerifyInput, vout: EagleVerifyOutput, trace: bool
                   ) -> list[torch.Tensor]:
    """A request's share of the step's one host read: [num_accepted, emitted (W),
    accepted_nodes (W), their sources (W)] and, with `trace`, the tree's tokens, parents, depth,
    sources and scores (N each), as float64 tensors (exact for token ids below 2^53 and for
    float32 scores); the scheduler packs every request's into one copy."""
    path_sources = vin.sources[vout.accepted_nodes.clamp_min(0)]  # [W] (past the end: junk)
    parts = [vout.num_accepted, vout.emitted, vout.accepted_nodes, path_sources]
    if trace:
        parts += [vin.tokens, vin.parents, vin.depth, vin.sources, vin.scores]
    return [p.double() for p in parts]


def parse_readback(flat: list[float], vin: EagleVerifyInput, vout: EagleVerifyOutput,
                   trace: bool) -> VerifyReadback:
    """`readback_parts` as read on the host (sizes from the tensors' shapes, no device read)."""
    n, W, N = int(flat[0]), vout.emitted.numel(), vin.tokens.numel()
    ints = [int(x) for x in flat[1:1 + 3 * W + (4 * N if trace else 0)]]
    tree = ints[3 * W:]
    return VerifyReadback(emitted=ints[:n + 1], accepted_nodes=ints[W:W + n + 1],
                          tree_tokens=tree[:N], tree_parents=tree[N:2 * N],
                          tree_depth=tree[2 * N:3 * N], tree_scores=flat[1 + 3 * W + 4 * N:],
                          accepted_sources=ints[2 * W:2 * W + n + 1],
                          tree_sources=tree[3 * N:])


def extend_input(vin: EagleVerifyInput, vout: EagleVerifyOutput, num_accepted: int,
                 features: torch.Tensor) -> EagleDraftExtendInput:
    """features [N, W_h] verify features -> the draft extend's input: the emitted tokens with
    the features of the accepted nodes (`num_accepted` from the host read)."""
    n = num_accepted + 1
    return EagleDraftExtendInput(tokens=vout.emitted[:n],
                                 hidden=features.index_select(0, vout.accepted_nodes[:n]),
                                 seq_len=vin.seq_len)


@torch.inference_mode()
def extend(model: Eagle3Draft, ext: EagleDraftExtendInput, cache: KVCache,
           topk: int) -> EagleDraftInput:
    """One request's extend: `extend_forward` of it alone, or, for a q8 head on a CPU, one C++
    call (`FusedDecoder.extend`, the same bits: tests/test_cpu_lowbit.py)."""
    fused = model.fused
    if fused is not None and fused.extends:
        return draft_input(ext, *fused.extend(model, ext.tokens, ext.hidden, ext.seq_len,
                                              cache.data, topk))
    T, dev = ext.tokens.numel(), ext.tokens.device
    rows = OwnCaches([cache], [ext.seq_len])
    out = extend_forward(model, rows, ext.tokens[None], ext.hidden[None],
                         torch.arange(T, device=dev)[None], None, topk)
    return draft_input(ext, *(t[0] for t in out))


@torch.inference_mode()
def extend_forward(model: Eagle3Draft, rows: Placement, tokens: torch.Tensor,
                   hidden: torch.Tensor, offsets: torch.Tensor, lens: list[int] | None,
                   topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft extend of a batch of requests of one head: request b's tokens [B, T] with
    the target features before them [B, T, W], token t at draft cache row (and position)
    seq_len + offsets[b, t], causal by row; its real rows last (`lens` [B]; pads first, at
    rows past the real ones, which no real row sees) -> the top-k after each request's last
    row (probabilities [B, K], target ids [B, K]; `draft.top_children`, as every draft level)
    and that row's recycled hidden [B, Hd]."""
    T = tokens.shape[1]
    causal = torch.arange(T, device=tokens.device) <= offsets[:, :, None]  # [B, T, T]
    logits, h = rows.draft(model, tokens, hidden, offsets, offsets, 0,
                           causal, lens, from_target=True, last_only=True)
    return *top_children(logits[:, -1], topk, model.target_ids), h[:, -1]


def draft_input(ext: EagleDraftExtendInput, topk_p: torch.Tensor, topk_ids: torch.Tensor,
                hidden: torch.Tensor) -> EagleDraftInput:
    """The next draft's input after extending over `ext`: its level 1 (probabilities [K], target
    ids [K]) and recycled hidden [Hd]; the root is ext's last token, now committed after it."""
    return EagleDraftInput(topk_p=topk_p, topk_ids=topk_ids, hidden=hidden,
                           root=ext.tokens[-1:], seq_len=ext.seq_len + ext.tokens.numel())
