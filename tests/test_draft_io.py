"""Issue 3: EAGLE-3 head checkpoints in every accepted naming convention load into a network
whose outputs are identical to a reference built from the same tensors; bad checkpoints are
refused with messages naming tensors, shapes and values; `save_draft` round-trips; and
`inspect_draft` reports the resolved config of each checkpoint from its files alone."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_engine.config import ConfigError, DraftConfig
from eagle_engine.io_struct import EagleDraftExtendInput, EagleDraftInput
from eagle_engine.kv_cache import causal_mask
from eagle_engine.models.draft_io import (
    draft_config_dict,
    export_state,
    load_draft,
    save_draft,
)
from eagle_engine.models.draft_model import Eagle3Draft
from eagle_engine.models.target import TargetModel
from eagle_engine.tools.inspect_draft import inspect_draft

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LEGACY = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.",
          "fc_norm.2.": "aux_norm_high."}


@dataclass(frozen=True)
class Layout:
    """How a reference head is written to disk."""

    config: dict = field(default_factory=dict)  # DraftConfig.from_dict overrides
    names: str = "standard"  # standard (midlayer.* / layers.{i}.*) | midlayer_i | layers_i
    model_prefix: bool = False
    legacy_aux_norm: bool = False
    sglang_hidden_norm: bool = False  # layers.{i>0}.hidden_norm instead of input_layernorm
    d2t: bool = True
    lm_head: bool = True
    own_embed: bool = False


VARIANTS = {
    "midlayer": Layout(),
    "midlayer_i_2layers_fcnorm_aux2": Layout(
        dict(num_hidden_layers=2, fc_norm=True,
             eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 4]}), names="midlayer_i"),
    "layers_i_3layers_aux4": Layout(
        dict(num_hidden_layers=3, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4, 6]}),
        names="layers_i", sglang_hidden_norm=True),
    "layers_0_model_prefix_fcnorm": Layout(dict(fc_norm=True), names="layers_i",
                                           model_prefix=True),
    "legacy_aux_norm": Layout(dict(fc_norm=True), legacy_aux_norm=True),
    "aux_off": Layout(dict(eagle_config={"use_aux_hidden_state": False})),
    "no_d2t": Layout(d2t=False),
    "no_lm_head_full_vocab": Layout(dict(draft_vocab_size=None), lm_head=False),
    "own_embed_tokens": Layout(own_embed=True),
    "fc_and_attention_bias": Layout(dict(bias=True, attention_bias=True)),
    "llama3_rope": Layout(dict(rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4})),
}


def make_reference(target: TargetModel, layout: Layout, seed: int = 0) -> Eagle3Draft:
    """A random head with random norms/biases; the embedding and (without lm_head in the
    checkpoint) the lm_head are the target's, `d2t` is zero without d2t in the checkpoint."""
    raw = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 96, "draft_vocab_size": 40,
           "rms_norm_eps": 1e-6, **layout.config}
    torch.manual_seed(seed)
    model = Eagle3Draft(DraftConfig.from_dict(raw), 256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
        vd = model.cfg.draft_vocab_size
        if layout.d2t and vd < 96:
            model.d2t.copy_(torch.randperm(96)[:vd].sort().values - torch.arange(vd))
        if not layout.own_embed:
            model.share_embedding(target.embed_tokens)
        if not layout.lm_head:
            model.lm_head.weight.copy_(target.lm_head.weight)
    return model.eval()


def rename(name: str, layout: Layout, num_layers: int) -> str:
    if layout.names == "midlayer_i":
        name = re.sub(r"^midlayer\.(?!\d)", "midlayer.0.", name)
        name = re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", name)
    elif layout.names == "layers_i":
        name = re.sub(r"^midlayer\.", "layers.0.", name)
    if layout.sglang_hidden_norm:
        name = re.sub(r"^layers\.([1-9]\d*)\.input_layernorm\.", r"layers.\1.hidden_norm.", name)
    if layout.legacy_aux_norm:
        for new, old in LEGACY.items():
            name = name.replace(new, old) if name.startswith(new) else name
    if layout.model_prefix and not name.startswith(("lm_head", "d2t", "t2d")):
        name = "model." + name
    return name


def write_checkpoint(ref: Eagle3Draft, target: TargetModel, layout: Layout,
                     directory: Path) -> Path:
    state = export_state(ref)
    if not layout.d2t:
        del state["d2t"], state["t2d"]
    if not layout.lm_head:
        del state["lm_head.weight"]
    state = {rename(k, layout, ref.cfg.num_layers): v for k, v in state.items()}
    cfg = draft_config_dict(ref.cfg, target.cfg, 256)
    if layout.legacy_aux_norm:
        del cfg["fc_norm"]
        cfg["use_aux_norm"] = True
    if not layout.lm_head:
        del cfg["draft_vocab_size"]
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@dataclass
class Case:
    layout: Layout
    ref: Eagle3Draft
    path: Path
    loaded: Eagle3Draft
    names: list[str]


def load(path: Path, target: TargetModel, **kw: object) -> Eagle3Draft:
    return load_draft(path, target.cfg, target.embed_tokens, target.lm_head, 256,
                      torch.float32, **kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request: pytest.FixtureRequest, tiny_target: TargetModel,
         tmp_path_factory: pytest.TempPathFactory) -> Case:
    layout = VARIANTS[request.param]
    ref = make_reference(tiny_target, layout)
    path = write_checkpoint(ref, tiny_target, layout, tmp_path_factory.mktemp(request.param) / "h")
    names = list(load_file(path / "model.safetensors"))
    return Case(layout, ref, path, load(path, tiny_target), names)


def outputs(model: Eagle3Draft, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over 6 tokens with target features, then one recycled-hidden step."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (1, 6), generator=g)
    feats = torch.randn(1, 6, EagleDraftExtendInput.hidden_size_for(model.cfg), generator=g)
    cache = model.new_cache(64)
    logits, hidden = model(ids, feats, torch.arange(6)[None], cache, 0, causal_mask(6, 0, "cpu"),
                           from_target=True)
    step, _ = model(ids[:, :1], hidden[:, -1:], torch.tensor([[6]]), cache, 6, None,
                    from_target=False)
    return torch.cat([logits, step], dim=1), hidden


def test_checkpoint_uses_the_convention(case: Case) -> None:
    layout, names = case.layout, case.names
    layer_names = [n.removeprefix("model.") for n in names if "self_attn" in n]
    prefix = {"standard": "midlayer." if case.ref.cfg.num_layers == 1 else "layers.",
              "midlayer_i": "midlayer.0.", "layers_i": "layers.0."}[layout.names]
    assert all(n.startswith(prefix.split(".")[0] + ".") for n in layer_names)
    assert any(n.startswith(prefix) for n in layer_names)
    assert all(n.startswith("model.") for n in names if "self_attn" in n) == layout.model_prefix
    assert any(n.startswith("aux_norm_") for n in names) == layout.legacy_aux_norm
    assert ("fc.weight" in names or "model.fc.weight" in names) == \
        case.ref.cfg.use_aux_hidden_state
    assert ("d2t" in names) == layout.d2t and ("lm_head.weight" in names) == layout.lm_head


def assert_same_outputs(loaded: Eagle3Draft, ref: Eagle3Draft) -> None:
    """Same logits, recycled hidden states and draft -> target id map as the reference."""
    ref_logits, ref_hidden = outputs(ref)
    logits, hidden = outputs(loaded)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-6, rtol=1e-6)
    assert torch.equal(loaded.hot_ids, ref.hot_ids)


def test_loaded_outputs_equal_reference(case: Case, tiny_target: TargetModel) -> None:
    assert_same_outputs(case.loaded, case.ref)
    # the written config spells out the aux ids the reference resolves from the target
    assert replace(case.loaded.cfg, aux_layer_ids=None) == replace(case.ref.cfg, aux_layer_ids=None)
    assert case.loaded.cfg.resolve_aux_layer_ids(tiny_target.cfg) == \
        case.ref.cfg.resolve_aux_layer_ids(tiny_target.cfg)


def test_embedding_and_head_sources(case: Case, tiny_target: TargetModel) -> None:
    shares_embed = case.loaded.embed_tokens is tiny_target.embed_tokens
    assert shares_embed == (not case.layout.own_embed)
    assert torch.equal(case.loaded.lm_head.weight, case.ref.lm_head.weight)
    if not case.layout.lm_head:
        assert torch.equal(case.loaded.lm_head.weight, tiny_target.lm_head.weight)
        assert case.loaded.cfg.draft_vocab_size == tiny_target.cfg.vocab_size


def report(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines())


def count(text: str) -> int:
    return int(text.replace(",", ""))


def test_inspect_draft_report(case: Case) -> None:
    cfg, model = case.ref.cfg, case.loaded
    r = report(inspect_draft(case.path))
    assert r["layers"] == str(cfg.num_layers)
    assert r["use_aux_hidden_state"] == str(cfg.use_aux_hidden_state).lower()
    assert r["num_aux"] == str(cfg.num_aux if cfg.use_aux_hidden_state else 0)
    assert r["fc_norm"] == str(cfg.fc_norm and cfg.use_aux_hidden_state).lower()
    assert r["vocab"].startswith(f"target 96, draft {cfg.draft_vocab_size} ")
    assert ("identity" in r["vocab"]) == (not case.layout.d2t)
    assert r["lm_head"] == ("in checkpoint" if case.layout.lm_head else "copied from the target")
    assert r["embed_tokens"] == ("in checkpoint" if case.layout.own_embed
                                 else "shared with the target")
    ext_width = r["width EagleDraftExtendInput.hidden_size_for (target features)"]
    assert int(ext_width) == EagleDraftExtendInput.hidden_size_for(cfg)
    dec_width = r["width EagleDraftInput.hidden_size_for (recycled draft hidden)"]
    assert int(dec_width) == EagleDraftInput.hidden_size_for(cfg) == 32
    if cfg.use_aux_hidden_state:
        assert int(ext_width) == 32 * cfg.num_aux
        ids = model.cfg.raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert r["aux layer ids (config, layer outputs)"] == str(ids)
        assert r["aux layer ids (captured target layer inputs)"] == str([i + 1 for i in ids])
    else:
        assert int(ext_width) == 32 and r["aux layer ids"].startswith("none")
    params = dict(model.named_parameters())
    groups = {"fc": ("fc.", "fc_norm."), "layers": ("layers.",), "lm_head": ("lm_head.",)}
    for group, prefixes in groups.items():
        expected = sum(p.numel() for n, p in params.items() if n.startswith(prefixes))
        assert count(r[f"parameters {group}"]) == expected, group
    assert count(r["parameters lm_head"]) == cfg.draft_vocab_size * 32
    total = sum(p.numel() for n, p in params.items() if not n.startswith("embed_tokens."))
    assert count(r["parameters total (excluding embedding)"]) == total
    assert r["ignored tensors"] == "none"
    if case.layout.model_prefix or case.layout.names != "standard":
        assert r["weights"].startswith("model.safetensors (names: ")


def test_inspect_draft_with_target(case: Case, tiny_target: TargetModel,
                                   tiny_target_dir: Path) -> None:
    r = report(inspect_draft(case.path, str(tiny_target_dir)))
    assert r["target"].endswith("(8 layers, hidden 32, vocab 96): compatible")
    if case.ref.cfg.use_aux_hidden_state:
        expected = list(case.ref.cfg.resolve_aux_layer_ids(tiny_target.cfg))
        assert r["aux layer ids (captured target layer inputs)"] == str(expected)


def test_inspect_draft_default_aux_layers(tiny_target: TargetModel, tiny_target_dir: Path,
                                          tmp_path: Path) -> None:
    """A head without aux ids: unknown from the checkpoint alone, (2, 4, 5) on an 8-layer target."""
    ref = make_reference(tiny_target, Layout())
    write_checkpoint(ref, tiny_target, Layout(), tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    alone = report(inspect_draft(tmp_path / "h"))
    assert alone["aux layer ids (config, layer outputs)"] == "not set"
    assert alone["aux layer ids (captured target layer inputs)"].startswith("target default")
    with_target = report(inspect_draft(tmp_path / "h", str(tiny_target_dir)))
    assert with_target["aux layer ids (target default, layer outputs)"] == "[1, 3, 4]"
    assert with_target["aux layer ids (captured target layer inputs)"] == "[2, 4, 5]"


def round_trip(model: Eagle3Draft, tiny_target: TargetModel, directory: Path) -> Eagle3Draft:
    save_draft(model, tiny_target.cfg, directory, 256, dtype=torch.float32)
    return load(directory, tiny_target)


def test_save_load_round_trip(case: Case, tiny_target: TargetModel, tmp_path: Path) -> None:
    if case.layout.own_embed:
        pytest.skip("covered by test_round_trip_keeps_own_embedding")
    again = round_trip(case.loaded, tiny_target, tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == case.ref.cfg.draft_vocab_size
    assert cfg["target_hidden_size"] == 32
    assert cfg["eagle_config"]["use_aux_hidden_state"] == case.ref.cfg.use_aux_hidden_state
    if case.ref.cfg.use_aux_hidden_state:
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert [i + 1 for i in ids] == list(case.ref.cfg.resolve_aux_layer_ids(tiny_target.cfg))
    names = load_file(tmp_path / "saved" / "model.safetensors")
    assert "embed_tokens.weight" not in names and "d2t" in names and "t2d" in names
    assert int(names["t2d"].sum()) == case.ref.cfg.draft_vocab_size
    for a, b in zip(outputs(again), outputs(case.ref)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(again.hot_ids, case.ref.hot_ids)


def test_round_trip_keeps_own_embedding(tiny_target: TargetModel, tmp_path: Path) -> None:
    layout = VARIANTS["own_embed_tokens"]
    path = write_checkpoint(make_reference(tiny_target, layout), tiny_target, layout,
                            tmp_path / "own")
    loaded = load(path, tiny_target)
    again = round_trip(loaded, tiny_target, tmp_path / "saved")
    torch.testing.assert_close(outputs(again)[0], outputs(loaded)[0])


def test_save_bf16_by_default(tiny_target: TargetModel, tmp_path: Path) -> None:
    ref = make_reference(tiny_target, Layout())
    save_draft(ref, tiny_target.cfg, tmp_path / "bf16", 256)
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    logits, _ = outputs(load(tmp_path / "bf16", tiny_target))
    ref_logits, _ = outputs(ref)
    assert (logits - ref_logits).abs().max() < 0.05 * ref_logits.abs().max()


# ---------------------------------------------------------------- bad checkpoints


@pytest.fixture
def good(tiny_target: TargetModel, tmp_path: Path) -> Path:
    return write_checkpoint(make_reference(tiny_target, Layout()), tiny_target, Layout(),
                            tmp_path / "good")


def edit(directory: Path, config: dict | None = None, **tensors: torch.Tensor | None) -> None:
    if config:
        cfg = json.loads((directory / "config.json").read_text())
        cfg.update(config)
        (directory / "config.json").write_text(json.dumps(cfg))
    state = load_file(directory / "model.safetensors")
    for name, t in tensors.items():
        name = name.replace("__", ".")
        if t is None:
            del state[name]
        else:
            state[name] = t
    save_file(state, str(directory / "model.safetensors"))


def error(directory: Path, tiny_target: TargetModel, **kw: object) -> str:
    with pytest.raises(ConfigError) as e:
        load(directory, tiny_target, **kw)
    with pytest.raises(ConfigError) as inspected:  # inspect-draft refuses the same files
        inspect_draft(directory, allow_pickle=bool(kw.get("allow_pickle")))
    assert type(inspected.value) is ConfigError
    return str(e.value)


def test_pickle_needs_opt_in(good: Path, tiny_target: TargetModel) -> None:
    state = load_file(good / "model.safetensors")
    (good / "model.safetensors").unlink()
    torch.save(state, good / "pytorch_model.bin")
    msg = error(good, tiny_target)
    assert "pytorch_model.bin" in msg and "allow_pickle" in msg and str(good) in msg
    loaded = load(good, tiny_target, allow_pickle=True)
    assert report(inspect_draft(good, allow_pickle=True))["weights"].startswith("pytorch_model.bin")
    torch.testing.assert_close(outputs(loaded)[0], outputs(load(good.parent / "good", tiny_target,
                                                                allow_pickle=True))[0])


def test_no_weights(good: Path, tiny_target: TargetModel) -> None:
    (good / "model.safetensors").unlink()
    assert "no model.safetensors or pytorch_model.bin" in error(good, tiny_target)


def test_shape_mismatch_names_tensor_and_shapes(good: Path, tiny_target: TargetModel) -> None:
    edit(good, fc__weight=torch.zeros(32, 95))
    msg = error(good, tiny_target)
    assert "fc.weight" in msg and "(32, 95)" in msg and "(32, 96)" in msg


def test_lm_head_rows_must_match_draft_vocab(good: Path, tiny_target: TargetModel) -> None:
    edit(good, lm_head__weight=torch.zeros(41, 32))
    msg = error(good, tiny_target)
    assert "lm_head.weight" in msg and "(41, 32)" in msg and "(40, 32)" in msg


def test_unfusable_projection_widths(good: Path, tiny_target: TargetModel) -> None:
    edit(good, midlayer__self_attn__v_proj__weight=torch.zeros(16, 32))
    msg = error(good, tiny_target)
    assert "layers.0.self_attn.v_proj.weight (16, 32)" in msg
    assert "layers.0.self_attn.q_proj.weight (32, 64)" in msg


def test_missing_tensors_are_listed(good: Path, tiny_target: TargetModel) -> None:
    edit(good, norm__weight=None, midlayer__mlp__down_proj__weight=None)
    msg = error(good, tiny_target)
    assert "missing tensors" in msg
    assert "'norm.weight'" in msg and "'layers.0.mlp.down_proj.weight'" in msg


def test_missing_k_proj(good: Path, tiny_target: TargetModel) -> None:
    edit(good, midlayer__self_attn__k_proj__weight=None)
    assert "k_proj/v_proj missing" in error(good, tiny_target)


def test_unknown_tensors_warn(good: Path, tiny_target: TargetModel,
                              caplog: pytest.LogCaptureFixture) -> None:
    edit(good, **{"extra__scale": torch.ones(3), "midlayer__self_attn__rotary__inv": torch.ones(4)})
    with caplog.at_level(logging.WARNING, logger="eagle_engine.models.draft_io"):
        load(good, tiny_target)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "extra.scale" in warnings[0] and "layers.0.self_attn.rotary.inv" in warnings[0]
    ignored = report(inspect_draft(good))["ignored tensors"]
    assert ignored == "extra.scale, layers.0.self_attn.rotary.inv"


@pytest.mark.parametrize("config, named", [
    (dict(vocab_size=100), ["vocab_size 100", "96"]),
    (dict(draft_vocab_size=120), ["draft_vocab_size 120", "vocab_size 96"]),
    (dict(target_hidden_size=48), ["target_hidden_size 48", "hidden_size 32"]),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9, 3]}), ["[10]", "8-layer"]),
    (dict(num_aux_hidden_states=2), ["num_aux_hidden_states=2", "3 entries"]),
])
def test_head_not_fitting_target(good: Path, tiny_target: TargetModel, tiny_target_dir: Path,
                                 config: dict, named: list[str]) -> None:
    edit(good, config=config)
    with pytest.raises(ConfigError) as e:
        load(good, tiny_target)
    assert all(n in str(e.value) for n in named), str(e.value)
    with pytest.raises(ConfigError):
        inspect_draft(good, str(tiny_target_dir))


def test_aux_off_needs_target_width(good: Path, tiny_target: TargetModel) -> None:
    edit(good, config=dict(hidden_size=48, target_hidden_size=32,
                           eagle_config={"use_aux_hidden_state": False}))
    with pytest.raises(ConfigError, match="48 vs 32"):
        load(good, tiny_target)


def test_no_lm_head_needs_full_vocab(good: Path, tiny_target: TargetModel) -> None:
    edit(good, lm_head__weight=None)
    msg = error(good, tiny_target)
    assert "no lm_head.weight" in msg and "draft_vocab_size 40" in msg and "96" in msg


def test_d2t_out_of_range(good: Path, tiny_target: TargetModel) -> None:
    edit(good, d2t=torch.full((40,), 60, dtype=torch.long))
    with pytest.raises(ConfigError, match="d2t maps draft ids outside the target vocab"):
        load(good, tiny_target)
