"""Every script in `benchmarks/` runs from a clone: a smoke run of each with the smallest
workload it takes (one prompt, a few tokens, one round), checking that it finishes and reports,
never how fast (figures belong to the scripts' own runs). And `report.py`'s rendering: the
committed `docs/benchmarks.md` and the README's figures are what the committed JSON renders,
and a rendered table's ratios are the figures' own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
MTBENCH = "data/prompts/mtbench.jsonl"

SMOKE = {  # script -> (arguments, text its output must contain)
    "peers.py": (["--prompts", MTBENCH, "--limit", "1", "--max-new-tokens", "4", "--rounds", "1",
                  "--json", "{tmp}/peers.json"], "ours EAGLE-3, q4"),
    "load.py": (["--visitors", "2", "--questions", "1", "--rounds", "1", "--max-new-tokens", "4",
                 "--turns", "2", "--memory-answers", "2", "--max-seconds", "900"],
                "greedy_equal"),
    "iteration_steps.py": (["--prompts", MTBENCH, "--limit", "1", "--max-new-tokens", "8"],
                           "verify"),
    "lowbit_kernels.py": (["--rows", "1,2"], "lm_head_us"),
    "cost_model.py": (["--rounds", "1", "--context", "64"], "bound_share"),
    "host_time.py": (["--tokens", "8", "--repeats", "1", "--profile", "3"], "rest_us"),
    "step_ops.py": (["--calls", "5"], "acceptance"),
    "first_token.py": (["--prompts", MTBENCH, "--limit", "1", "--rounds", "1"], "EAGLE-3"),
    "contention.py": (["--rounds", "1", "--tokens", "4", "--json", "{tmp}/contention.json"],
                      "lowest_share"),
    "startup.py": (["--cache", "warm", "--timeout", "900"], "first_token_s"),
    "app_speed.py": (["threads", "--tokens", "8", "--repeats", "1"], "engine_thread"),
    "cpu_training.py": (["--steps", "3", "--tokens-per-batch", "256"], "s/step, jemalloc"),
    "gpu_training.py": (["--device", "cpu", "--steps", "1", "--tokens-per-batch", "256"],
                        "cuDNN allowed"),
    "soak.py": (["--answers", "4", "--visitors", "2", "--prompts", "2", "--max-new-tokens", "4",
                 "--sample-s", "1", "--max-seconds", "600", "--out", "{tmp}/soak.json"],
                "peak_rss_mb"),
    "speedup_estimate.py": (["--tokens", "8", "--repeats", "1", "--prompts", "1"],
                            "mean_abs_error"),
    "checkouts.py": (["--before", ".", "--after", ".", "--prompts", MTBENCH, "--rounds", "1",
                      "--max-new-tokens", "4"], "after / before"),
}


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__.py", "report.py"}
    assert scripts == set(SMOKE), f"scripts without a smoke run: {sorted(scripts - set(SMOKE))}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_from_a_clone(script: str, tmp_path: Path) -> None:
    args, expected = SMOKE[script]
    cmd = [sys.executable, f"benchmarks/{script}", *(a.format(tmp=tmp_path) for a in args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert expected.lower() in text.lower(), text[-3000:]


def test_committed_figures_are_rendered() -> None:
    """docs/benchmarks.md and the README's figures block are what docs/figures renders."""
    assert report.main(["--check"]) == 0, "run PYTHONPATH=. python benchmarks/report.py"


def figure(kind: str, cls: str, **fields: object) -> dict:
    return {"kind": kind, "provenance": {"class": cls, "cpu": "CPU", "cpu_flags": "avx2",
                                         "torch": "2.13.0", "commit": "abc1234",
                                         "date": "2026-11-29", "command": f"run {kind}"},
            **fields}


def test_report_renders_each_class_with_ratios_to_llama_cpp(tmp_path: Path) -> None:
    peers = figure("peers", "AVX2 EPYC", prompts=2, max_new_tokens=128, temperature=0.0,
                   top_p=1.0, tokens_per_s={"ours EAGLE-3, q4": [300.0, 310.0],
                                            report.LLAMA_BENCH: [100.0, 110.0]})
    bench = figure("bench", "AMX Xeon", rows=80, max_new_tokens=128, weights="q4",
                   sampling={"temperature": 0.0}, modes={
                       "ar": {"tokens_per_s": 300.0, "tau": 1.0, "speedup_vs_ar": 1.0},
                       "eagle[h k3]": {"tokens_per_s": 360.0, "tau": 2.8, "speedup_vs_ar": 1.2,
                                    "greedy_same_as_baseline": "160/160"}})
    for i, f in enumerate((peers, bench)):
        (tmp_path / f"{i}.json").write_text(json.dumps(f))
    figures = report.load(tmp_path)
    md = report.benchmarks_md(figures)
    assert md.index("## AMX Xeon") < md.index("## AVX2 EPYC")
    assert "| ours EAGLE-3, q4 | 300.0 / 310.0 | 2.90x |" in md  # 305 / 105
    assert f"| {report.LLAMA_BENCH} | 100.0 / 110.0 | 1.00x |" in md
    assert "| EAGLE-3, h, k3 | 360.0 | 2.800 | 1.200x | 160/160 |" in md
    assert "| plain decoding | 300.0 | 1.000 | 1.000x |  |" in md
    assert "run peers" in md and "abc1234, 2026-11-29" in md
    block = report.readme_block(figures)
    assert "**AVX2 EPYC**" in block and "| ours EAGLE-3, q4 | 305.0 | 2.90x |" in block


def test_a_figure_names_the_command_that_reproduces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle_engine.tools import bench

    monkeypatch.setattr(sys, "argv", [str(ROOT / "eagle_engine" / "__main__.py"), "bench",
                                      "--prompts", "my prompts.jsonl"])
    assert bench.command_line() == "python -m eagle_engine bench --prompts 'my prompts.jsonl'"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "peers.py"), "--limit", "3"])
    assert bench.provenance()["command"] == "PYTHONPATH=. python benchmarks/peers.py --limit 3"
