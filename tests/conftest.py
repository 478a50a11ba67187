"""Shared pytest setup: the `slow` and `cuda` markers and session-wide fixtures (the bundled
SmolLM2 checkpoint and its tokenizer, a tiny random Llama target on disk).

`slow` marks tests that take more than ~30 s; they still run by default (deselect them with
`-m "not slow"`). `cuda` marks tests that need a GPU; they are skipped when CUDA is missing.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle_engine.models.loader import load_target, load_tokenizer, resolve_target
from eagle_engine.models.target import TargetModel
from tests.helpers import make_hf_target


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~30 s (still runs by default)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-model tests: on a busy 2-core machine the second
    thread's spin-waits make each tiny op ~50x more expensive (measured: 4.7 ms vs 83 us of CPU
    per `accept_sampled` call). Opt in with `pytestmark = pytest.mark.usefixtures(...)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The playground judges answers as on a quiet machine, whatever else runs on the cores
    (tests of its judgement: tests/test_startup_work.py)."""
    from playground import handlers

    monkeypatch.setattr(handlers, "starved", lambda stats: False)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted once from its GGUF)."""
    return resolve_target("bundled")


@pytest.fixture(scope="session")
def smol_tokenizer(bundled_dir: Path) -> object:
    return load_tokenizer(bundled_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`helpers.make_hf_target` with its defaults (8 layers, GQA, vocab 96), saved once."""
    return make_hf_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> TargetModel:
    """Our fp32 runtime over `tiny_target_dir` (shared: never mutate its weights)."""
    return load_target(tiny_target_dir, torch.float32, "cpu", 256)
