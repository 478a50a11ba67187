"""Tree phase: rerank all drafted candidates to the best `num_draft_tokens - 1`, put the root in
front and build what verification needs (parents, depth, ancestor mask, retrieve indices).
Selection is a stable descending sort, so a parent (never scored below its child, and earlier in
the candidate order) is always selected before its children. Not here: drafting or verifying.
"""
from __future__ import annotations

import torch

from .config import TreeParams
from .io_struct import DraftTree, EagleVerifyInput
from .kernels import build_tree_from_parents


def build_tree(drafted: DraftTree, root: torch.Tensor | int, seq_len: int, tree: TreeParams
               ) -> EagleVerifyInput:
    """root: [1] int64 on the tree's device (the engine's, no upload) or a Python int."""
    dev = drafted.tokens.device
    order = torch.sort(drafted.scores, descending=True, stable=True).indices
    selected = order[:tree.num_draft_tokens - 1].sort().values  # [N-1] candidate indices
    parent_cand = drafted.parents[selected]
    parent_node = torch.where(parent_cand < 0, 0,
                              torch.searchsorted(selected, parent_cand.clamp_min(0)) + 1)
    minus_one = torch.full((1,), -1, dtype=torch.long, device=dev)
    parents = torch.cat([minus_one, parent_node])  # [N]
    root_id = torch.as_tensor(root, device=dev).view(1)  # [1]
    tokens = torch.cat([root_id, drafted.tokens[selected]])  # [N]
    scores = torch.cat([torch.ones(1, device=dev), drafted.scores[selected]])  # [N]
    depth, ancestors, retrieve = build_tree_from_parents(parents, tree.num_steps)
    return EagleVerifyInput(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors,
                            retrieve_indices=retrieve, seq_len=seq_len, scores=scores)
