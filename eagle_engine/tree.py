"""Tree phase: merge the context's chain into the drafted candidates (when there is one), rerank
all candidates to the best `num_draft_tokens - 1` (those scoring at least `min_score`), add up to
`context_extra` more of the chain's nodes that score at least `CHAIN_SURE`, put the root in
front and build what verification needs (parents, depth, ancestor mask, retrieve indices, each
node's source).
Selection is a stable descending sort, so a parent (never scored below its child, and earlier in
the candidate order) is always selected before its children. `tree_input` runs the whole phase;
with the C++ step backend it is one C++ call (`kernels/cpu_step.cpp`, the same tree as
`merge_context` then `build_tree`, the definition: tests/test_cpu_step.py). Not here: drafting,
finding the context's chain (`context_draft.py`) or verifying.
"""
from __future__ import annotations

import torch

from .config import CHAIN_SURE, TreeParams
from .io_struct import ContextDraft, DraftTree, EagleVerifyInput, NodeSource
from .kernels import TORCH, StepOps


def uploaded(values: list[int] | list[float], dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
    """[len(values)] on `device` without the host waiting for it (`sync_count`). On CUDA a
    pinned buffer is copied asynchronously: an upload from pageable memory, or a scalar written
    into the tensor, waits for the device there (one sync per value of the chain). Elsewhere
    the values are written into the tensor one by one, which `sync_count` sees as what it is
    on CPU: no upload."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    out = torch.empty(len(values), dtype=dtype, device=device)
    for i, v in enumerate(values):
        out[i] = v
    return out


def merge_context(drafted: DraftTree, ctx: ContextDraft, tree: TreeParams) -> DraftTree:
    """The head's C candidates plus the context chain's L nodes as candidates C..C+L-1, on the
    device. Where the chain runs along head candidates (the same tokens from the root down),
    those candidates become BOTH and score 1 - (1 - head) * (1 - chain): right where either
    source is, the two taken as independent (a node both proposed was accepted more often than
    either probability said). The chain's own copies of them get
    score -1, below every probability, so they are never selected (the head alone fills the
    budget: `TreeParams` checks its capacity) and siblings stay distinct. The rest of the chain
    hangs below the last shared node, its scores that node's times the chain's own rates past it
    (`chain_p[j] / chain_p[last]`), as the head's children carry their parent's path."""
    dev = drafted.tokens.device
    C, L, S = drafted.tokens.numel(), len(ctx.tokens), tree.num_steps
    chain = uploaded(ctx.tokens, torch.long, dev)  # [L]
    chain_p = uploaded(ctx.scores, torch.float32, dev)  # [L]
    parents = drafted.parents
    has_parent = parents >= 0
    up = parents.clamp_min(0)
    # the chain's token at each head depth 1..S (-1 past its end: matches no token)
    expected = torch.nn.functional.pad(chain[:S], (0, max(0, S - L)), value=-1)  # [S]
    depth = torch.ones(C, dtype=torch.long, device=dev)  # [C]
    for _ in range(S - 1):  # parents precede children: S - 1 passes settle every depth
        depth = torch.where(has_parent, depth[up] + 1, 1)
    same = drafted.tokens == expected[depth - 1]  # [C]
    on_chain = same
    for _ in range(S - 1):
        on_chain = same & torch.where(has_parent, on_chain[up], True)  # [C] root path = chain
    levels = torch.arange(1, L + 1, device=dev)
    cand = torch.arange(C, device=dev)
    at_level = on_chain[None, :] & (depth[None, :] == levels[:, None])  # [L, C]
    shared = torch.where(at_level, cand, -1).amax(-1)  # [L] head candidate on chain node j, -1
    holder = torch.where(shared >= 0, shared, C + levels - 1)  # [L] candidate holding node j
    minus_one = torch.full((1,), -1, dtype=torch.long, device=dev)
    chain_parents = torch.cat([minus_one, holder[:-1]])  # [L]
    on = shared >= 0  # [L] a prefix: a shared node's parent is shared
    slot = shared.clamp_min(0)
    both_p = 1 - (1 - drafted.scores[slot]) * (1 - chain_p)  # [L] where shared
    last = (on.sum() - 1).clamp_min(0).view(1)  # [1] the last shared node's index in the chain
    at_last = chain_p.index_select(0, last)  # [1] 0 only where float32 underflowed: no lift
    lift = torch.where(on.any() & (at_last > 0), both_p.index_select(0, last) / at_last, 1.0)
    own_p = chain_p * lift  # [L]
    scores = drafted.scores.scatter_reduce(0, slot, torch.where(on, both_p, -1.0), "amax")
    head_src = (torch.zeros(C, dtype=torch.long, device=dev) if drafted.sources is None
                else drafted.sources)
    head_src = head_src.scatter_reduce(0, slot, torch.where(on, int(NodeSource.BOTH), 0), "amax")
    return DraftTree(scores=torch.cat([scores, torch.where(on, -1.0, own_p)]),
                     tokens=torch.cat([drafted.tokens, chain]),
                     parents=torch.cat([parents, chain_parents]),
                     sources=torch.cat([head_src, torch.full((L,), int(NodeSource.CONTEXT),
                                                             dtype=torch.long, device=dev)]))


def build_tree(drafted: DraftTree, root: torch.Tensor | int, seq_len: int, tree: TreeParams,
               ops: StepOps = TORCH) -> EagleVerifyInput:
    """root: [1] int64 on the tree's device (the engine's, no upload) or a Python int."""
    dev = drafted.tokens.device
    ranked, order = torch.sort(drafted.scores, descending=True, stable=True)
    best = order[:tree.num_draft_tokens - 1]
    if tree.min_score > 0:  # a prefix of the ranking: parents stay with their children
        best = best[ranked[:best.numel()] >= tree.min_score]
    if tree.context_extra and drafted.sources is not None:  # the sure chain past the budget
        rest = order[best.numel():]  # [R] the other candidates, best first
        sure = ((drafted.sources[rest] != int(NodeSource.HEAD))
                & (ranked[best.numel():] >= max(CHAIN_SURE, tree.min_score)))  # [R]
        best = torch.cat([best, rest[sure][:tree.context_extra]])
    selected = best.sort().values  # [N-1] candidate indices
    parent_cand = drafted.parents[selected]
    parent_node = torch.where(parent_cand < 0, 0,
                              torch.searchsorted(selected, parent_cand.clamp_min(0)) + 1)
    minus_one = torch.full((1,), -1, dtype=torch.long, device=dev)
    parents = torch.cat([minus_one, parent_node])  # [N]
    root_id = torch.as_tensor(root, device=dev).view(1)  # [1]
    tokens = torch.cat([root_id, drafted.tokens[selected]])  # [N]
    scores = torch.cat([torch.ones(1, device=dev), drafted.scores[selected]])  # [N]
    head = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the root (NodeSource.HEAD)
    sources = (torch.cat([head, drafted.sources[selected]]) if drafted.sources is not None
               else head.expand(tokens.numel()))  # [N]
    depth, ancestors, retrieve = ops.build_tree_from_parents(parents, tree.max_depth)
    return EagleVerifyInput(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors,
                            retrieve_indices=retrieve, seq_len=seq_len, scores=scores,
                            sources=sources)


def tree_input(drafted: DraftTree, ctx: ContextDraft | None, root: torch.Tensor,
               seq_len: int, tree: TreeParams, ops: StepOps = TORCH) -> EagleVerifyInput:
    """The head's candidates, with the context's chain merged in when there is one (`ctx`),
    as the tree to verify; root: [1] int64 on the tree's device."""
    cpu = ops.cpp
    if cpu is None:
        if ctx:
            drafted = merge_context(drafted, ctx, tree)
        return build_tree(drafted, root, seq_len, tree, ops)
    sources = torch.empty(0, dtype=torch.long) if drafted.sources is None else drafted.sources
    tokens, parents, depth, ancestors, retrieve, scores, node_sources = cpu.build_tree(
        drafted.scores.contiguous(), drafted.tokens.contiguous(), drafted.parents.contiguous(),
        sources.contiguous(), ctx.tokens if ctx else [], ctx.scores if ctx else [],
        tree.num_steps, root.reshape(1), tree.num_draft_tokens, tree.min_score,
        tree.context_extra, CHAIN_SURE, tree.max_depth)
    return EagleVerifyInput(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors,
                            retrieve_indices=retrieve, seq_len=seq_len, scores=scores,
                            sources=node_sources)
