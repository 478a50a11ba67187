"""Per-phase data types of one EAGLE-3 iteration, one class per phase, never reused across phases.

    EagleDraftInput -> draft() -> DraftTree [-> merge_context(ContextDraft)] -> build_tree()
    -> EagleVerifyInput -> verify() -> EagleVerifyOutput -> commit(), readback_parts()
    -> VerifyReadback (the host's one copy) -> EagleDraftExtendInput -> extend()
    -> EagleDraftInput

Everything up to `VerifyReadback` stays on the device: no phase reads a tensor on the host, so
an iteration makes one host sync, the packed copy behind `VerifyReadback`. `ContextDraft` is
the exception that proves it: host data proposed from tokens the host already holds, written
into the tree without reading anything back. The widths of
hidden-state tensors come only from `hidden_size_for` / `dtype_for` here; every buffer that
holds hidden states (CUDA-graph static buffers) is sized through them.
Not here: any computation. Shapes are for one request: the scheduler keeps one of each per
request and batches only the forwards (`batch_phases.py`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .config import DraftConfig


@dataclass(slots=True)
class EagleDraftInput:
    """Draft phase input: the draft's top-k guesses after the root and its recycled hidden."""

    topk_p: torch.Tensor  # [topk] float32 draft probabilities of the level-1 candidates
    topk_ids: torch.Tensor  # [topk] int64 target-vocab ids
    hidden: torch.Tensor  # [hidden_size_for] pre-norm draft hidden recycled into decode steps
    root: torch.Tensor  # [1] int64 last token produced by the target; not yet in any KV cache
    seq_len: int  # committed tokens in the target and draft caches

    @classmethod
    def hidden_size_for(cls, draft: DraftConfig) -> int:
        return draft.hidden_size

    @classmethod
    def dtype_for(cls, draft_module: torch.nn.Module) -> torch.dtype:
        return draft_module.norm.weight.dtype


class NodeSource(enum.IntEnum):
    """Who proposed a tree node: the head, the context's suffix match, or both alike."""

    HEAD = 0
    CONTEXT = 1
    BOTH = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class ContextDraft:
    """Context phase output, on the host: the tokens that followed the latest earlier occurrence
    of the longest suffix of the context (prompt + generated text, root last) that occurred
    before, as a chain after the root, with its calibrated path probabilities."""

    tokens: list[int]  # [L] the chain, its first token the root's child
    scores: list[float]  # [L] non-increasing: probability that the chain is right up to here
    match_len: int  # tokens of the matched suffix (root included)


@dataclass(slots=True)
class DraftTree:
    """Everything the draft proposed this iteration (all candidates, before selection)."""

    scores: torch.Tensor  # [capacity] float32 cumulative path probability of each candidate
    tokens: torch.Tensor  # [capacity] int64 target-vocab ids
    parents: torch.Tensor  # [capacity] int64 candidate index of the parent (-1 = root)
    sources: torch.Tensor | None = None  # [capacity] int64 NodeSource; None: all the head's


@dataclass(slots=True)
class EagleVerifyInput:
    """The selected tree, root first; parents precede children; siblings in candidate order
    (the head's in draft-prob order, then a node from the context)."""

    tokens: torch.Tensor  # [N] int64, tokens[0] = root
    parents: torch.Tensor  # [N] int64 node index of the parent, -1 for the root
    depth: torch.Tensor  # [N] int64, 0 for the root
    ancestors: torch.Tensor  # [N, N] bool, [i, j] = j is an ancestor-or-self of i
    retrieve_indices: torch.Tensor  # [N, min(N, num_steps+1)] int64 root->node path, -1 pad
    seq_len: int  # cache row / position of the root
    scores: torch.Tensor  # [N] float32 draft probability of each node's path (root 1); a
    # calibrated draft accepts a node about that often (docs/design.md)
    sources: torch.Tensor  # [N] int64 NodeSource of each node (the root: HEAD)

    @property
    def positions(self) -> torch.Tensor:
        return self.seq_len + self.depth  # [N]


@dataclass(slots=True)
class EagleDraftExtendInput:
    """Accepted tokens with the target hidden states that precede them, for the draft extend.
    Row k pairs hidden of committed position seq_len+k with the token at seq_len+k+1."""

    tokens: torch.Tensor  # [num_accepted + 1] int64 accepted drafts then the bonus token
    hidden: torch.Tensor  # [num_accepted + 1, hidden_size_for] target features
    seq_len: int  # first position written (the old committed length)

    @classmethod
    def hidden_size_for(cls, draft: DraftConfig) -> int:
        """num_aux * target_hidden with aux states on, else the target's final hidden width."""
        if draft.use_aux_hidden_state:
            return draft.num_aux * draft.target_hidden_size
        return draft.target_hidden_size

    @classmethod
    def dtype_for(cls, target_module: torch.nn.Module) -> torch.dtype:
        return target_module.embed_tokens.weight.dtype


@dataclass(slots=True)
class EagleVerifyOutput:
    """Result of verification, on the device: the accepted path and the emitted tokens, padded
    to W = retrieve_indices.shape[1] slots (the deepest path the tree holds)."""

    accepted_nodes: torch.Tensor  # [W] int64 node indices root first, -1 past the path's end
    num_accepted: torch.Tensor  # [1] int64 accepted drafts (the path's length - 1)
    emitted: torch.Tensor  # [W] int64 accepted drafts, then the bonus token, then -1


@dataclass(slots=True)
class VerifyReadback:
    """What the host reads of one iteration, from one packed copy: the emitted tokens and the
    accepted path, plus (when tracing) the verified tree. Plain Python data."""

    emitted: list[int]  # accepted draft tokens then the bonus token
    accepted_nodes: list[int]  # node indices of the accepted path, root first
    tree_tokens: list[int]  # [N] the verified tree's tokens, root first (empty unless traced)
    tree_parents: list[int]  # [N] parent node of each node, -1 for the root (same)
    tree_depth: list[int]  # [N] (same)
    tree_scores: list[float]  # [N] draft probability of each node's path (same)
    accepted_sources: list[int]  # NodeSource of each accepted node, root first
    tree_sources: list[int]  # [N] NodeSource of each node (empty unless traced)

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1
