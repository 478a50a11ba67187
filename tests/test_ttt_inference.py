"""Training sees what inference sees: the trainer's training-time-test steps compute the same
draft distributions as the engine's draft extend and decode steps (`accept.extend`,
`draft.draft`) for the same conversation, positions and tokens. A mismatch here (a RoPE offset,
a shifted token, a wrong attention pattern) would train heads for a different input than the one
they get, and show up only as low acceptance."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle_engine.accept import extend
from eagle_engine.config import TreeParams
from eagle_engine.draft import draft
from eagle_engine.io_struct import EagleDraftExtendInput
from eagle_engine.kv_cache import causal_mask
from eagle_engine.train.trainer import Batch, ttt_hidden
from tests.helpers import random_head

T, POS, STEPS = 18, 9, 4  # conversation length, position the draft starts from, chain length


def features_batch(target, ids: torch.Tensor, aux_ids: tuple[int, ...]) -> Batch:  # noqa: ANN001
    """The target's features of `ids` [T] as a one-row training batch."""
    n = ids.numel()
    out = target(ids[None], torch.arange(n)[None], target.new_cache(max_len=n), 0,
                 causal_mask(n, 0, "cpu"), aux_ids)
    return Batch(ids=ids[None], aux=out.aux_hidden, final=out.final_hidden,
                 response=torch.ones(1, n, dtype=torch.bool),
                 in_vocab_target=torch.ones(1, n, dtype=torch.bool), argmax=out.logits.argmax(-1))


def step_probs(head, batch: Batch, steps: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Draft-vocabulary probabilities [Vd] at position POS after each TTT step."""
    return [torch.softmax(head.lm_head(head.norm(h[0, POS])), -1)
            for h in ttt_hidden(head, batch, steps)]


@pytest.mark.parametrize("num_layers,use_aux,norm_output",
                         [(1, True, False), (2, True, False), (1, False, False), (1, True, True)])
@torch.no_grad()
def test_ttt_steps_equal_the_engine_draft_chain(tiny_target, num_layers: int, use_aux: bool,
                                                norm_output: bool) -> None:
    """With `norm_output` the engine recycles norm(h) and the trainer's TTT steps must too."""
    head = random_head(tiny_target.cfg, seed=3, num_layers=num_layers, use_aux=use_aux,
                       draft_vocab=40, norm_output=norm_output)
    aux_ids = head.cfg.resolve_aux_layer_ids(tiny_target.cfg) if use_aux else ()
    ids = torch.randint(3, tiny_target.cfg.vocab_size, (T,),
                        generator=torch.Generator().manual_seed(0))
    # make the tokens after POS+1 the draft's own greedy chain, which is what a top-1 draft
    # decodes; step k at POS depends only on tokens <= POS+k+1, so each choice is final
    for k in range(STEPS):
        batch = features_batch(tiny_target, ids, aux_ids)
        ids[POS + k + 2] = head.hot_ids[step_probs(head, batch, k + 1)[k].argmax()]
    batch = features_batch(tiny_target, ids, aux_ids)
    trained = step_probs(head, batch, STEPS)
    hidden = batch.aux if use_aux else batch.final

    cache = head.new_cache(T + 8)
    full = extend(head, EagleDraftExtendInput(ids[1:POS + 2], hidden[0, :POS + 1], 0), cache,
                  head.cfg.draft_vocab_size)
    torch.testing.assert_close(full.topk_p, trained[0].sort(descending=True).values)
    top1 = replace(full, topk_p=full.topk_p[:1], topk_ids=full.topk_ids[:1])
    tree = draft(head, top1, cache, TreeParams(1, STEPS, STEPS + 1))
    assert tree.tokens.tolist() == ids[POS + 2:POS + 2 + STEPS].tolist()
    expected = torch.stack([p.max().log() for p in trained]).cumsum(0)  # log path probabilities
    torch.testing.assert_close(tree.scores.log(), expected)  # logs: the products get tiny
