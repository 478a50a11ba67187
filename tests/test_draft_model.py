"""Issue 3: the EAGLE-3 draft network against a hand-computed reference.

For one token over an empty cache, attention has a single key (softmax = 1, so the attention
output is o_proj of the value projection, whatever RoPE does); everything else is written out
with plain tensor ops: input_norm over the concatenated aux states (norm_before_fc), fc_norm per
aux chunk, fc, residual taken BEFORE hidden_norm (or after it, with norm_before_residual), the
(embeds, hidden) concat order, SwiGLU MLP, later plain layers, final norm, lm_head. Then the
recycled hidden must be the pre-norm one (the normed one with norm_output), each of those three
flags must change the outputs, a q8 head with norm_before_residual must not take the fused C++
layers (they have no such residual), and every level of `draft()` (K > 1, exact ancestry) must
equal a sequential per-path re-computation.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from eagle_engine.accept import extend
from eagle_engine.config import DraftConfig, TargetConfig, TreeParams
from eagle_engine.draft import draft
from eagle_engine.io_struct import EagleDraftExtendInput, EagleDraftInput
from eagle_engine.models.draft_model import Eagle3Draft

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TARGET = TargetConfig(vocab_size=96, hidden_size=24, intermediate_size=64, num_layers=8,
                      num_heads=4, num_kv_heads=2, head_dim=6, rms_norm_eps=1e-6,
                      rope_theta=1e4, rope_scaling=None, max_position_embeddings=512,
                      tie_word_embeddings=False, attention_bias=False, eos_token_ids=(2,))
HEADS = {
    "fc_norm_aux3": dict(fc_norm=True),
    "aux2_two_layers_bias": dict(num_hidden_layers=2, bias=True, attention_bias=True,
                                 eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 5]}),
    "aux4_three_layers": dict(num_hidden_layers=3, num_aux_hidden_states=4,
                              eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4, 6]}),
    "aux_off": dict(hidden_size=24, eagle_config={"use_aux_hidden_state": False}),
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc_norm_output_two_layers": dict(
        num_hidden_layers=2, norm_output=True, eagle_config={"norm_before_fc": True}),
}
NORM_FLAGS = {"norm_before_residual": dict(norm_before_residual=True),
              "norm_before_fc": dict(eagle_config={"norm_before_fc": True}),
              "norm_output": dict(norm_output=True)}


def make_head(seed: int = 0, **overrides: object) -> Eagle3Draft:
    """A random head (Hd=32 != Ht=24 unless overridden) with random norms and biases."""
    raw = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 96, "draft_vocab_size": 50,
           "target_hidden_size": 24, "rms_norm_eps": 1e-5, **overrides}
    torch.manual_seed(seed)
    model = Eagle3Draft(DraftConfig.from_dict(raw), 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
        vd = model.cfg.draft_vocab_size
        used = torch.randperm(96)[:vd].sort().values
        model.d2t.copy_(used - torch.arange(vd))
    return model.eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def single_key_attention(attn: torch.nn.Module, x: torch.Tensor, cfg: DraftConfig) -> torch.Tensor:
    """With one key, every head outputs its (grouped) value: o_proj(v repeated per group)."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bias = attn.qkv_proj.bias
    w_v = attn.qkv_proj.weight[q_dim + kv_dim:]
    v = x @ w_v.T + (bias[q_dim + kv_dim:] if bias is not None else 0)
    v = v.view(cfg.num_kv_heads, cfg.head_dim)
    per_head = v.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=0)  # [H, hd]
    return per_head.reshape(-1) @ attn.o_proj.weight.T


def mlp(layer: torch.nn.Module, h: torch.Tensor, eps: float) -> torch.Tensor:
    x = rms(h, layer.post_attention_layernorm.weight, eps)
    gate, up = (x @ layer.mlp.gate_up_proj.weight.T).chunk(2)
    return (F.silu(gate) * up) @ layer.mlp.down_proj.weight.T


def reference_first_token(model: Eagle3Draft, token: int, features: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """features [W] target features -> (logits [Vd], recycled hidden [Hd]), by hand."""
    cfg, eps = model.cfg, model.cfg.rms_norm_eps
    if cfg.use_aux_hidden_state:
        if cfg.norm_before_fc:
            features = rms(features, model.input_norm.weight, eps)  # one norm over all [A*Ht]
        chunks = features.chunk(cfg.num_aux)
        if cfg.fc_norm:
            chunks = [rms(c, n.weight, eps) for c, n in zip(chunks, model.fc_norm)]
        h = torch.cat(chunks) @ model.fc.weight.T
        if model.fc.bias is not None:
            h = h + model.fc.bias
    else:
        h = features
    layer0 = model.layers[0]
    normed = rms(h, layer0.hidden_norm.weight, eps)
    residual = normed if cfg.norm_before_residual else h  # vLLM `_norm_before_residual`
    x = torch.cat([rms(model.embed_tokens.weight[token], layer0.input_layernorm.weight, eps),
                   normed])  # (embeds, hidden)
    h = residual + single_key_attention(layer0.self_attn, x, cfg)
    h = h + mlp(layer0, h, eps)
    for layer in model.layers[1:]:
        h = h + single_key_attention(layer.self_attn, rms(h, layer.input_layernorm.weight, eps),
                                     cfg)
        h = h + mlp(layer, h, eps)
    final = rms(h, model.norm.weight, eps)
    return final @ model.lm_head.weight.T, (final if cfg.norm_output else h)


@pytest.fixture(scope="module", params=sorted(HEADS))
def head(request: pytest.FixtureRequest) -> Eagle3Draft:
    return make_head(**HEADS[request.param])


def features_for(model: Eagle3Draft, rows: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = EagleDraftExtendInput.hidden_size_for(model.cfg)
    return 2 * torch.randn(rows, width, generator=g)


def test_widths(head: Eagle3Draft) -> None:
    cfg = head.cfg
    expected = cfg.num_aux * 24 if cfg.use_aux_hidden_state else 24
    assert EagleDraftExtendInput.hidden_size_for(cfg) == expected
    assert EagleDraftInput.hidden_size_for(cfg) == cfg.hidden_size
    if cfg.use_aux_hidden_state:
        assert head.fc.in_features == expected
    else:
        assert not hasattr(head, "fc")


@torch.no_grad()
def test_first_forward_matches_hand_reference(head: Eagle3Draft) -> None:
    feats = features_for(head, 1)
    ref_logits, ref_pre = reference_first_token(head, 17, feats[0])
    for position in (0, 37):  # a single key: RoPE cannot change the result
        logits, hidden = head(torch.tensor([[17]]), feats[None], torch.tensor([[position]]),
                              head.new_cache(), 0, None, from_target=True)
        torch.testing.assert_close(logits[0, 0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[0, 0], ref_pre, atol=1e-5, rtol=1e-5)
    # the returned hidden is the pre-norm one, or the normed one with norm_output: the other
    # choice differs (norming again changes it too)
    normed = rms(ref_pre, head.norm.weight, head.cfg.rms_norm_eps)
    assert (normed - ref_pre).abs().max() > 0.1


@pytest.mark.parametrize("flag", sorted(NORM_FLAGS))
@torch.no_grad()
def test_norm_flags_change_the_outputs(flag: str) -> None:
    """The same weights with and without each flag give other logits or recycled hidden, so
    the hand reference above really exercises them."""
    base = make_head()
    variant = make_head(**NORM_FLAGS[flag])
    missing, unexpected = variant.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and missing == (["input_norm.weight"] if flag == "norm_before_fc"
                                            else [])
    assert getattr(variant.cfg, flag) and not getattr(base.cfg, flag)
    feats = features_for(base, 1)
    outs = [m(torch.tensor([[17]]), feats[None], torch.tensor([[0]]), m.new_cache(), 0, None,
              from_target=True) for m in (base, variant)]
    changed = [(a - b).abs().max() for a, b in zip(outs[0], outs[1])]
    assert max(changed) > 1e-2, changed


@torch.no_grad()
def test_q8_head_with_norm_before_residual_keeps_its_python_layers() -> None:
    """The fused C++ layers take the raw hidden as layer 0's residual: a q8 head whose residual
    is the normed hidden keeps its Python layers over the q8 linears, while the same head
    without the flag gets the fused layers."""
    from eagle_engine.models.cpu_lowbit import quantize_head

    for flag in (True, False):
        head = make_head(hidden_size=64, intermediate_size=64, target_hidden_size=64,
                         norm_before_residual=flag)
        quantize_head(head)
        assert (head.fused is None) is flag


@torch.no_grad()
def test_recycled_hidden_is_pre_norm_and_positions(head: Eagle3Draft) -> None:
    """extend() keeps the pre-norm hidden; draft() feeds it back at position seq_len."""
    feats = features_for(head, 1, seed=3)
    cache = head.new_cache()
    state = extend(head, EagleDraftExtendInput(torch.tensor([17]), feats, 0), cache, topk=1)
    ref_logits, ref_pre = reference_first_token(head, 17, feats[0])
    torch.testing.assert_close(state.hidden, ref_pre, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(ref_logits, -1)
    assert int(state.topk_ids[0]) == int(head.hot_ids[probs.argmax()])
    torch.testing.assert_close(state.topk_p[0], probs.max(), atol=1e-5, rtol=1e-5)
    assert (state.root, state.seq_len) == (17, 1)

    committed = copy.deepcopy(cache)
    drafted = draft(head, state, cache, TreeParams(topk=1, num_steps=2, num_draft_tokens=3))

    def step_logits(hidden: torch.Tensor, position: int) -> torch.Tensor:
        logits, _ = head(state.topk_ids[None], hidden[None, None], torch.tensor([[position]]),
                         copy.deepcopy(committed), 1, None, from_target=False)
        return logits[0, 0]

    expected = step_logits(ref_pre, 1)
    probs = torch.softmax(expected, -1)
    assert int(drafted.tokens[1]) == int(head.hot_ids[probs.argmax()])
    torch.testing.assert_close(drafted.scores[1], state.topk_p[0] * probs.max())
    # the alternatives (normed hidden, position seq_len + 1) really differ from the expectation
    normed = rms(ref_pre, head.norm.weight, head.cfg.rms_norm_eps)
    assert (step_logits(normed, 1) - expected).abs().max() > 1e-2
    assert (step_logits(ref_pre, 2) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("topk, steps", [(3, 4), (2, 3)])
@torch.no_grad()
def test_draft_tree_equals_sequential_paths(topk: int, steps: int) -> None:
    """Every expanded node's children (tokens and cumulative scores) equal a sequential draft
    run along that node's own path: the tree mask gives each node exactly its ancestry. The
    head's attention and output are sharpened so that one wrongly visible scratch row, a wrong
    position or a wrong recycled hidden moves the probabilities by percents (a default-init
    head is near-uniform and would hide them below the tolerance)."""
    model = make_head(seed=4, num_hidden_layers=2, draft_vocab_size=96)
    for layer in model.layers:
        layer.self_attn.qkv_proj.weight.mul_(3)
        layer.self_attn.o_proj.weight.mul_(3)
    model.lm_head.weight.mul_(3)
    seq = 6
    feats = features_for(model, seq, seed=5)
    ids = torch.randint(3, 96, (seq,), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache()
    state = extend(model, EagleDraftExtendInput(ids, feats, 0), cache, topk)
    committed = copy.deepcopy(cache)
    tree = draft(model, state, cache, TreeParams(topk, steps, topk + 1))
    parents, tokens, scores = tree.parents.tolist(), tree.tokens, tree.scores
    assert len(parents) == topk + (steps - 1) * topk * topk

    def path_of(node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    expanded = sorted({p for p in parents if p >= 0})
    assert len(expanded) == (steps - 1) * topk
    for node in expanded:
        c = copy.deepcopy(committed)
        hidden = state.hidden
        for depth, n in enumerate(path_of(node)):
            logits, h = model(tokens[n].view(1, 1), hidden.view(1, 1, -1),
                              torch.tensor([[seq + depth]]), c, seq + depth, None,
                              from_target=False)
            hidden = h[0, 0]
        p, idx = torch.softmax(logits[0, 0], -1).topk(topk)
        children = [i for i, q in enumerate(parents) if q == node]
        assert tokens[children].tolist() == model.hot_ids[idx].tolist()
        torch.testing.assert_close(scores[children], scores[node] * p, atol=0, rtol=1e-5)
