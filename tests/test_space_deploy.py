"""Deploying as a Space, as the README documents it: every file the Hub takes only through
LFS matches a rule of `.gitattributes`, and `deploy/upload_space.sh` sends what the app needs
(and the CPU torch pin only to CPU hardware), checked with a stand-in for the `hf` CLI."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

REPO = Path(__file__).resolve().parent.parent
HUB_PLAIN_LIMIT = 10 * 1024 * 1024  # the Hub refuses larger files outside LFS


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p and (REPO / p).is_file()]


def is_binary(path: Path) -> bool:
    """git's own test: a NUL byte in the first 8000 bytes."""
    return b"\0" in path.read_bytes()[:8000]


def lfs_files(paths: list[str]) -> set[str]:
    out = subprocess.run(["git", "check-attr", "--stdin", "filter"], cwd=REPO, check=True,
                         input="\n".join(paths), capture_output=True, text=True).stdout
    return {line.split(": filter: ")[0] for line in out.splitlines()
            if line.endswith(": filter: lfs")}


def test_every_large_or_binary_tracked_file_matches_an_lfs_rule() -> None:
    paths = tracked()
    needs_lfs = [p for p in paths
                 if (REPO / p).stat().st_size > HUB_PLAIN_LIMIT or is_binary(REPO / p)]
    assert any(p.endswith("model.safetensors") for p in needs_lfs), "the heads are tracked"
    missing = sorted(set(needs_lfs) - lfs_files(needs_lfs))
    assert not missing, f"files the Hub takes only through LFS, without an LFS rule: {missing}"


def test_lfs_rules_leave_text_files_alone() -> None:
    paths = [p for p in tracked() if p.endswith((".py", ".md", ".txt", ".json", ".jsonl"))]
    assert not lfs_files(paths)


def upload_calls(tmp_path: Path, hardware: str) -> list[list[str]]:
    """The `hf` invocations of `upload_space.sh SPACE hardware`, through a stand-in that logs
    its arguments."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "hf"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {log}\necho >> {log}\n')
    fake.chmod(0o755)
    subprocess.run(["bash", str(REPO / "deploy" / "upload_space.sh"), "me/playground", hardware],
                   check=True, env={**os.environ, "HF": str(fake)}, capture_output=True)
    return [shlex.split(line) for line in log.read_text().splitlines()]


def option(call: list[str], name: str) -> list[str]:
    return [call[i + 1] for i, a in enumerate(call) if a == name]


@pytest.mark.parametrize("hardware", ["cpu-basic", "t4-small"])
def test_upload_script_sends_what_the_app_needs(tmp_path: Path, hardware: str) -> None:
    calls = upload_calls(tmp_path, hardware)
    assert calls[0][:2] == ["repos", "create"] and option(calls[0], "--flavor") == [hardware]
    uploads = [c for c in calls if c[0] == "upload"]
    folder = uploads[-1]
    assert folder[1:4] == ["me/playground", ".", "."] and option(folder, "--type") == ["space"]
    if hardware.startswith("cpu-"):
        assert uploads[0][2:4] == ["deploy/cpu-space-pre-requirements.txt",
                                   "pre-requirements.txt"], "the torch pin goes first"
        assert not option(folder, "--delete")
    else:
        assert len(uploads) == 1 and option(folder, "--delete") == ["pre-requirements.txt"]
    sent = set(filter_repo_objects(tracked(), allow_patterns=option(folder, "--include"),
                                   ignore_patterns=option(folder, "--exclude")))
    needed = {"app.py", "requirements.txt", "README.md", ".gitattributes",
              "eagle_engine/__init__.py", "eagle_engine/engine.py", "playground/handlers.py",
              "assets/style.css", "assets/copy_as_text.js",
              "assets/heads/eagle3-aux-1layer/model.safetensors"}
    assert needed <= sent, sorted(needed - sent)
    assert not {p for p in sent if p.startswith(("tests/", "docs/", "data/", "benchmarks/",
                                                 "assets/heads-eagle3.1/"))}


def test_upload_script_names_its_arguments() -> None:
    out = subprocess.run(["bash", str(REPO / "deploy" / "upload_space.sh"), "me/playground"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr and "HARDWARE" in out.stderr
