"""`selfcheck --app-path` in STATIC mode on a CPU: the app's path (the engine's one scheduler
on an engine thread of its own, graphs made at warm-up, trace and prefix cache on) answers a
mix of plain and EAGLE-3 requests of four trees, in two rounds, as an eager engine answers
each alone."""
from __future__ import annotations

from dataclasses import replace

import pytest

from eagle_engine.config import EngineConfig
from eagle_engine.cuda_graph import GraphMode
from eagle_engine.engine import EagleEngine
from eagle_engine.tools.app_path import check_app_path
from eagle_engine.tools.parity import TINY_TREE, IdTokenizer, tiny_models

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def engines(max_batch: int = 4) -> tuple[EagleEngine, EagleEngine]:
    target, head = tiny_models("cpu")
    config = EngineConfig(dtype="fp32", weights="dense", max_len=192, max_batch=max_batch,
                          prefix_cache_mb=8)
    graphed = EagleEngine(target, IdTokenizer(), {"tiny": head}, config, GraphMode.STATIC)
    graphed.default_tree = TINY_TREE
    eager = EagleEngine(target, IdTokenizer(), {"tiny": head},
                        replace(config, cuda_graphs=False, max_batch=1, prefix_cache_mb=0))
    return graphed, eager


def test_the_app_path_answers_as_the_eager_engine_alone() -> None:
    graphed, eager = engines()
    prompts = [list(range(3 + i, 30 + 3 * i)) for i in range(3)]
    report = check_app_path(graphed, eager, "tiny", prompts, max_new_tokens=16)
    assert report["ok"], report["failures"]
    assert report["mode"] == "static" and report["strict"]
    assert report["rounds_equal"] == ["5/5", "5/5"]
    assert report["warm_up"]["graphs"] == 12  # 3 buckets x (decode, verify, extend, draft)
    assert report["prefix_cache_tokens"][1] > 0  # the second round restored the first's rows
    assert set(report["tokens_per_s"]) == {"plain", "eagle"}


def test_the_check_fails_when_an_answer_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graphed verify that picks another token than the eager one fails the check."""
    import eagle_engine.cuda_graph as cuda_graph

    real = cuda_graph.verify_forward

    def skewed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        outs = real(*args, **kwargs)
        for o in outs:
            o.logits[..., 5] += 1e4  # token 5 always wins
        return outs
    monkeypatch.setattr(cuda_graph, "verify_forward", skewed)
    graphed, eager = engines()
    report = check_app_path(graphed, eager, "tiny", [list(range(3, 30))], max_new_tokens=8)
    assert not report["ok"] and report["failures"]
