"""Verify phase: one target forward over the whole tree (ancestor mask, depth positions), then
lossless acceptance: greedy (longest path agreeing with the target argmax, plus the bonus token)
or tree speculative sampling (siblings tried in draft order against one coin per level, residual
distribution on rejection), which reproduces the target's sampling distribution exactly.
`verify_forward` is the one definition of the forward over a batch, run over either row
placement (`models/batched.py`); plain decoding's step is the same forward over a tree of one
node (`decode`).

Acceptance runs on the device without reading anything on the host: every node gets "accepted
if its parent is" (greedy: its token is the target's argmax after the parent; sampling: its
level's coin falls in its slice of the parent's distribution), the accepted path is the deepest
node whose ancestors all pass, and its result is padded to the tree's depth
(`EagleVerifyOutput`); the scheduler reads it back with the step's one host read
(`accept.readback_parts`).
Not here: cache compaction, the host copy or the draft extend (`accept.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .io_struct import EagleVerifyInput, EagleVerifyOutput
from .kernels import TORCH, StepOps
from .kv_cache import KVCache
from .models.batched import OwnCaches, Placement
from .models.target import TargetModel
from .sampling import greedy, sample_from, target_probs


@dataclass(slots=True)
class TreeLogits:
    logits: torch.Tensor  # [N, vocab] float32: row i = target distribution after node i
    features: torch.Tensor | None  # [N, EagleDraftExtendInput.hidden_size_for] draft-extend
    # inputs (None for a plain request)


def verify_forward(target: TargetModel, rows: Placement, tokens: torch.Tensor,
                   depth: torch.Tensor, ancestors: torch.Tensor,
                   features: list[tuple[int, ...] | None], lens: list[int] | None = None
                   ) -> list[TreeLogits]:
    """The verify forward of a batch: request b's tree, tokens [B, N] (root first; a plain
    request's next token is a tree of one node), node i at cache row seq_len + i and position
    seq_len + depth [B, N], seeing its committed rows and its ancestors-or-self [B, N, N].
    `lens` [B]: each tree's real nodes, first (over own caches only the real nodes run).
    `features[b]`: the target layers whose inputs request b's head reads (its aux ids, or ()
    for the final hidden), None for a plain request (logits only). One forward captures the
    union of the layers; each request takes its own columns. -> per request its nodes' logits
    [n, V] and features [n, W]."""
    N, H = tokens.shape[1], target.cfg.hidden_size
    union = sorted(set().union(*(f for f in features if f)))
    outs = rows.target(target, tokens, depth,
                       torch.arange(N, device=tokens.device), 0, ancestors, lens, tuple(union))
    result = []
    for (logits, aux, final), wanted in zip(outs, features):
        feats = None
        if wanted is not None:
            feats = aux if wanted else final
            if wanted and sorted(set(wanted)) != union:
                cols = torch.cat([torch.arange(union.index(a) * H, (union.index(a) + 1) * H,
                                               device=aux.device) for a in sorted(set(wanted))])
                feats = aux.index_select(-1, cols)
        result.append(TreeLogits(logits, feats))
    return result


def run_target(target: TargetModel, vin: EagleVerifyInput, cache: KVCache,
               aux_layer_ids: tuple[int, ...]) -> TreeLogits:
    """One request's verify forward on its own cache (`verify_forward` of it alone)."""
    rows = OwnCaches([cache], [vin.seq_len])
    return verify_forward(target, rows, vin.tokens[None], vin.depth[None], vin.ancestors[None],
                          [aux_layer_ids])[0]


def decode(target: TargetModel, token: torch.Tensor, seq_len: int, cache: KVCache
           ) -> torch.Tensor:
    """A plain request's step alone: `token` [1] (on the device) at position `seq_len`, a tree
    of one node -> next-token logits [1, V]."""
    rows = OwnCaches([cache], [seq_len])
    one = torch.ones(1, 1, 1, dtype=torch.bool, device=token.device)
    return verify_forward(target, rows, token.view(1, 1), torch.zeros_like(token).view(1, 1), one,
                          [None])[0].logits


def accepted_path(vin: EagleVerifyInput, best: torch.Tensor, bonus: torch.Tensor
                  ) -> EagleVerifyOutput:
    """The path from the root to node `best` [1] and the tokens it emits, `bonus` [1] last."""
    path = vin.retrieve_indices.index_select(0, best)[0]  # [W] root first, -1 past its end
    num_accepted = vin.depth.index_select(0, best)  # [1]
    slots = torch.arange(path.numel(), device=path.device)  # [W]
    drafts = vin.tokens[path.roll(-1).clamp_min(0)]  # [W] slot k: the token of node path[k+1]
    emitted = torch.where(slots < num_accepted, drafts,
                          torch.where(slots == num_accepted, bonus, -1))  # [W]
    return EagleVerifyOutput(accepted_nodes=path, num_accepted=num_accepted, emitted=emitted)


def greedy_acceptance(vin: EagleVerifyInput, logits: torch.Tensor, ops: StepOps = TORCH
                      ) -> EagleVerifyOutput:
    """The longest path whose every token is the target's argmax after its parent (with the C++
    backend one call, `cpu_step.cpp`: the same result, tests/test_cpu_step.py)."""
    cpu = ops.cpp
    if cpu is not None and logits.dtype == torch.float32:
        path, num_accepted, emitted = cpu.greedy_accept(
            logits.contiguous(), vin.tokens, vin.parents, vin.depth, vin.retrieve_indices)
        return EagleVerifyOutput(accepted_nodes=path, num_accepted=num_accepted, emitted=emitted)
    predict = greedy(logits, ops)  # [N]
    best, _ = ops.verify_tree_greedy(vin.tokens, vin.parents, vin.ancestors, vin.depth, predict)
    best = best.reshape(1)
    return accepted_path(vin, best, predict.index_select(0, best))


def sampled_acceptance(vin: EagleVerifyInput, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None, ops: StepOps = TORCH
                       ) -> EagleVerifyOutput:
    """`sampled_acceptance_torch`, as one C++ call with the C++ backend (`cpu_step.cpp`: the
    same coins and result, the distribution of the accepted path's rows only)."""
    cpu = ops.cpp
    if cpu is not None and logits.dtype == torch.float32:
        W = vin.retrieve_indices.shape[1]
        coins = torch.rand(max(W - 1, 1), generator=generator)  # one per level, then the bonus's
        bonus_coin = torch.rand(1, generator=generator)
        path, num_accepted, emitted = cpu.sampled_accept(
            logits.contiguous(), vin.tokens, vin.parents, vin.depth, vin.retrieve_indices, coins,
            bonus_coin, params.temperature, params.top_k, params.top_p)
        return EagleVerifyOutput(accepted_nodes=path, num_accepted=num_accepted, emitted=emitted)
    return sampled_acceptance_torch(vin, logits, params, generator, ops)


def sampled_acceptance_torch(vin: EagleVerifyInput, logits: torch.Tensor, params: SamplingParams,
                             generator: torch.Generator | None, ops: StepOps = TORCH
                             ) -> EagleVerifyOutput:
    """Tree speculative sampling with deterministic top-k drafts (q = point mass): at each level,
    child k is accepted iff sum_{j<k} p(x_j) <= u < sum_{j<=k} p(x_j) for one uniform u; if all
    children fail, the bonus is drawn from p with those children removed (renormalized). This is
    inverse-CDF sampling of p with the children listed first, so every emitted token ~ p.
    Coins: one per tree level (drawn together), then the bonus token's."""
    probs = target_probs(logits, params, ops)  # [N, V]
    N, W = vin.retrieve_indices.shape
    dev = logits.device
    nodes = torch.arange(N, device=dev)
    p_node = probs[vin.parents.clamp_min(0), vin.tokens].double()  # [N] p(token | parent)
    siblings = vin.parents[:, None] == vin.parents[None, :]  # [N, N]
    before = nodes[None, :] < nodes[:, None]  # [N, N] j listed before i
    upto = (siblings & ~before.T).double() @ p_node  # [N] sum_{j<=k} over the siblings
    previous = torch.where(siblings & before, nodes, -1).amax(-1)  # [N] -1: a first child
    below = torch.where(previous >= 0, upto[previous.clamp_min(0)], 0.0)  # [N] sum_{j<k}
    # [max(W-1, 1)] one per level (a tree of the root alone, W = 1, indexes one too)
    coins = torch.rand(max(W - 1, 1), generator=generator, device=dev).double()
    u = coins[(vin.depth - 1).clamp_min(0)]  # [N] the coin of each node's level
    passed = ((below <= u) & (u < upto)) | (vin.parents < 0)  # [N] the root always passes
    on_path = ~(vin.ancestors & ~passed).any(-1)  # [N] it and all its ancestors pass
    best = torch.where(on_path, vin.depth, -1).argmax().reshape(1)  # [1] the deepest
    p = probs.index_select(0, best)[0]  # [V] the target's distribution after `best`
    children = vin.parents == best  # [N] the rejected children of `best`
    # zero the children's tokens (siblings hold distinct tokens; other nodes add -0)
    residual = p.index_put((vin.tokens,), -p[vin.tokens] * children, accumulate=True)  # [V]
    # children that held all the mass (u rounded past it) leave p itself; sample_from
    # normalizes by the total
    bonus = sample_from(torch.where(residual.sum() > 0, residual, p), generator, ops).reshape(1)
    return accepted_path(vin, best, bonus)

