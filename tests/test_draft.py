"""The draft phase against a chain recomputation.

Every candidate `draft()` proposes carries the cumulative draft probability of its path. Here each
path is decoded again on its own (one token per step under a plain causal mask, the parent
step's hidden recycled, as in training-time test) from the same committed draft cache, and the
product of the draft's probabilities along it must equal the candidate's score. That pins the
tree attention mask (each node sees exactly its ancestors), the positions, the recycled hidden
states and the candidate layout (parents, tokens) of the EAGLE-2 expansion.
"""
from __future__ import annotations

import pytest
import torch

from eagle_engine.config import TargetConfig, TreeParams
from eagle_engine.draft import draft
from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.selfcheck import prefill_both, tiny_models
from tests.helpers import random_head


def sensitive_head(target_cfg: TargetConfig) -> Eagle3Draft:
    """A random head whose attention and output are sharp enough that one wrongly visible
    scratch row moves the draft probabilities by percents (default-init heads are near-uniform)."""
    head = random_head(target_cfg, draft_vocab=64)
    with torch.no_grad():
        attn = head.layers[0].self_attn
        for w in (attn.qkv_proj.weight, attn.o_proj.weight, head.lm_head.weight):
            w.mul_(3)
    return head


@pytest.mark.parametrize(("topk", "steps"), [(1, 4), (3, 4), (4, 3)])
@torch.inference_mode()
def test_draft_scores_equal_chain_decoding(topk: int, steps: int) -> None:
    target, _ = tiny_models("cpu")
    head = sensitive_head(target.cfg)
    dcache = head.new_cache()
    inp = prefill_both(target, head, (target.new_cache(),), (dcache,), topk, seed=3)
    drafted = draft(head, inp, dcache, TreeParams(topk, steps, 2))
    parents, tokens = drafted.parents.tolist(), drafted.tokens.tolist()
    assert len(parents) == TreeParams(topk, steps, 2).capacity
    draft_index = {t: i for i, t in enumerate(head.hot_ids.tolist())}
    seq = inp.seq_len
    for cand in range(len(parents)):
        path = [cand]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        assert path[0] < topk and all(p < c for p, c in zip(path, path[1:]))
        prob, hidden = inp.topk_p[path[0]], inp.hidden
        for depth, (node, child) in enumerate(zip(path, path[1:])):
            logits, h = head(torch.tensor([[tokens[node]]]), hidden[None, None],
                             torch.tensor([[seq + depth]]), dcache, seq + depth,
                             causal_mask(1, seq + depth, "cpu"), from_target=False)
            prob = prob * torch.softmax(logits[0, -1], -1)[draft_index[tokens[child]]]
            hidden = h[0, -1]
        torch.testing.assert_close(drafted.scores[cand], prob, rtol=1e-5, atol=0,
                                   msg=f"candidate {cand} (path {path})")
