"""Fixtures shared by the app tests (`test_app_api.py`, `test_browser.py`): one `python app.py`
per test session on a free 127.0.0.1 port, a `gradio_client` factory, and Debian's Chromium
driven by the pip `playwright` package (skipped with a reason when Chromium is missing).

Heads: `EAGLE_TEST_HEADS` if set, else the trained heads in `assets/heads` when all three are
there, else small random heads written to a temporary directory (then tests that need real
acceptance skip). Test modules load this file with `pytest_plugins`, so the app starts once.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eagle_engine.events import StepEvent, TokenSpan, TreeNode

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "tests" / "artifacts"
# a prompt whose answer streams over many frames on any CPU here: runs past 512 tokens
STORY = "Write a long story about a robot who learns to paint."
HEAD_SPECS = {"eagle3-aux-1layer": dict(num_layers=1, use_aux=True),
              "eagle3-aux-2layer": dict(num_layers=2, use_aux=True),
              "eagle3-noaux-1layer": dict(num_layers=1, use_aux=False)}
APP_MAX_LEN = 1024  # small context: the over-long-prompt test stays cheap
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic",
                 "--no-first-run", "--disable-dev-shm-usage", "--force-color-profile=srgb",
                 "--hide-scrollbars", "--font-render-hinting=none"]
STARTUP_TIMEOUT_S = float(os.environ.get("EAGLE_APP_STARTUP_TIMEOUT", "600"))
MEASURED = "start-up measurements done"  # the app's log once they have ended


@dataclass(frozen=True)
class AppServer:
    url: str
    heads_dir: Path
    trained_heads: bool
    log_path: Path

    def client(self) -> Any:
        from gradio_client import Client

        return Client(self.url, analytics_enabled=False, verbose=False)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained_heads_dir() -> Path | None:
    directory = REPO / "assets" / "heads"
    ok = all((directory / name / "config.json").is_file() for name in HEAD_SPECS)
    return directory if ok else None


def write_random_heads(directory: Path) -> Path:
    """Random heads for the bundled target (small draft vocab, so they load fast)."""
    from eagle_engine.config import TargetConfig
    from eagle_engine.models.loader import read_config, resolve_target
    from tests.helpers import random_head, save_head

    target_cfg = TargetConfig.from_dict(read_config(resolve_target("bundled")))
    for i, (name, spec) in enumerate(HEAD_SPECS.items()):
        save_head(random_head(target_cfg, seed=i, draft_vocab=2048, **spec), target_cfg,
                  directory / name)
    return directory


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until the app serves and its start-up measurements (`playground/background.py`) have
    ended: the tests then meet the app in its steady state, with the speedup estimate's costs
    measured (the first answers before that: tests/test_browser_startup.py)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    served = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if not served:
                with urllib.request.urlopen(url, timeout=2) as r:
                    served = r.status == 200
            elif MEASURED in log_path.read_text(errors="replace"):
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"app.py not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


@contextmanager
def running_app(tmp_path_factory: pytest.TempPathFactory, args: list[str]
                ) -> Iterator[tuple[str, Path]]:
    """`python app.py ARGS` exactly as a user starts it, host and port from the Gradio env
    vars: (its URL once it serves, its log), stopped afterwards."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("app_log") / "app.log"
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False"}
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), *args], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_ready(proc, url, log_path)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def app_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppServer]:
    """The app on the bundled target with the trained heads (or random ones)."""
    env_heads = os.environ.get("EAGLE_TEST_HEADS")
    heads = Path(env_heads) if env_heads else trained_heads_dir()
    trained = heads is not None
    if heads is None:
        heads = write_random_heads(tmp_path_factory.mktemp("random_heads"))
    with running_app(tmp_path_factory, ["--heads-dir", str(heads),
                                        "--max-len", str(APP_MAX_LEN)]) as (url, log_path):
        yield AppServer(url, heads, trained, log_path)


@pytest.fixture(scope="session")
def chromium() -> Iterator[Any]:
    """Debian's Chromium via pip playwright (no browser download); skips when not installed."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium; `make test` does)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@dataclass
class PageProbe:
    """A page on the app plus what it saw: requests that left 127.0.0.1 and console errors."""

    page: Any
    external_requests: list[str]
    console_errors: list[str]


def open_page(browser: Any, url: str, width: int = 1400, height: int = 1000,
              permissions: Sequence[str] = (), reduced_motion: str = "reduce",
              touch: bool = False) -> PageProbe:
    """A fresh page on `url`; `reduced_motion` "no-preference" lets the race play by itself
    when it arrives (with "reduce" it waits for its Replay button); `touch`: a touch screen
    (taps, and no hover: CSS `(hover: none)` matches)."""
    ctx = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1,
                              reduced_motion=reduced_motion, color_scheme="light",
                              permissions=list(permissions), has_touch=touch)
    page = ctx.new_page()
    probe = PageProbe(page, [], [])

    def guard(route: Any) -> None:
        if route.request.url.startswith("http://127.0.0.1"):
            route.continue_()
        else:
            probe.external_requests.append(route.request.url)
            route.abort()

    page.route("**/*", guard)
    page.on("console", lambda m: probe.console_errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{url}?__theme=light", wait_until="load")
    page.locator("#send").wait_for(timeout=30_000)
    return probe


@pytest.fixture
def probe(chromium: Any, app_server: AppServer) -> Iterator[PageProbe]:
    p = open_page(chromium, app_server.url)
    yield p
    p.page.context.close()


@pytest.fixture(scope="session")
def fixed_events() -> list[StepEvent]:
    """A fixed three-step answer with every token kind, HTML-special characters included."""
    t = TokenSpan
    tree = [TreeNode(5, " is", -1, 0, True, 1.0), TreeNode(6, " <b>", 0, 1, True, 0.7),
            TreeNode(7, " a", 0, 1, False, 0.2), TreeNode(8, " &", 1, 2, False, 0.35)]
    return [
        StepEvent(0, "eagle", [t(1, "Speculation", "target", 0)], "Speculation",
                  stats={"num_tokens": 1, "tau": 0.0, "tokens_per_s": 10.0}),
        StepEvent(1, "eagle", [t(2, " is", "accepted", 1), t(3, " <b>", "accepted", 2),
                               t(4, " fast", "bonus", 0)], " is <b> fast",
                  rejected=[t(9, " &", "rejected", 3), t(10, " slow", "rejected", 4)], tree=tree,
                  timings_ms={"draft": 2.0, "verify": 5.0, "extend": 1.0},
                  stats={"num_tokens": 4, "num_steps": 1, "tau": 3.0, "tokens_per_s": 40.0,
                         "acceptance_per_depth": [1.0, 1.0, 0.0, 0.0],
                         "phase_s": {"draft": 0.002, "verify": 0.005, "extend": 0.001}}),
        StepEvent(2, "eagle", [t(11, "\n", "accepted", 1),
                               t(12, "when drafts agree.", "bonus", 0)], "\nwhen drafts agree.",
                  rejected=[t(13, " —", "rejected", 1)],
                  stats={"num_tokens": 6, "num_steps": 2, "tau": 3.0, "tokens_per_s": 40.0,
                         "acceptance_per_depth": [0.5, 0.5, 0.0, 0.0],
                         "phase_s": {"draft": 0.004, "verify": 0.01, "extend": 0.002}},
                  finished="length"),
    ]
