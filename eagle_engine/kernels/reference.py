"""Pure-torch references for the tree bookkeeping and sampling kernels, and for attention over
a KV pool's rows. A CPU runs these until the q4 weights have loaded the C++ kernels
(`cpu_step.cpp`); the Triton and C++ bookkeeping kernels in this package must match them
exactly, the C++ sampler and the Triton pool attention up to float rounding
(tests/test_kernels.py, tests/test_cpu_step.py)."""
from __future__ import annotations

import torch

from .attention import attend, score_bias


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> ids [...] of each row's first maximum (NaN first where a row holds
    one); `max(-1)` is ~2.5-3x faster than `argmax` on CPU for the target's 49152-token rows
    (`benchmarks/step_ops.py`)."""
    return logits.max(-1).indices


def build_tree_from_parents(parents: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [N] (-1 for the root, parent index < child index) ->
    depth [N] int64, ancestors [N, N] bool (ancestor-or-self), retrieve [N, min(N, max_depth+1)]
    int64 (root->node path of node indices, -1 padded)."""
    N = parents.numel()
    dev = parents.device
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    has_parent = (parents >= 0)[:, None]
    ancestors = eye
    for _ in range(max_depth):
        ancestors = eye | (ancestors[parents.clamp_min(0)] & has_parent)
    depth = ancestors.sum(1) - 1
    cols = torch.arange(N, device=dev).expand(N, N)
    path = torch.where(ancestors, cols, N).sort(dim=1).values[:, :max_depth + 1]
    retrieve = torch.where(path == N, -1, path)
    return depth, ancestors, retrieve


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                       depth: torch.Tensor, target_predict: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root path whose every token equals the target's argmax after its parent.
    tokens/parents/depth/target_predict [N] -> (best node, accept length = its depth)."""
    correct = tokens == target_predict[parents.clamp_min(0)]
    correct[0] = True
    ok = ~(ancestors & ~correct[None, :]).any(-1)  # [N] every node on the path is correct
    best = torch.where(ok, depth, -1).argmax()
    return best, depth.index_select(0, best.reshape(1)).reshape(())  # no host read of `best`


def compact_kv(cache: torch.Tensor, src_rows: torch.Tensor, dst_start: int) -> None:
    """cache [B, H, max_len, d]: rows `src_rows` [n] (>= dst_start) -> [dst_start, dst_start+n)."""
    n = src_rows.numel()
    cache[:, :, dst_start:dst_start + n] = cache[:, :, src_rows]


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                   ) -> torch.Tensor:
    """logits [M, V] float32 -> probabilities [M, V]: temperature, then top-k (values below the
    k-th largest dropped), softmax, then top-p (`top_p_filter`) renormalized."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def top_p_filter(probs: torch.Tensor, top_p: float, first: int = 256) -> torch.Tensor:
    """Zero every token whose descending-order predecessors already hold `top_p` of the mass.
    Sorts only the `first` most likely tokens (x16 until they hold `top_p` in every row, at worst
    the whole vocabulary): the same result as a full sort, ~20x faster on peaked distributions.
    On CPU only: on a GPU the full sort costs less than the host sync that checks a partial one."""
    V = probs.shape[-1]
    m = min(first, V) if probs.device.type == "cpu" else V
    while True:
        top, order = probs.topk(m, dim=-1)  # [..., m] descending
        if m == V or bool((top.sum(-1) >= top_p).all()):
            break
        m = min(m * 16, V)
    before = top.cumsum(-1) - top  # mass strictly before each token
    return torch.zeros_like(probs).scatter_(-1, order, top.masked_fill(before >= top_p, 0.0))


def sample_rows(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """probs [M, V] (unnormalized allowed), coins [M] in [0, 1) -> ids [M] by inverse CDF."""
    cdf = probs.cumsum(-1)
    ids = torch.searchsorted(cdf, coins[:, None] * cdf[:, -1:], right=True)
    ids = ids.clamp_max(probs.shape[-1] - 1)
    # a coin landing on a zero-probability tail must not pick it: step back to a live token
    # (always computed: testing whether any row needs it would read the device on the host)
    dead = probs.gather(-1, ids) == 0
    return torch.where(dead, argmax_rows(probs)[:, None], ids)[:, 0]


def block_mask(cols: torch.Tensor, seq_len: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Each request's committed rows (< seq_len [B]) and `block` [B, T, W] (which of the W rows
    from seq_len each token sees), over the cache columns `cols` [L] -> the mask [B, T, L]."""
    W = block.shape[-1]
    rel = cols - seq_len[:, None]  # [B, L] row relative to the committed length
    inside = ((rel >= 0) & (rel < W))[:, None, :]  # [B, 1, L]
    placed = block.gather(2, rel.clamp(0, W - 1)[:, None, :].expand(-1, block.shape[1], -1))
    return (rel < 0)[:, None, :] | (placed & inside)  # [B, T, L]


def pool_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   seq_len: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, d] of request b over pool row slots[b] of k, v [rows, KVH, L, d]: its
    committed rows and the rows of `block` [B, T, W] from seq_len (`block_mask`), the whole
    rows gathered (a copy of B rows), through the eager phases' `attention.attend`, so both
    round alike -> [B, H, T, d]."""
    keys = k.index_select(0, slots).to(q.dtype)  # [B, KVH, L, d]
    values = v.index_select(0, slots).to(q.dtype)
    mask = block_mask(torch.arange(k.shape[2], device=q.device), seq_len, block)  # [B, T, L]
    return attend(q, keys, values, score_bias(mask, q.shape[1], k.shape[1], q.dtype))
