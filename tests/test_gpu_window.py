"""`deploy/gpu_window.sh` on this machine, standing in for the device: the parts carried by
separate calls make the file of `target.sha256` again (a missing part is named and nothing is
run), and what a command writes to the stash's `out` comes back through `$OUT` in pieces that
`collect` unpacks to the same bytes (gzipped on the way)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "gpu_window.sh"


def call(device: Path, carried: dict[str, bytes], env: dict[str, str], *args: str
         ) -> subprocess.CompletedProcess:
    """One device call: `.device/` holds only what this call carries."""
    shutil.rmtree(device / ".device", ignore_errors=True)
    (device / ".device").mkdir(parents=True)
    for name, data in carried.items():
        (device / ".device" / name).write_bytes(data)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=device, env=env,
                          capture_output=True, text=True)


def test_parts_carried_by_separate_calls_make_the_target_and_out_comes_back(
        tmp_path: Path) -> None:
    target = os.urandom(3 * 1024 * 1024 + 17)  # stands in for the GGUF
    parts = [target[i:i + 1_100_000] for i in range(0, len(target), 1_100_000)]  # 3 parts
    sha = f"{hashlib.sha256(target).hexdigest()} model.gguf\n".encode()
    device, out, stash = tmp_path / "device", tmp_path / "out", tmp_path / "stash"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "EAGLE_DEVICE_STASH": str(stash)}

    for i in range(2):
        done = call(device, {f"part-{i}": parts[i], "target.sha256": sha}, env, "stage")
        assert done.returncode == 0, done.stderr
    # the third part not carried: refused before the command runs
    missing = call(device, {"target.sha256": sha}, env, "run", "touch ran")
    assert missing.returncode == 2 and "a part was not carried" in missing.stderr
    assert not (device / "ran").exists() and not (stash / "model.gguf").exists()

    # 20 MiB of output that gzip cannot shrink (more than one 15 MiB piece) and a 30 MiB log
    # that it can (the two together would take four pieces unzipped)
    payload = os.urandom(20 * 1024 * 1024)
    (tmp_path / "payload").write_bytes(payload)
    log = b'{"step": 1, "loss": 2.5}\n' * (30 * 1024 * 1024 // 26)
    (tmp_path / "log").write_bytes(log)
    done = call(device, {"part-2": parts[2], "target.sha256": sha}, env, "run",
                f'test "$EAGLE_TARGET" = "{stash}/model.gguf" && mkdir -p "{stash}/out/head" && '
                f'cp "{tmp_path}/payload" "{stash}/out/head/model.safetensors" && '
                f'cp "{tmp_path}/log" "{stash}/out/head/train_log.jsonl"')
    assert done.returncode == 0, done.stderr
    assert (stash / "model.gguf").read_bytes() == target
    pieces = sorted(p.name for p in out.iterdir())
    assert pieces == ["out.tar.gz.part-0", "out.tar.gz.part-1"]
    assert all((out / p).stat().st_size <= 16 * 1024 * 1024 for p in pieces)

    here = tmp_path / "here"
    done = subprocess.run(["bash", str(SCRIPT), "collect", str(out), str(here)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (here / "out" / "head" / "model.safetensors").read_bytes() == payload
    assert (here / "out" / "head" / "train_log.jsonl").read_bytes() == log

    # a failing command still sends back what it wrote, and its status is the script's
    for p in out.iterdir():
        p.unlink()
    failed = call(device, {"target.sha256": sha}, env, "run", "exit 3")
    assert failed.returncode == 3 and sorted(p.name for p in out.iterdir()) == pieces
