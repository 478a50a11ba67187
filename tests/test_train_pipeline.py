"""The training pipeline end to end in its --quick configuration (a test of the pipeline, not
of head quality): data, features, vocab, TTT training, export in the HF EAGLE-3 format, and the
exported head loads into the engine and keeps greedy parity with the baseline."""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle_engine.config import EngineConfig, SamplingParams, TreeParams
from eagle_engine.engine import EagleEngine
from eagle_engine.io_struct import EagleDraftExtendInput
from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.draft_io import save_draft
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.loader import load_target
from eagle_engine.models.target import TargetModel
from eagle_engine.tools.cli import main
from eagle_engine.train.pipeline import inherited_vocab, init_head
from eagle_engine.train.trainer import (
    Batch,
    Recipe,
    TrainParams,
    ttt_attention,
    ttt_hidden,
    ttt_loss,
)
from tests.helpers import ByteTokenizer, make_hf_target, random_head

DATA = Path(__file__).parent / "data" / "prompts_small.jsonl"


def test_quick_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "head", tmp_path / "work"
    assert main(["train", "--quick", "--prompts", str(DATA), "--out", str(out),
                 "--work-dir", str(work)]) == 0
    said = capsys.readouterr().out  # where the head is and how to try it, without -v
    assert f"wrote {out} (" in said and f"generate --draft {out} " in said
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 512 and cfg["eagle_config"]["use_aux_hidden_state"]
    assert (out / "training.png").stat().st_size > 1000
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(len(r["step_acc"]) == 3 for r in log)
    rows = (work / "responses.jsonl").read_text().splitlines()
    assert len(rows) == 12  # 6 prompts, one extra sampled answer each
    engine = EagleEngine.load(EngineConfig(drafts=(str(out),), dtype="fp32", max_len=512))
    prompt = engine.encode("Name three colors.")
    params = SamplingParams(max_new_tokens=16)
    base = engine.generate(prompt, params)
    spec = engine.generate(prompt, params, TreeParams(4, 3, 8), head="head")
    assert spec.token_ids == base.token_ids


def test_saved_answers_seed_a_new_work_dir_without_generating(
        tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001 - pytest fixtures
    """`--responses` (gzipped, as in data/answers/) fills a fresh work directory, and training
    runs without generating an answer; a missing file is named."""
    from eagle_engine.train import data

    first = tmp_path / "work1"
    args = ["train", "--quick", "--prompts", str(DATA), "--out", str(tmp_path / "head")]
    assert main(args + ["--work-dir", str(first)]) == 0
    saved = tmp_path / "answers.jsonl.gz"
    saved.write_bytes(gzip.compress((first / "responses.jsonl").read_bytes()))

    def no_generation(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("generated although every answer was saved")

    monkeypatch.setattr(data, "generate_batch", no_generation)
    second = tmp_path / "work2"
    assert main(args + ["--work-dir", str(second), "--responses", str(saved)]) == 0
    assert (second / "responses.jsonl").read_text() == (first / "responses.jsonl").read_text()
    assert main(args + ["--work-dir", str(tmp_path / "w3"), "--responses",
                        str(tmp_path / "missing.jsonl.gz")]) == 2
    assert "--responses" in capsys.readouterr().err


@pytest.mark.parametrize("block", [128, 2, 3])
def test_ttt_attention_matches_explicit_mask(block: int) -> None:
    """The TTT attention equals plain attention over [causal step-0 keys | own chain keys],
    in one query block and split into several (the last one shorter)."""
    torch.manual_seed(0)
    B, H, KVH, T, d = 2, 4, 2, 5, 8
    q = torch.randn(B, H, T, d)
    keys = [torch.randn(B, KVH, T, d) for _ in range(3)]
    values = [torch.randn(B, KVH, T, d) for _ in range(3)]
    out = ttt_attention(q, keys, values, block)
    g = H // KVH
    for b in range(B):
        for h in range(H):
            for t in range(T):
                ks = torch.cat([keys[0][b, h // g, :t + 1]] + [k[b, h // g, t:t + 1]
                                                             for k in keys[1:]])
                vs = torch.cat([values[0][b, h // g, :t + 1]] + [v[b, h // g, t:t + 1]
                                                               for v in values[1:]])
                w = torch.softmax(ks @ q[b, h, t] / d ** 0.5, 0)
                torch.testing.assert_close(out[b, h, t], w @ vs, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_ttt_attention_on_cuda_runs_no_cudnn_kernel() -> None:
    """On CUDA, in bf16 at the bundled target's head size (the shapes training runs, for which
    PyTorch picks cuDNN's attention by itself), the TTT attention runs another kernel and still
    equals the float32 attention on the CPU: cuDNN built a plan for every new block shape, ~1.7 s
    of host time a training step on an H200."""
    torch.manual_seed(0)
    B, H, KVH, T, d = 2, 9, 3, 300, 64
    q = torch.randn(B, H, T, d)
    keys = [torch.randn(B, KVH, T, d) for _ in range(3)]
    values = [torch.randn(B, KVH, T, d) for _ in range(3)]
    expected = ttt_attention(q, keys, values)
    on_gpu = [[t.to("cuda", torch.bfloat16) for t in ts] for ts in ([q], keys, values)]
    with torch.profiler.profile() as prof:
        out = ttt_attention(on_gpu[0][0], on_gpu[1], on_gpu[2]).float().cpu()
    assert not [e.key for e in prof.key_averages() if "cudnn" in e.key], "cuDNN attention ran"
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)


def loss_batch(tiny_target, head: Eagle3Draft, T: int = 12) -> Batch:  # noqa: ANN001
    """Two random conversations through `tiny_target`: random response positions, and target
    argmaxes inside `head`'s draft vocabulary or not."""
    ids = torch.randint(3, tiny_target.cfg.vocab_size, (2, T),
                        generator=torch.Generator().manual_seed(1))
    aux_ids = head.cfg.resolve_aux_layer_ids(tiny_target.cfg)
    with torch.no_grad():
        out = tiny_target(ids, torch.arange(T)[None].expand(2, T), tiny_target.new_cache(
            batch=2, max_len=T), 0, causal_mask(T, 0, "cpu"), aux_ids)
    response = torch.rand(2, T, generator=torch.Generator().manual_seed(2)) < 0.7
    in_vocab = torch.zeros(tiny_target.cfg.vocab_size, dtype=torch.bool)
    in_vocab[head.hot_ids] = True
    argmax = out.logits.argmax(-1)
    return Batch(ids=ids, aux=out.aux_hidden.clone(), final=out.final_hidden.clone(),
                 response=response, in_vocab_target=in_vocab[argmax], argmax=argmax)


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(mask_outside_vocab=False),
                                    Recipe(tv_weight=0.7)], ids=["plain", "nomask", "tv"])
def test_ttt_loss_is_the_soft_cross_entropy(tiny_target, recipe: Recipe) -> None:  # noqa: ANN001
    """`ttt_loss` equals sum_k 0.8^k * mean over scored positions of
    -sum_v p_target(v) log p_draft(v) + tv_weight * 0.5 * sum_v |p_target(v) - p_draft(v)|,
    written out with log_softmax, in value and in gradient. Scored positions: the response
    tokens whose target argmax lies in the draft vocabulary, or every response token with
    `nomask` (more of them here). Its accuracies are the draft's top-1 against the target's
    argmax over the in-vocabulary positions whatever the recipe, so they equal the plain
    recipe's; the loss and gradient of the other recipes do not."""
    head = random_head(tiny_target.cfg, seed=5, draft_vocab=40)
    T = 12
    batch = loss_batch(tiny_target, head, T)
    assert (batch.valid != batch.response).any()  # some targets outside the draft vocabulary
    target_head = tiny_target.lm_head.weight.detach()[head.hot_ids]
    params = TrainParams(ttt_length=3)
    weights = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    loss, losses, accs = ttt_loss(head, batch, target_head, params, recipe)
    expected = 0.0
    for k, h in enumerate(ttt_hidden(head, batch, 3)):
        s = k + 1
        valid = batch.valid[:, s:]
        scored = valid if recipe.mask_outside_vocab else batch.response[:, s:]
        logp = torch.log_softmax(head.lm_head(head.norm(h[:, :T - s][scored])), -1)
        p = torch.softmax(batch.final[:, s:][scored] @ target_head.T, -1)
        step = -(p * logp).sum(-1).mean() + \
            recipe.tv_weight * 0.5 * (p - logp.exp()).abs().sum(-1).mean()
        torch.testing.assert_close(losses[k], float(step.detach()), rtol=1e-5, atol=1e-5)
        hit = (head.hot_ids[logp.argmax(-1)] == batch.argmax[:, s:][scored])[valid[scored]]
        assert accs[k] == pytest.approx(float(hit.sum()) / int(valid.sum()))
        expected = expected + 0.8 ** k * step
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(loss, weights)
    for g, e in zip(grads, torch.autograd.grad(expected, weights)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    plain_loss, plain_losses, plain_accs = ttt_loss(head, batch, target_head, params)
    assert accs == plain_accs
    if recipe != Recipe():
        assert all(a != b for a, b in zip(losses, plain_losses))
        plain = torch.autograd.grad(plain_loss, weights)
        assert max(float((g - q).abs().max()) for g, q in zip(grads, plain)) > 1e-4


def test_feature_noise_is_per_chunk_and_only_in_training(tiny_target) -> None:  # noqa: ANN001
    """`noise=S` adds Gaussian noise of S times each token's aux-chunk RMS to the head's input
    (a chunk 1000x larger gets 1000x the noise, the others keep theirs). Two train steps with it
    move the weights elsewhere than without; the same recipe without a generator (evaluation,
    `step_accuracy`) adds none."""
    import copy

    from eagle_engine.train.trainer import add_feature_noise, new_optimizer, train_step

    head = random_head(tiny_target.cfg, seed=5, draft_vocab=40)
    feats = torch.randn(2, 7, 3 * tiny_target.cfg.hidden_size)
    feats[..., tiny_target.cfg.hidden_size:2 * tiny_target.cfg.hidden_size] *= 1000
    noised = add_feature_noise(head, feats, 0.1, torch.Generator().manual_seed(0))
    ratio = ((noised - feats).unflatten(-1, (3, -1)).pow(2).mean(-1)
             / feats.unflatten(-1, (3, -1)).pow(2).mean(-1)).sqrt()  # [2, 7, 3]
    torch.testing.assert_close(ratio.mean((0, 1)), torch.full((3,), 0.1), rtol=0.15, atol=0)

    batch = loss_batch(tiny_target, head)
    target_head = tiny_target.lm_head.weight.detach()[head.hot_ids].to(torch.bfloat16)
    params = TrainParams(ttt_length=3)
    noisy = Recipe(feature_noise=0.3)
    with torch.no_grad():
        assert ttt_loss(head, batch, target_head, params, noisy)[1] == \
            ttt_loss(head, batch, target_head, params)[1]

    def trained(recipe: Recipe, noise: bool) -> Eagle3Draft:
        model = copy.deepcopy(head)
        opt, trainable = new_optimizer(model, params)
        for step in range(2):
            gen = torch.Generator().manual_seed(step) if noise else None
            train_step(model, opt, trainable, batch, target_head, params, 1e-3, recipe, gen)
        return model

    plain = trained(Recipe(), False)
    for model, same in ((trained(noisy, True), False), (trained(noisy, False), True)):
        diff = max(float((a - b).abs().max()) for a, b in zip(
            model.state_dict().values(), plain.state_dict().values()))
        assert (diff == 0) is same, diff


def test_init_from_carries_lm_head_rows_id_by_id(tmp_path: Path) -> None:
    """`--init-from` copies a trained head's tensors. Its lm_head rows are indexed by draft id:
    a warm start of another vocabulary keeps each shared id's row, and a new id's row is the
    target's row through the map from the target's rows to the trained ones (here an exact
    linear map, recovered up to the ridge damping), not the bare target row."""
    target = load_target(make_hf_target(tmp_path / "t"), torch.float32, "cpu", 128)
    source = random_head(target.cfg, seed=3, draft_vocab=48)
    mapping = torch.randn(32, 32) / 32 ** 0.5
    with torch.no_grad():
        source.lm_head.weight.copy_(target.lm_head.weight[source.hot_ids] @ mapping)
    save_draft(source, target.cfg, tmp_path / "src", 128, dtype=torch.float32)
    counts = Counter({t: 100 - t for t in range(96)})  # lower ids more frequent
    same = inherited_vocab(tmp_path / "src", counts, 48, 96)
    grown = inherited_vocab(tmp_path / "src", counts, 64, 96)
    shrunk = inherited_vocab(tmp_path / "src", counts, 16, 96)
    assert torch.equal(same, source.hot_ids)
    assert set(source.hot_ids.tolist()) < set(grown.tolist())
    assert torch.equal(shrunk, source.hot_ids[:16])  # its 16 most frequent ids
    rows = {}
    for hot in (same, grown, shrunk):
        model = random_head(target.cfg, seed=4, draft_vocab=hot.numel()).train()
        init_head(model, target, hot, tmp_path / "src")
        torch.testing.assert_close(model.layers[0].mlp.down_proj.weight,
                                   source.layers[0].mlp.down_proj.weight)
        assert torch.equal(model.hot_ids, hot)
        shared = torch.isin(hot, source.hot_ids)
        assert torch.equal(model.lm_head.weight[shared],
                           source.lm_head.weight[torch.isin(source.hot_ids, hot)])
        rows[hot.numel()] = model.lm_head.weight.detach()
    new = ~torch.isin(grown, source.hot_ids)
    got = rows[64][new]  # [16, 32]
    expected = target.lm_head.weight[grown[new]].detach() @ mapping
    assert float((got - expected).norm() / expected.norm()) < 0.05
    bare = target.lm_head.weight[grown[new]].detach()
    assert float((got - bare).norm() / expected.norm()) > 0.5


def test_init_from_a_one_layer_head_grows_a_second_layer_that_starts_as_the_identity(
        tmp_path: Path) -> None:
    """`--init-from` a 1-layer head into a 2-layer one (how `eagle3-aux-2layer` was made)
    copies fc, its norms, layer 0, the final norm and lm_head, and the second layer starts with
    zero residual branches: the grown head's logits and recycled hidden equal the source's,
    over a prompt and over a draft step from the recycled hidden."""
    target = load_target(make_hf_target(tmp_path / "t"), torch.float32, "cpu", 128)
    source = random_head(target.cfg, seed=3, draft_vocab=48, fc_norm=True, norm_output=True)
    save_draft(source, target.cfg, tmp_path / "src", 128, dtype=torch.float32)
    grown = random_head(target.cfg, seed=4, num_layers=2, draft_vocab=48, fc_norm=True,
                        norm_output=True)
    init_head(grown, target, source.hot_ids, tmp_path / "src")
    torch.manual_seed(0)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 5))  # [1, 5]
    feats = torch.randn(1, 5, EagleDraftExtendInput.hidden_size_for(source.cfg))  # [1, 5, 3H]
    outs = []
    for head in (source, grown):
        cache = head.new_cache()
        logits, hidden = head(ids, feats, torch.arange(5)[None], cache, 0, causal_mask(5, 0, "cpu"),
                              from_target=True)  # [1, 5, Vd], [1, 5, H]
        step, _ = head(ids[:, -1:], hidden[:, -1:], torch.tensor([[5]]), cache, 5,
                       causal_mask(1, 5, "cpu"), from_target=False)  # [1, 1, Vd]
        outs.append((logits, hidden, step))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert float(grown.layers[1].self_attn.qkv_proj.weight.abs().sum()) > 0  # a real layer


def test_more_samples_per_prompt_adds_only_new_answers_and_refreshes_features(
        tmp_path: Path) -> None:
    """Raising the answers per prompt appends sampled answers `{id}#{j}` without regenerating the
    existing ones, and feature extraction rewrites a shard that now holds more rows."""
    from eagle_engine.train.data import generate_responses, select_prompts
    from eagle_engine.train.features import extract, load_samples, read_rows

    target = load_target(make_hf_target(tmp_path / "t", weight_scale=1.0, vocab_size=300),
                         torch.float32, "cpu", 256)  # vocab covers ByteTokenizer's ids
    prompts = select_prompts(DATA, 3, seed=0)
    out = tmp_path / "responses.jsonl"
    args = dict(max_new_tokens=5, batch_size=4, sampled_share=0.0, seed=0)
    generate_responses(target, ByteTokenizer(), prompts, out, samples=lambda s: 1, **args)
    first = read_rows(out)
    assert [r["temperature"] for r in first] == [0.0] * 3
    eos = ByteTokenizer.eos_token_id  # an answer cut at max_new_tokens gets no stop token
    assert any(len(r["response_ids"]) == 5 for r in first)
    assert all(len(r["response_ids"]) == 5 and eos not in r["response_ids"]
               or r["response_ids"][-1] == eos and len(r["response_ids"]) <= 5 for r in first)
    shards = extract(target, first, (1, 4, 6), tmp_path / "features", shard_size=4)
    assert len(load_samples(shards)) == 3
    generate_responses(target, ByteTokenizer(), prompts, out, samples=lambda s: 3, **args)
    rows = read_rows(out)
    assert rows[:3] == first
    assert sorted(r["id"] for r in rows[3:]) == sorted(f"{p['id']}#{j}" for p in prompts
                                                       for j in (1, 2))
    assert all(r["temperature"] == 0.7 for r in rows[3:])
    shards = extract(target, rows, (1, 4, 6), tmp_path / "features", shard_size=4)
    samples = load_samples(shards)
    assert [s.ids.tolist() for s in samples] == [r["prompt_ids"] + r["response_ids"]
                                                 for r in rows]


def test_heldout_accuracy_scores_every_answer_token(tiny_target: TargetModel,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """eval-head's measurement: one accuracy per TTT step, in [0, 1], over every generated answer
    token except each answer's last (whose target lies past the end); with a smaller draft
    vocabulary, over the tokens it holds, beside a lower accuracy over every answer token."""
    from eagle_engine.baseline import generate_batch
    from eagle_engine.train.evaluate import heldout_accuracy

    head = random_head(tiny_target.cfg, seed=1)
    prompts = [[1, 5, 9, 14], [1, 7, 3], [1, 20, 21, 22, 23, 24]]
    accs, every, n, coverage = heldout_accuracy(head, tiny_target, prompts, (2,), 10, 3)
    answers = generate_batch(tiny_target, prompts, SamplingParams(max_new_tokens=10), (2,))
    assert n == sum(len(a) - 1 for a in answers) > 0
    assert len(accs) == 3 and all(0.0 <= a <= 1.0 for a in accs)
    assert coverage == 1.0 and every == accs  # the whole vocabulary
    half = random_head(tiny_target.cfg, seed=1, draft_vocab=48)
    tokens = [t for a in answers for t in a]
    share = sum(t in set(half.hot_ids.tolist()) for t in tokens) / len(tokens)
    assert 0.0 < share < 1.0
    monkeypatch.setattr("eagle_engine.train.evaluate.step_accuracy", lambda *a: [1.0] * 3)
    accs, every, n_half, coverage = heldout_accuracy(half, tiny_target, prompts, (2,), 10, 3)
    assert coverage == pytest.approx(share) and n_half < n
    # right on every token it holds: over every token, right as often as it holds the token
    assert all(e == pytest.approx(share, abs=0.1) for e in every)


def tiny_training_data(tmp_path: Path) -> tuple:
    """A tiny target, 12 `tiny_rows` conversations, its aux ids, and a draft vocabulary of every
    other token (ids [Vd], mask [V])."""
    target = load_target(make_hf_target(tmp_path / "t"), torch.float32, "cpu", 256)
    hot = torch.arange(0, target.cfg.vocab_size, 2)
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    in_vocab[hot] = True
    return (target, tiny_rows(target.cfg.vocab_size, n=12), target.cfg.default_aux_layer_ids(),
            hot, in_vocab)


def tiny_rows(vocab: int, n: int = 6, seed: int = 0) -> list[dict]:
    """Conversations of random ids with prompts and responses of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p, r = 3 + i % 4, 5 + (3 * i) % 7
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        rows.append({"id": str(i), "prompt_ids": ids[:p], "response_ids": ids[p:]})
    return rows


def test_online_batch_equals_cached_features(tmp_path: Path) -> None:
    """`--online` features (one right-padded batched target forward per step) equal the cached
    path's (one forward per conversation, saved, padded by `collate`): same ids, scored
    positions and target argmax, and the same aux / final hidden states."""
    from eagle_engine.train.features import extract, load_samples
    from eagle_engine.train.online import online_batch
    from eagle_engine.train.trainer import collate

    target = load_target(make_hf_target(tmp_path / "t"), torch.float32, "cpu", 256)
    rows = tiny_rows(target.cfg.vocab_size)
    aux_ids = target.cfg.default_aux_layer_ids()
    samples = load_samples(extract(target, rows, aux_ids, tmp_path / "features"))
    in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    in_vocab[::2] = True  # half the vocabulary: some positions are not scored
    group = [4, 0, 5, 2]
    cached = collate(samples, group, in_vocab)
    online = online_batch(target, rows, group, aux_ids, in_vocab)
    assert torch.equal(online.ids, cached.ids)
    assert torch.equal(online.valid, cached.valid) and online.valid.any()
    real = cached.ids != 0
    assert torch.equal(online.argmax[real], cached.argmax[real])
    for new, old in ((online.aux, cached.aux), (online.final, cached.final)):  # cache: bf16
        torch.testing.assert_close(new[real].to(old.dtype), old[real])


@pytest.mark.parametrize("variant", ["plain", "recipes+holdout"])
def test_interrupted_multi_head_training_resumes_to_the_same_weights(
        tmp_path: Path, monkeypatch, variant: str) -> None:  # noqa: ANN001 - pytest.MonkeyPatch
    """Two heads (aux on / off) trained on the same online batches: a run stopped by its
    deadline after 3 steps and resumed from its checkpoint ends with exactly the weights of an
    uninterrupted run. With recipes (feature noise, TV, nomask, normout) and held-out
    evaluation every 2 steps, the held-out scores and best steps are the same too, and the
    weights compared are the best ones: a head whose best step (2) lies before the cut keeps
    it through the checkpoint."""
    from eagle_engine.config import ConfigError
    from eagle_engine.train import trainer
    from eagle_engine.train.online import online_batch
    from eagle_engine.train.pipeline import draft_config

    target, rows, aux_ids, hot, in_vocab = tiny_training_data(tmp_path)
    recipes = variant == "recipes+holdout"
    # an lr so high that the held-out accuracy peaks early
    extra = {"holdout": 3, "eval_every": 2, "lr": 0.03} if recipes else {}
    params = trainer.TrainParams(epochs=2, ttt_length=3, tokens_per_batch=64, warmup_steps=2,
                                 **extra)
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    options = {"aux": (Recipe(tv_weight=0.5, feature_noise=0.2), True),
               "noaux": (Recipe(mask_outside_vocab=False), False)} if recipes else {}

    def heads() -> list[trainer.Head]:
        out = []
        for name, aux in (("aux", True), ("noaux", False)):
            recipe, norm_output = options.get(name, (Recipe(), False))
            torch.manual_seed(0)
            model = Eagle3Draft(draft_config(target.cfg, 1, aux, hot.numel(),
                                             norm_output=norm_output), 256)
            init_head(model, target, hot, None)
            model.share_embedding(target.embed_tokens)
            model.embed_tokens.weight.requires_grad_(False)
            out.append(trainer.new_head(name, model, target.lm_head.weight.detach(), params,
                                        recipe))
        return out

    def make_batch(group: list[int]) -> trainer.Batch:
        return online_batch(target, rows, group, aux_ids, in_vocab)

    whole = heads()
    assert trainer.train(whole, lengths, make_batch, tmp_path / "whole", params)
    total = len(whole[0].log)
    assert total > 3
    evaluated = sorted({*range(2, total + 1, 2), total}) if recipes else []
    for h in whole:
        assert [r["step"] for r in h.log if "heldout_score" in r] == evaluated
    assert min(h.best_step for h in whole) == (2 if recipes else 0)

    def assert_resumes_to(whole: list[trainer.Head], run: str) -> None:
        """Resuming `run` completes the schedule with exactly the uninterrupted weights."""
        resumed = heads()
        assert trainer.train(resumed, lengths, make_batch, tmp_path / run, params)
        assert [r["step"] for r in resumed[0].log] == list(range(1, total + 1))
        for a, b in zip(whole, resumed):
            assert b.best_step == a.best_step
            assert [r.get("heldout_acc") for r in b.log] == [r.get("heldout_acc") for r in a.log]
            for (name, p), q in zip(a.model.state_dict().items(),
                                    b.model.state_dict().values()):
                assert torch.equal(p, q), name

    clock = iter([-1.0] * 3 + [1.0] * 1000)  # the deadline (0) passes after 3 steps
    monkeypatch.setattr(trainer.time, "time", lambda: next(clock))
    cut = heads()
    assert not trainer.train(cut, lengths, make_batch, tmp_path / "cut", params, deadline=0.0)
    assert len(cut[0].log) == 3
    saved = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["heads"]
    assert [saved[h.name].get("best_step") for h in cut] == \
        [2 if recipes else None] * 2
    # the target's frozen embedding is not the head's to save
    assert not any(k.startswith("embed_tokens") for h in cut for k in saved[h.name]["model"])
    monkeypatch.undo()
    assert_resumes_to(whole, "cut")
    assert whole[0].log[-1]["loss"] != whole[1].log[-1]["loss"]  # two different heads

    # stopped before its first step (the deadline passed while generating): a checkpoint and no
    # log yet; the schedule is still to be fitted to --max-minutes on resume
    timed = dataclasses.replace(params, max_minutes=60.0)
    early = heads()
    assert not trainer.train(early, lengths, make_batch, tmp_path / "early", timed, deadline=0.0)
    assert early[0].log == []
    saved = torch.load(tmp_path / "early" / "checkpoint.pt", weights_only=True)
    assert saved["budget_set"] is False
    assert_resumes_to(whole, "early")

    other = heads()[:1]
    other[0].name = "other"
    with pytest.raises(ConfigError, match=r"no state for heads \['other'\]"):
        trainer.train(other, lengths, make_batch, tmp_path / "cut", params)


def test_head_specs_name_bad_items(tmp_path: Path) -> None:
    from eagle_engine.config import ConfigError
    from eagle_engine.train.pipeline import head_specs

    def specs(heads: str) -> list:
        return head_specs(argparse.Namespace(heads=heads, out=tmp_path, num_layers=1,
                                             no_aux=False))

    assert [(s.out.name, s.num_layers, s.use_aux, s.fc_norm, s.norm_output, s.recipe)
            for s in specs("a:1:aux,b:2:noaux:nomask,c:1:auxnorm:tv=0.5+noise=0.1+normout")
            ] == [("a", 1, True, False, False, Recipe()),
                  ("b", 2, False, False, False, Recipe(mask_outside_vocab=False)),
                  ("c", 1, True, True, True, Recipe(tv_weight=0.5, feature_noise=0.1))]
    for bad, words in (("a:1", "'a:1' is not"), ("a:0:aux", "'a:0:aux' is not"),
                       ("a:1:both", "'a:1:both' is not"), ("a:1:aux,a:2:aux", "repeat"),
                       ("a:1:aux:nomask:normout", "'a:1:aux:nomask:normout' is not"),
                       ("a:1:aux:", "'a:1:aux:': unknown option ''"),
                       ("a:1:aux:tv", "unknown option 'tv'"),
                       ("a:1:aux:nomask+mask", "'a:1:aux:nomask+mask': unknown option 'mask'"),
                       ("a:1:aux:tv=x", "option 'tv=x' needs a number >= 0"),
                       ("a:1:aux:noise=-0.1", "option 'noise=-0.1' needs a number"),
                       ("a:1:aux:tv=nan", "option 'tv=nan' needs a number"),
                       ("a:1:aux:tv=1+tv=2", "'a:1:aux:tv=1+tv=2' repeats option 'tv'")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            specs(bad)


def test_holdout_writes_the_best_state_of_a_normout_head(tmp_path: Path) -> None:
    """`--holdout 3 --eval-every 1` with an lr so high that held-out accuracy falls after its
    peak: the held-out conversations enter no training batch, every step logs a held-out score,
    the model `train` leaves (and `save_draft` writes) is the best step's (its held-out score is
    the best, not the last), the card says which step, and the head (`normout`) saved and
    loaded again drafts with `norm_output`."""
    from eagle_engine.models.draft_io import load_draft
    from eagle_engine.train import trainer
    from eagle_engine.train.online import online_batch
    from eagle_engine.train.pipeline import draft_config, head_specs, write_card

    target, rows, aux_ids, hot, in_vocab = tiny_training_data(tmp_path)
    params = trainer.TrainParams(epochs=2, ttt_length=3, tokens_per_batch=64, warmup_steps=2,
                                 lr=0.03, holdout=3, eval_every=1)
    spec, = head_specs(argparse.Namespace(heads="best:1:aux:normout", out=tmp_path))
    torch.manual_seed(0)
    model = Eagle3Draft(draft_config(target.cfg, 1, True, hot.numel(), spec.fc_norm,
                                     spec.norm_output), 256)
    init_head(model, target, hot, None)
    model.share_embedding(target.embed_tokens)
    model.embed_tokens.weight.requires_grad_(False)
    head = trainer.new_head("best", model, target.lm_head.weight.detach(), params, spec.recipe)
    groups = []

    def make_batch(group: list[int]) -> trainer.Batch:
        groups.append(group)
        return online_batch(target, rows, group, aux_ids, in_vocab)

    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    assert trainer.train([head], lengths, make_batch, tmp_path / "run", params)
    held = set(groups[0])  # the held-out batch is built first (3 short rows: one batch)
    assert len(held) == 3 and not held & {i for g in groups[1:] for i in g}
    scores = [r["heldout_score"] for r in head.log]
    assert len(scores) == len(head.log) > 2
    assert head.best_step == 1 + scores.index(max(scores)) < len(scores)
    assert scores[-1] < max(scores)
    held_batches = [make_batch(sorted(held))]
    accs = trainer.step_accuracy(head.model, held_batches, head.target_head, params)
    assert accs == head.log[head.best_step - 1]["heldout_acc"]

    save_draft(head.model, target.cfg, spec.out, 256, dtype=torch.float32)
    assert json.loads((spec.out / "config.json").read_text())["norm_output"] is True
    loaded = load_draft(spec.out, target.cfg, target.embed_tokens, target.lm_head, 256,
                        torch.float32)
    assert loaded.cfg.norm_output
    for name, t in trainer.head_state(head.model).items():
        assert torch.equal(loaded.state_dict()[name], t), name
    args = argparse.Namespace(prompts=[DATA], draft_vocab=48, tokens_per_batch=64, epochs=2,
                              max_minutes=None, ttt_length=3, lr=0.03, online=True,
                              device="cpu", holdout=3, eval_every=1)
    write_card(args, spec, head.log, {}, rows, 1.0, head.best_step)
    card = (spec.out / "README.md").read_text()
    assert f"weights of step {head.best_step} of {len(scores)}" in card
    assert "recycled hidden normed (norm_output)" in card


def test_auxnorm_head_normalizes_each_aux_chunk_before_fc() -> None:
    """`auxnorm` heads get config `fc_norm` and one RMSNorm per aux chunk: rescaling one chunk
    then leaves the projected draft input `fc(...)` unchanged, unlike a plain aux head (saving
    and loading `fc_norm.{j}` is tested in test_draft_io.py)."""
    from types import SimpleNamespace

    from eagle_engine.train.pipeline import draft_config

    t = SimpleNamespace(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=96)
    feats = torch.randn(1, 3, 3 * 32)
    scaled = feats.clone()
    scaled[..., 32:64] *= 1000  # a massive-activation layer
    for fc_norm in (False, True):
        torch.manual_seed(0)
        cfg = draft_config(t, 1, True, 48, fc_norm)
        assert cfg.fc_norm is fc_norm
        model = Eagle3Draft(cfg, 64).float()
        assert hasattr(model, "fc_norm") is fc_norm
        same = torch.allclose(model.project(feats), model.project(scaled), atol=1e-5)
        assert same is fc_norm


def test_samples_per_source_can_leave_a_source_out() -> None:
    from eagle_engine.config import ConfigError
    from eagle_engine.train.data import answer_ids
    from eagle_engine.train.pipeline import samples_by_source

    def table(spec: str):  # noqa: ANN202
        return samples_by_source(argparse.Namespace(samples_per_source=spec,
                                                    samples_per_prompt=2))

    samples = table("evalset=0,chat=3")
    prompts = [{"id": "e", "source": "evalset"}, {"id": "c", "source": "chat"},
               {"id": "m", "source": "math"}]
    assert answer_ids(prompts, samples) == ["c", "c#1", "c#2", "m", "m#1"]
    for bad in ("evalset", "=2", "chat=-1", "chat=x"):
        with pytest.raises(ConfigError, match=f"item {bad!r} is not SOURCE=N"):
            table(bad)


def test_select_prompts_caps_sources_only_in_a_mixed_file(tmp_path: Path) -> None:
    """Several sources: none takes more than `max_share` of the prompts. One source (a corpus
    such as `data/corpus/build.py` writes, gzipped): every prompt up to `limit`."""
    from eagle_engine.train.data import select_prompts

    mixed = select_prompts(DATA, 6, seed=0, max_share=0.35)
    assert max(Counter(r["source"] for r in mixed).values()) <= 2  # int(6 * 0.35)
    rows = [{"id": f"c{i}", "source": "chat", "turns": [f"question {i}?"]} for i in range(10)]
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    chosen = select_prompts(path, 7, seed=0, max_share=0.35)
    assert len(chosen) == 7 and len({r["id"] for r in chosen}) == 7
    assert sorted(r["id"] for r in select_prompts(path, 50, seed=0)) == sorted(
        r["id"] for r in rows)


def test_teacher_forced_rows_score_the_conversations_own_text(tmp_path: Path) -> None:
    """`teacher_rows` cuts each conversation into its first prompt and the rest of its own text
    (the template's ids), skips conversations whose first turn is too long, and `train
    --teacher-forced --no-generate` trains on them alone, generating nothing."""
    import gzip

    from eagle_engine.chat import encode_chat
    from eagle_engine.train.data import teacher_rows

    convs = [{"id": f"c{i}", "source": "sharegpt",
              "messages": [{"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": "ok" * (i + 1)},
                           {"role": "user", "content": "more"}]} for i in range(4)]
    convs.append({"id": "long", "source": "sharegpt",
                  "messages": [{"role": "user", "content": "x" * 30},
                               {"role": "assistant", "content": "y"}]})
    path = tmp_path / "convs.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(c) + "\n" for c in convs).encode()))
    tok = ByteTokenizer()
    rows = teacher_rows(path, tok, limit=10, seed=0, max_prompt_tokens=25)
    assert sorted(r["id"] for r in rows) == ["c0", "c1", "c2", "c3"]
    for r in rows:
        msgs = next(c["messages"] for c in convs if c["id"] == r["id"])
        whole = encode_chat(tok, msgs, generation_prompt=False)
        assert r["prompt_ids"] == encode_chat(tok, msgs[:1])
        assert r["prompt_ids"] + r["response_ids"] == whole
        assert r["temperature"] is None
    assert len(teacher_rows(path, tok, limit=2, seed=0, max_prompt_tokens=25)) == 2
    work = tmp_path / "work"
    assert main(["train", "--quick", "--prompts", str(DATA), "--out", str(tmp_path / "head"),
                 "--work-dir", str(work), "--teacher-forced", str(path), "--no-generate"]) == 0
    assert not (work / "responses.jsonl").exists()
    assert "| 5 teacher-forced conversations" in (tmp_path / "head" / "README.md").read_text()
    assert main(["train", "--quick", "--prompts", str(DATA), "--out", str(tmp_path / "h2"),
                 "--work-dir", str(tmp_path / "w2"), "--teacher-forced", str(tmp_path / "none"),
                 "--no-generate"]) == 2


@pytest.mark.parametrize("native", [True, False])
def test_training_computes_in_bf16_only_where_it_is_native(tiny_target, monkeypatch,  # noqa: ANN001
                                                           native: bool) -> None:
    """Autocast to bf16 where bf16 products are native, float32 elsewhere (an AVX2-only CPU
    emulates them: a training step took 20x longer); either way a step runs on the bf16 cached
    features and moves the weights."""
    import copy

    from eagle_engine import hardware
    from eagle_engine.train import trainer

    monkeypatch.setattr(hardware, "native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert trainer.train_dtype(cpu) == (torch.bfloat16 if native else torch.float32)
    cast = trainer.autocast(cpu)
    assert cast._enabled is native and (not native or cast.fast_dtype == torch.bfloat16)
    head = random_head(tiny_target.cfg, seed=5, draft_vocab=40)
    batch = loss_batch(tiny_target, head)
    batch.aux, batch.final = batch.aux.to(torch.bfloat16), batch.final.to(torch.bfloat16)
    model = copy.deepcopy(head)
    h = trainer.new_head("h", model, tiny_target.lm_head.weight.detach(), TrainParams())
    assert h.target_head.dtype == trainer.train_dtype(cpu)
    loss, _, _ = trainer.train_step(model, h.opt, h.trainable, batch, h.target_head,
                                    TrainParams(ttt_length=3), 1e-3)
    assert torch.isfinite(loss)
    assert not torch.equal(model.fc.weight, head.fc.weight)


def test_several_prompt_files_and_saved_answer_files(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:  # noqa: ANN001
    """`--prompts` and `--limit` repeat in pairs, and adding a file leaves the prompts drawn from
    the first as they were; several `--responses` files seed one work directory, so nothing is
    generated again, and without `--prompts` every saved answer trains; limits that do not pair
    with the files, a file given twice, and generating without prompts are refused."""
    from eagle_engine.train import data

    corpus = tmp_path / "corpus.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.write("".join(json.dumps({"id": f"c{i}", "source": "chat",
                                    "turns": [f"Say the number {i}."]}) + "\n"
                        for i in range(10)))
    args = ["train", "--quick", "--prompts", str(DATA), "--prompts", str(corpus),
            "--out", str(tmp_path / "head")]
    first = tmp_path / "work1"
    assert main(args + ["--limit", "6", "--limit", "3", "--work-dir", str(first)]) == 0
    rows = [json.loads(x) for x in (first / "responses.jsonl").read_text().splitlines()]
    alone = {r["id"] for r in data.select_prompts(DATA, 6, seed=0)}
    assert {r["id"].split("#")[0] for r in rows if r["source"] != "chat"} == alone
    assert len({r["id"] for r in rows if r["source"] == "chat"}) == 6  # 3 prompts, 2 answers
    card = (tmp_path / "head" / "README.md").read_text()
    assert f"`{DATA.name}` and `{corpus.name}`" in card

    saved_a, saved_b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl"
    saved_a.write_bytes(gzip.compress("".join(
        json.dumps(r) + "\n" for r in rows if r["source"] != "chat").encode()))
    saved_b.write_text("\n".join(json.dumps(r) for r in rows if r["source"] == "chat"))

    def no_generation(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("generated although every answer was saved")

    monkeypatch.setattr(data, "generate_batch", no_generation)
    second = tmp_path / "work2"
    assert main(args + ["--limit", "6", "--limit", "3", "--work-dir", str(second),
                        "--responses", str(saved_a), "--responses", str(saved_b)]) == 0
    copied = (second / "responses.jsonl").read_text().splitlines()
    assert sorted(copied) == sorted((first / "responses.jsonl").read_text().splitlines())
    # no --prompts: every saved answer trains (a machine that has the answers, not the prompts)
    saved = ["--responses", str(saved_a), "--responses", str(saved_b)]
    assert main(["train", "--quick", "--no-generate", *saved, "--out", str(tmp_path / "h5"),
                 "--work-dir", str(tmp_path / "w5")]) == 0
    assert (f"{len(rows)} self-distilled responses saved in `{saved_a.name}` and "
            f"`{saved_b.name}`") in (tmp_path / "h5" / "README.md").read_text()

    capsys.readouterr()
    assert main(args + ["--limit", "6", "--limit", "3", "--limit", "1",
                        "--work-dir", str(tmp_path / "w3")]) == 2
    assert "2 --prompts files but 3 --limit values [6, 3, 1]" in capsys.readouterr().err
    assert main(["train", "--quick", "--prompts", str(corpus), "--prompts", str(corpus),
                 "--out", str(tmp_path / "h4"), "--work-dir", str(tmp_path / "w4")]) == 2
    assert "drawn twice" in capsys.readouterr().err
    assert main(["train", "--quick", *saved, "--out", str(tmp_path / "h6"),
                 "--work-dir", str(tmp_path / "w6")]) == 2  # generating needs prompts
    assert "train needs --prompts FILE" in capsys.readouterr().err
    from eagle_engine.train.pipeline import (
        data_line,  # a resumed run's answers, no file named
    )
    assert data_line(argparse.Namespace(prompts=None, responses=None, teacher_forced=None),
                     rows) == f"{len(rows)} self-distilled responses of the work directory"
