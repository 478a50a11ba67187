"""`cpu_share`: the detector of a process that does not get its cores (synthetic CPU-time /
wall-time pairs), the thread governor's decisions, and that a thread count changes no output
of a q4 engine (so the governor may switch it between two steps of an answer)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_engine import cpu_share
from eagle_engine.config import SamplingParams, TreeParams
from eagle_engine.cpu_share import CpuShare, ThreadGovernor
from tests.helpers import tiny_engine


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_detector_reads_cpu_time_against_wall_time_times_threads() -> None:
    # quiet, two threads (measured: 0.97-0.98); one busy process per core (measured: 0.47-0.49)
    assert CpuShare(cpu_s=1.94, wall_s=1.0, threads=2).share == pytest.approx(0.97)
    assert not CpuShare(1.94, 1.0, 2).starved()
    assert CpuShare(0.98, 1.0, 2).starved()
    assert not CpuShare(0.98, 1.0, 1).starved()  # one thread that ran the whole time
    assert CpuShare(0.6, 1.0, 1).starved()
    assert CpuShare(1.0, 0.0, 2).share == 1.0  # nothing measured: no claim
    assert CpuShare(0.7, 1.0, 1).starved(below=0.75) and not CpuShare(0.7, 1.0, 1).starved(0.6)


def test_the_governor_drops_to_one_thread_when_starved_and_tries_again_later(
        restore_threads: None) -> None:
    torch.set_num_threads(2)
    gov = ThreadGovernor(2)
    step = cpu_share.WINDOW_S / 5
    for _ in range(10):  # quiet: every thread runs the whole step
        gov.account(CpuShare(2 * step, step, 2))
    assert gov.threads == 2 and not gov.thinned
    for _ in range(4):  # starved, but less than one window so far
        gov.account(CpuShare(step, step, 2))
    assert gov.threads == 2
    gov.account(CpuShare(step, step, 2))
    assert gov.threads == 1 and gov.thinned and torch.get_num_threads() == 1
    quiet_on_one = CpuShare(step, step, 1)
    while gov.threads == 1:  # on one thread it tries both again after RETRY_S of steps
        gov.account(quiet_on_one)
    assert torch.get_num_threads() == 2
    for _ in range(5):  # still starved on two threads: back to one
        gov.account(CpuShare(step, step, 2))
    assert gov.threads == 1
    torch.set_num_threads(2)  # another governor on this thread set another count
    gov.apply()
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        ThreadGovernor(0)


@pytest.mark.parametrize("weights", ["q4", "dense"])
def test_an_answer_is_the_same_on_any_thread_count(tmp_path: Path, restore_threads: None,
                                                   weights: str) -> None:
    """The q4 kernels partition their work over output rows, and so do torch's float32
    products of these shapes: one thread or two compute the same numbers, so a switch between
    steps changes no token."""
    engine = tiny_engine(tmp_path, {"head": {"intermediate_size": 64}}, weights=weights,
                         hidden_size=64, intermediate_size=96)
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    answers = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        answers[threads] = [engine.generate(ids, params).token_ids,
                            engine.generate(ids, params, TreeParams(3, 2, 6), "head").token_ids,
                            engine.generate(ids, SamplingParams(max_new_tokens=32, temperature=0.8,
                                                                seed=5, ignore_eos=True),
                                            TreeParams(3, 2, 6), "head").token_ids]
    assert answers[1] == answers[2]


def test_an_answer_reports_the_cpu_share_it_got(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    out = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    stats = out.stats
    assert stats.core_s > 0 and stats.cpu_s > 0
    assert stats.cpu_share == pytest.approx(stats.cpu_s / stats.core_s)
    assert "cpu_share" in stats.to_dict() and "thinned" in stats.to_dict()
    assert engine.scheduler.governor is not None  # a CPU engine adapts its threads
