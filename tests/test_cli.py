"""Issues 2 and 3 through the command line (`eagle_engine.tools.cli.main`): bad input exits with
code 2 and one `error: ...` line naming the value; `generate` on the bundled SmolLM2 gives the
same greedy tokens with and without speculation; `inspect-draft` prints a head's resolved
config."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_engine.config import TargetConfig, TreeParams
from eagle_engine.engine import ASSETS, DEFAULT_HEAD
from eagle_engine.models.loader import read_config
from eagle_engine.models.target import TargetModel
from eagle_engine.tools import bench
from eagle_engine.tools.autotune import tree_label
from eagle_engine.tools.cli import main
from tests.helpers import random_head, save_head, tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI, expect exit code 2 and one `error:` line, last on stderr (after at most
    `[startup]`-style progress lines); -> that line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in "".join(lines)
    assert all(line.startswith("[") for line in lines[:-1])
    return lines[-1]


@pytest.mark.parametrize("args, named", [
    (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer, got 0"),
    (["--max-new-tokens", "-5"], "got -5"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "-1"], "got -1.0"),
    (["--top-p", "0.5"], "top_p=0.5"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--topk", "2", "--num-steps", "2", "--num-draft-tokens", "10"],
     "num_draft_tokens=10 exceeds what topk=2, num_steps=2 can hold: at most 7"),
    (["--max-len", "8"], "max_len must be >= 16, got 8"),
])
def test_generate_bad_arguments(capsys: pytest.CaptureFixture[str], args: list[str],
                                named: str) -> None:
    assert named in fails(["generate", "--prompt", "hi", *args], capsys)


def test_generate_missing_target(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    err = fails(["generate", "--prompt", "hi", "--no-spec", "--target", str(missing)], capsys)
    assert str(missing) in err


def test_generate_target_without_tokenizer(capsys: pytest.CaptureFixture[str],
                                           tiny_target_dir: Path) -> None:
    err = fails(["generate", "--prompt", "hi", "--no-spec", "--target", str(tiny_target_dir),
                 "--dtype", "fp32", "--max-len", "64"], capsys)
    assert str(tiny_target_dir) in err and "tokenizer" in err


def test_generate_malformed_target_config(capsys: pytest.CaptureFixture[str],
                                          tiny_target_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tiny_target_dir, tmp_path / "broken"))
    (broken / "config.json").write_text("{not json")
    err = fails(["generate", "--prompt", "hi", "--no-spec", "--target", str(broken)], capsys)
    assert "malformed JSON" in err and str(broken / "config.json") in err


def test_generate_prompt_longer_than_context(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["generate", "--prompt", "word " * 40, "--no-spec", "--max-len", "32",
                 "--dtype", "fp32"], capsys)
    assert "context window is 32" in err and "tokens" in err


@pytest.fixture(scope="module")
def bundled_head(bundled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random head for SmolLM2 (3 aux states, reduced draft vocab of 2000)."""
    cfg = TargetConfig.from_dict(read_config(bundled_dir))
    return save_head(random_head(cfg, draft_vocab=2000), cfg,
                     tmp_path_factory.mktemp("smol_head") / "head")


def generate_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def test_generate_speculative_equals_baseline(capsys: pytest.CaptureFixture[str],
                                              bundled_head: Path) -> None:
    common = ["generate", "--prompt", "Name three colors.", "--max-new-tokens", "12",
              "--dtype", "fp32", "--max-len", "256", "--json"]
    base = generate_json([*common, "--no-spec"], capsys)
    spec = generate_json([*common, "--draft", str(bundled_head), "--topk", "4", "--num-steps",
                          "3", "--num-draft-tokens", "12"], capsys)
    assert base["mode"] == "ar" and spec["mode"] == "eagle" and spec["head"] == "head"
    assert len(base["token_ids"]) == base["num_tokens"] > 0
    assert base["prompt_tokens"] == spec["prompt_tokens"] > 3  # the chat template's tokens too
    assert 0 < base["prefill_s"] < 60 and 0 < spec["prefill_s"] < 60
    assert spec["token_ids"] == base["token_ids"] and spec["text"] == base["text"]
    assert spec["finished"] == base["finished"]


def test_inspect_draft_cli(capsys: pytest.CaptureFixture[str], tiny_target: TargetModel,
                           tiny_target_dir: Path, tmp_path: Path) -> None:
    head = save_head(random_head(tiny_target.cfg, num_layers=2, num_aux=2, draft_vocab=30),
                     tiny_target.cfg, tmp_path / "head")
    assert main(["inspect-draft", str(head)]) == 0
    out = capsys.readouterr().out
    assert "layers: 2\n" in out and "num_aux: 2\n" in out
    assert "aux layer ids (config, layer outputs): [1, 2]" in out
    assert "aux layer ids (captured target layer inputs): [2, 3]" in out
    assert "vocab: target 96, draft 30 (d2t: in checkpoint)" in out
    assert "width EagleDraftExtendInput.hidden_size_for (target features): 64" in out
    assert main(["inspect-draft", str(head), "--target", str(tiny_target_dir)]) == 0
    assert "compatible" in capsys.readouterr().out
    err = fails(["inspect-draft", str(head), "--target", "bundled"], capsys)
    assert "vocab_size 96" in err and "49152" in err


def test_inspect_draft_cli_bundled_name(capsys: pytest.CaptureFixture[str]) -> None:
    """A bundled head by the name the app shows, as `bench --heads` and `eval-head` take it."""
    assert main(["inspect-draft", DEFAULT_HEAD]) == 0
    assert f"EAGLE-3 draft head: {ASSETS / DEFAULT_HEAD}\n" in capsys.readouterr().out
    assert "neither a directory nor a hub id" in fails(["inspect-draft", "no-such-head"], capsys)


def test_inspect_draft_cli_errors(capsys: pytest.CaptureFixture[str], tiny_target: TargetModel,
                                  tmp_path: Path) -> None:
    assert str(tmp_path / "missing") in fails(["inspect-draft", str(tmp_path / "missing")],
                                              capsys)
    head = save_head(random_head(tiny_target.cfg), tiny_target.cfg, tmp_path / "head")
    torch.save(load_file(head / "model.safetensors"), head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()
    assert "--allow-pickle" in fails(["inspect-draft", str(head)], capsys)
    assert main(["inspect-draft", str(head), "--allow-pickle"]) == 0
    assert "weights: pytorch_model.bin" in capsys.readouterr().out


def test_bench_reports_modes_and_runs_turns_as_conversations(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`bench` on the bundled target and default head: both modes see every turn (a 2-turn row
    counts 2 answers), fp32 greedy speculation equals the baseline, tau and per-depth acceptance
    agree with each other, and the speedup is the ratio of the two measured speeds."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Name a color.", "And another?"]}) + "\n"
                       + json.dumps({"id": "b", "turns": ["What is 2 plus 2?"]}) + "\n")
    out = tmp_path / "r.json"
    assert main(["bench", "--prompts", str(prompts), "--max-new-tokens", "8", "--dtype", "fp32",
                 "--max-len", "512", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ar = report["modes"]["ar"]
    # the default tree: the static one, or the one `tune` cached on this machine (the app's
    # first start in the browser tests tunes, and picks another tree now and then)
    [eagle] = [m for label, m in report["modes"].items()
               if label.startswith("eagle[eagle3-aux-1layer ")]
    assert "greedy_same_as_baseline" not in ar and eagle["greedy_same_as_baseline"] == "3/3"
    assert ar["tokens"] == eagle["tokens"] > 0
    assert eagle["tau"] == pytest.approx(1 + sum(eagle["acceptance_per_depth"]), abs=2e-3)
    assert eagle["speedup_vs_ar"] == pytest.approx(
        eagle["tokens_per_s"] / ar["tokens_per_s"], abs=2e-3)
    assert main(["bench", "--prompts", str(prompts), "--limit", "1", "--first-turn-only",
                 "--max-new-tokens", "6", "--modes", "eagle", "--temperature", "0.8",
                 "--top-p", "0.9", "--seed", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sampling"]["temperature"] == 0.8 and report["rows"] == 1
    assert [m["tokens"] for m in report["modes"].values()] == [6]
    assert all("greedy_same_as_baseline" not in m for m in report["modes"].values())  # no ar
    capsys.readouterr()
    assert "unknown modes ['fast']" in fails(["bench", "--prompts", str(prompts), "--modes",
                                              "ar,fast"], capsys)
    assert "needs --weights dense" in fails(["bench", "--prompts", str(prompts), "--weights",
                                             "q4", "--dtype", "bf16"], capsys)
    copy = shutil.copytree(ASSETS / "eagle3-aux-1layer", tmp_path / "my-head")
    assert main(["bench", "--prompts", str(prompts), "--limit", "1", "--first-turn-only",
                 "--max-new-tokens", "6", "--modes", "ar,eagle", "--dtype", "fp32",
                 "--max-len", "512", "--heads", f"{copy},eagle3-noaux-1layer",
                 "--json", str(out)]) == 0  # a head directory beside a bundled head name
    modes = json.loads(out.read_text())["modes"]
    assert [k.split(" ")[0] for k in modes] == ["ar", "eagle[my-head", "eagle[eagle3-noaux-1layer"]
    assert all(m["greedy_same_as_baseline"] == "1/1" for m in list(modes.values())[1:])
    capsys.readouterr()
    twin = shutil.copytree(copy, tmp_path / "x" / "my-head")
    assert "names two heads alike" in fails(
        ["bench", "--prompts", str(prompts), "--heads", f"{copy},{twin}"], capsys)


def test_bench_other_weights_run_beside_the_main_target(tmp_path: Path) -> None:
    """`--other-weights-trees`: a dense fp32 copy of the q4 target runs its baseline and EAGLE-3
    in the same rounds; its greedy speculation is compared with its own baseline and its
    speedup with its own baseline too."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Name a color."]}) + "\n")
    out = tmp_path / "r.json"
    assert main(["bench", "--prompts", str(prompts), "--max-new-tokens", "6", "--dtype", "fp32",
                 "--max-len", "512", "--other-weights-trees", "k=4,s=3,n=4;k=2,s=3,n=4",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert report["weights"] == "q4"
    labels = [f"eagle fp32[eagle3-aux-1layer {tree_label(TreeParams(*t))}]"
              for t in ((4, 3, 4), (2, 3, 4))]
    assert list(modes)[2:] == ["ar fp32", *labels]
    assert modes["ar fp32"]["tokens"] == modes["ar"]["tokens"] == 6
    for label in labels:
        assert modes[label]["greedy_same_as_baseline"] == "1/1"
        assert modes[label]["speedup_vs_own_ar"] == pytest.approx(
            modes[label]["tokens_per_s"] / modes["ar fp32"]["tokens_per_s"], abs=2e-3)


def test_measure_costs_is_a_ratio_of_interleaved_medians(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --costs` arithmetic, on a fake clock: a target forward of N tokens takes N ms and a
    draft step of K tokens 0.1*K ms, except for one slow spell (+50 ms) that hits every shape of
    one round; the medians ignore it and the ratios come out exact."""
    engine = tiny_engine(tmp_path, max_len=512)
    clock = {"now": 0.0, "calls": 0}

    def tick(ms: float) -> None:
        clock["calls"] += 1
        clock["now"] += ms / 1000 + (0.05 if 40 <= clock["calls"] < 49 else 0.0)

    def fake_target(ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        tick(ids.shape[1])

    def fake_draft(ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        tick(0.1 * ids.shape[1])

    monkeypatch.setattr(engine.target, "forward", fake_target)
    monkeypatch.setattr(engine.heads["head"], "forward", fake_draft)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["now"])
    costs = bench.measure_costs(engine, "head", repeats=5, warmup=1)
    assert clock["calls"] == 6 * 10  # (1 + 5) rounds of 7 target and 3 draft shapes
    assert costs["target_1_token_ms"] == pytest.approx(1.0)
    assert costs["verify_cost_vs_1_token"] == {4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0,
                                                 48: 48.0, 64: 64.0}
    assert costs["draft_step_cost_vs_target_token"] == {1: 0.1, 4: 0.4, 8: 0.8}


def test_pick_head_names_heads_as_the_engine_does(tmp_path: Path) -> None:
    """A head directory (trailing slash or not) is found by its name, a hub id by the id itself
    (not its last path part), a bundled name by itself; a head that is not loaded is an error."""
    from types import SimpleNamespace

    from eagle_engine.config import ConfigError
    from eagle_engine.tools.cli_args import pick_head

    (tmp_path / "my-head").mkdir()
    engine = SimpleNamespace(heads={"my-head": 0, "owner/hub-head": 1, "eagle3-noaux-1layer": 2})
    assert pick_head(engine, f"{tmp_path}/my-head/") == "my-head"
    assert pick_head(engine, "owner/hub-head") == "owner/hub-head"
    assert pick_head(engine, "eagle3-noaux-1layer") == "eagle3-noaux-1layer"
    with pytest.raises(ConfigError, match=r"draft head 'owner/other' is not loaded"):
        pick_head(engine, "owner/other")


def test_tree_flags_fill_in_from_the_weights_default_tree() -> None:
    """Tree flags not given come from `EngineConfig.default_tree`: 8 tree tokens for dense
    targets, 5 with q4 weights; flags given always win."""
    from types import SimpleNamespace

    from eagle_engine.config import Q4_TREE as q4
    from eagle_engine.config import EngineConfig
    from eagle_engine.tools.cli_args import tree_params

    args = SimpleNamespace(topk=None, num_steps=None, num_draft_tokens=None,
                           context_drafts=None, min_score=None, context_extra=None,
                           step_cut=None)
    assert tree_params(args, EngineConfig(weights="dense").default_tree) == TreeParams()
    assert tree_params(args, EngineConfig(weights="q4").default_tree) == q4
    assert q4.min_score > 0 and TreeParams().min_score == 0
    assert q4.context_extra > 0 and TreeParams().context_extra == 0
    assert q4.step_cut > 0 and TreeParams().step_cut == 0
    args.num_draft_tokens, args.topk = 3, 2
    assert tree_params(args, EngineConfig(weights="q4").default_tree) == TreeParams(
        2, q4.num_steps, 3, min_score=q4.min_score, context_extra=q4.context_extra,
        step_cut=q4.step_cut)
    args.context_extra = 0
    assert tree_params(args, EngineConfig(weights="q4").default_tree).context_extra == 0
    from eagle_engine.tools.cli import build_parser

    for cmd in (["generate", "--prompt", "x"], ["bench", "--prompts", "p.jsonl"]):
        for flags, want in (([], None), (["--context-drafts"], True),
                            (["--no-context-drafts"], False)):
            parsed = build_parser().parse_args(cmd + flags)
            assert parsed.context_drafts is want
            if want is not None:
                assert tree_params(parsed, q4) == replace(q4, context_drafts=want)
        parsed = build_parser().parse_args(cmd + ["--min-score", "0.25"])
        assert tree_params(parsed, q4) == replace(q4, min_score=0.25)
        parsed = build_parser().parse_args(cmd + ["--step-cut", "0"])
        assert tree_params(parsed, q4) == replace(q4, step_cut=0.0)


def test_q4_default_tree_is_tunes_first_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """q4's static default is k3 s2 n5 with a cut, a sure chain from the context past it and
    a step cut on every CPU class (VNNI or AVX2 products), the first of `tune`'s candidates,
    with the one-step trees k3 s1 n4 and k2 s1 n3 among the others; dense targets keep
    `TreeParams()`."""
    from eagle_engine import config, hardware
    from eagle_engine.tools import autotune

    assert config.Q4_TREE == TreeParams(3, 2, 5, min_score=0.1, context_extra=8, step_cut=0.5)
    assert autotune.CANDIDATES["q4"][0] == config.Q4_TREE
    assert {TreeParams(3, 1, 4, min_score=0.05, context_extra=8),
            TreeParams(2, 1, 3, min_score=0.05, context_extra=8)} <= set(autotune.CANDIDATES["q4"])
    for flags in (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                  ("avx2", "fma", "f16c")):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: flags)
        assert config.EngineConfig(weights="q4").default_tree == config.Q4_TREE
        assert config.EngineConfig(weights="dense").default_tree == TreeParams()


def test_sweep_trees_are_named_fields() -> None:
    from eagle_engine.config import ConfigError
    from eagle_engine.tools.bench import parse_sweep

    assert parse_sweep("k=4,s=3,n=8;n=3,k=2,s=1,cut=0.2") == [
        TreeParams(4, 3, 8), TreeParams(2, 1, 3, min_score=0.2)]
    # one run can hold a tree with and without drafts from the context; trees that do not name
    # `ctx` follow the run's own setting
    on, off = (TreeParams(2, 1, 3, context_drafts=c, min_score=0.05) for c in (True, False))
    assert parse_sweep("k=2,s=1,n=3,cut=0.05,ctx=on;k=2,s=1,n=3,cut=0.05,ctx=off;"
                       "k=2,s=1,n=3,cut=0.05", False) == [on, off, off]
    assert parse_sweep("k=2,s=1,n=3,cut=0.05,ctx=off;k=2,s=1,n=3,cut=0.05", True) == [off, on]
    # the field names themselves work too, and every tree reads back from its spec
    tree = TreeParams(3, 2, 5, min_score=0.1, context_extra=8, step_cut=0.5)
    assert parse_sweep("topk=3,num_steps=2,num_draft_tokens=5,min_score=0.1,context_extra=8,"
                       "step_cut=0.5,context_drafts=on") == [tree]
    assert tree.spec() == "k=3,s=2,n=5,cut=0.1,extra=8,step=0.5,ctx=on"
    assert TreeParams.parse(tree.spec()) == tree
    for bad, why in (("k=4,s=3,x", "'x' in 'k=4,s=3,x' is not one"), ("4,3,8", "is not one"),
                     ("k=4,s=3,n=8,step=1.5", "step_cut must be"),
                     ("k=4,s=3,n=8,extra=-1", "context_extra must be"),
                     ("k=4,s=x", "k=4,s=x.*invalid literal"), ("k=4,cut=1.5", "min_score must be"),
                     ("k=4,ctx=maybe", "expected on or off"), ("k=4,k=3", "'k' is named twice"),
                     ("k=2,s=1,n=9", "exceeds what topk=2, num_steps=1 can hold")):
        with pytest.raises(ConfigError, match=why):
            parse_sweep(bad)


def test_selfcheck_report_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`selfcheck --report` without CUDA: the GPU checks and every graphed row are marked
    skipped with a reason; plain decoding and EAGLE-3 run eagerly on the prompt file with their
    tokens/s, speedup, host syncs per iteration (one per greedy step) and ms per phase. A spent
    time budget skips the measurements; without --report the CPU run only lists the skips."""
    assert main(["selfcheck"]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q, "More?"]}) + "\n"
                               for q in ("Name a color.", "What is 2 plus 2?", "Unused.")))
    out = tmp_path / "report.json"
    assert main(["selfcheck", "--report", str(out), "--prompts", str(prompts), "--limit", "2",
                 "--max-new-tokens", "5"]) == 0
    rep = json.loads(out.read_text())
    assert rep["cuda"] is False and rep["device"].startswith("cpu")
    assert rep["prompts"] == {"source": str(prompts), "count": 2, "max_new_tokens": 5}
    gpu = [c for c in rep["checks"] if c["result"] == "skipped"]
    assert len(gpu) == 4 and all(c["detail"] == "no CUDA device" for c in gpu)
    assert [c["ok"] for c in rep["checks"] if c not in gpu] == [True]  # one sync per step
    assert "eagle eager: max 1" in rep["checks"][-1]["detail"]
    for section in ("timings", "syncs_per_iteration", "phase_ms"):
        rows = rep[section]
        assert {r["status"] for r in rows if r["graphs"]} == {"skipped"}
        assert all("no CUDA device" in r["reason"] for r in rows if r["graphs"])
        assert {r["status"] for r in rows if not r["graphs"]} == {"ran"}
    plain, eagle = (next(t for t in rep["timings"] if t["mode"] == m and not t["graphs"])
                    for m in ("plain", "eagle"))
    assert plain["tokens"] == eagle["tokens"] > 0 and plain["prompts"] == 2
    assert eagle["greedy_same_as_plain"] == "2/2" and eagle["tau"] >= 1 and plain["tau"] is None
    speedups = {s["name"]: s for s in rep["speedups"]}
    assert speedups["eagle eager vs plain eager"]["value"] == pytest.approx(
        eagle["tokens_per_s"] / plain["tokens_per_s"], abs=2e-3)
    assert speedups["eagle graphs vs plain graphs"]["status"] == "skipped"
    greedy = [r for r in rep["syncs_per_iteration"] if r["status"] == "ran"
              and r["sampling"] == "greedy"]
    assert [r["per_iteration_max"] for r in greedy] == [1, 1]
    assert all(r["counter"] == "HostSyncs" and r["iterations"] >= 1 for r in greedy)
    phases = {p["mode"]: p["ms"] for p in rep["phase_ms"] if p["status"] == "ran"}
    assert set(phases["plain"]) == {"prefill", "decode"}
    assert set(phases["eagle"]) == {"prefill", "draft", "verify", "extend"}
    assert all(v > 0 for ms in phases.values() for v in ms.values())
    assert main(["selfcheck", "--report", str(out), "--limit", "1", "--time-budget-s", "0"]) == 0
    rep = json.loads(out.read_text())
    assert rep["prompts"]["source"] == "built-in"
    assert {r["status"] for r in rep["timings"]} == {"skipped"}
    assert all("time budget" in r["reason"] for r in rep["timings"] if not r["graphs"])
    assert rep["checks"][-1]["result"] == "skipped"
