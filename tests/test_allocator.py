"""`train/allocator.py`: under jemalloc with freed pages kept (the README's training setting),
a purge hands a freed tensor's pages back to the system; under any other allocator it reports
that it did nothing. Each case runs in a child process, because the allocator is chosen when a
process starts."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JEMALLOC = sorted(glob.glob("/usr/lib/*/libjemalloc.so.2"))
CHILD = """
import torch
from eagle_engine.train.allocator import purge_freed_pages

def resident_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20

x = torch.ones(256 * 2**20 // 4)  # 256 MB
del x
before = resident_mb()
purged = purge_freed_pages()
print(purged, before - resident_mb())
"""


def run_child(**env: str) -> tuple[bool, float]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    purged, returned_mb = proc.stdout.split()
    return purged == "True", float(returned_mb)


def test_other_allocators_are_left_alone():
    purged, _ = run_child()
    assert not purged


@pytest.mark.skipif(not JEMALLOC, reason="libjemalloc2 is not installed (`make test` installs it)")
def test_jemalloc_returns_the_kept_pages_of_a_freed_tensor():
    purged, returned_mb = run_child(LD_PRELOAD=JEMALLOC[0],
                                    MALLOC_CONF="dirty_decay_ms:-1,muzzy_decay_ms:-1")
    assert purged and returned_mb > 200, (purged, returned_mb)
