"""What the playground loads: the bundled target with its heads by default, another target
(`--target` / EAGLE_TARGET) with the heads given for it (`--draft` / EAGLE_DRAFTS, or a heads
directory) and none of the bundled ones, the second copy with the other weights only for a GGUF
target on a CPU, a clear refusal of a heads directory without heads and of two heads the sidebar
cannot tell apart; a sidebar without heads that still sends; and the examples under the message
box, which the bundled q4 target answers without looping.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from eagle_engine.config import EngineConfig, SamplingParams
from eagle_engine.engine import EagleEngine, HeadInfo, bundled_head_dirs
from playground import handlers, layout, serving, startup
from playground.ui_render import same_controls


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch, **env: str):
    for name in ("EAGLE_TARGET", "EAGLE_DRAFTS", "EAGLE_HEADS_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return startup.parse_args(argv)


def test_bundled_target_loads_the_bundled_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse([], monkeypatch)
    assert args.target == "bundled"
    assert args.drafts == tuple(str(p) for p in bundled_head_dirs()) and len(args.drafts) == 3
    configs = startup.engine_configs(args, "cpu")
    assert [c.weights for c in configs] == ["q4", "dense"]  # the sidebar's "Target weights"
    assert len(startup.engine_configs(parse(["--single-weights"], monkeypatch), "cpu")) == 1


def test_another_target_loads_only_the_heads_given_for_it(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """The bundled heads were trained for the bundled target: another target gets the heads
    named for it, from the command line or the environment (a Space's variables), or none."""
    args = parse(["--target", "owner/model"], monkeypatch)
    assert args.drafts == ()
    configs = startup.engine_configs(args, "cpu")
    assert [c.weights for c in configs] == ["dense"] and configs[0].target == "owner/model"
    args = parse(["--target", "owner/model", "--draft", "owner/head", "--draft", str(tmp_path)],
                 monkeypatch)
    assert args.drafts == ("owner/head", str(tmp_path))
    args = parse([], monkeypatch, EAGLE_TARGET="/models/llama", EAGLE_DRAFTS="a/b, c/d")
    assert (args.target, args.drafts) == ("/models/llama", ("a/b", "c/d"))
    assert startup.engine_configs(args, "cuda")[0].device == "cuda"
    gguf = parse(["--target", "/models/other.gguf"], monkeypatch)
    assert [c.weights for c in startup.engine_configs(gguf, "cpu")] == ["q4", "dense"]


def test_heads_dir_without_heads_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes").mkdir()
    with pytest.raises(SystemExit):
        parse(["--heads-dir", str(tmp_path)], monkeypatch)
    err = capsys.readouterr().err
    assert f"no head folder (one with a config.json) in {str(tmp_path)!r}" in err
    heads = tmp_path / "heads"
    for name in ("a", "b"):
        (heads / name).mkdir(parents=True)
        (heads / name / "config.json").write_text("{}")
    args = parse(["--target", "owner/model"], monkeypatch, EAGLE_HEADS_DIR=str(heads))
    assert args.drafts == (str(heads / "a"), str(heads / "b"))


def test_heads_the_sidebar_cannot_tell_apart_are_refused() -> None:
    """The sidebar picks a head by aux on/off and layer count."""
    heads = [HeadInfo("a", 1, True, 8192), HeadInfo("b", 2, True, 8192),
             HeadInfo("c", 1, False, 8192)]
    assert same_controls(heads) is None
    clash = same_controls([*heads, HeadInfo("d", 2, True, 32000)])
    assert clash is not None and "'b' and 'd'" in clash and "on and 2 layer(s)" in clash


def test_examples_are_answered_without_a_loop() -> None:
    """Each example, greedy on the bundled q4 target (the default on a CPU): no 6 tokens in a
    row come back more than 3 times. "What is the capital of France?" failed it (49 times:
    "la France, la France, …")."""
    engine = EagleEngine.load(startup.engine_configs(startup.parse_args(["--single-weights"]),
                                                 "cpu")[0])
    for example in layout.EXAMPLES:
        ids = engine.generate(engine.encode(example), SamplingParams(max_new_tokens=160)
                              ).token_ids
        grams = Counter(tuple(ids[i:i + 6]) for i in range(len(ids) - 5))
        assert max(grams.values(), default=0) <= 3, (example, engine.tokenizer.decode(ids))


def test_without_a_head_the_sidebar_offers_the_target_alone() -> None:
    """Another target loads no bundled head. The sidebar then keeps "Draft layers" at a value
    among its choices: with none left (the page's load set them empty), Gradio refused every
    Send with "Value: 1 ... is not in the list of choices"."""
    class NoHeads:
        config = EngineConfig(target="owner/model")

        def head_info(self) -> list[HeadInfo]:
            return []
    pg = handlers.Playground([NoHeads()], serving.EngineThread(), frame_interval=0.25)
    aux, layers, note = pg.sidebar_state(False, True, 1)
    assert layers["value"] in [value for _, value in layers["choices"]]
    assert not aux["interactive"] and aux["info"] == "no draft head is loaded"
    assert note.startswith("No draft head is loaded")
