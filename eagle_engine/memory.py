"""Resident memory of a long-running server process: glibc malloc's settings and trimming.

PyTorch frees a CPU tensor with `free`. glibc serves blocks above its mmap threshold with their
own mappings, which `free` returns to the system, but it raises that threshold to the size of
every such block freed (up to 32 MB), after which blocks of that size come from its arenas
(one per thread that allocates, up to 8 per core) and stay resident once freed. A server whose
requests allocate caches of many sizes on several threads then grows answer after answer.
`tune_malloc` fixes the threshold (which stops the raising) and caps the arenas; `trim` hands
the arenas' free pages back. Both are no-ops where glibc is not the allocator (macOS, a
preloaded jemalloc).
Not here: the prefix cache's own bound (`prefix_cache.py`), jemalloc's purge during training
(`train/allocator.py`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD = 1 << 20  # blocks from 1 MiB up get mappings of their own, returned on free
ARENA_MAX = 2


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` and cap its arenas at `ARENA_MAX`, for
    allocations from now on -> whether glibc took both."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_ARENA_MAX, ARENA_MAX))
    log.info("glibc malloc: mmap threshold %d bytes, at most %d arenas: %s", MMAP_THRESHOLD,
             ARENA_MAX, "set" if ok else "refused")
    return ok


def trim() -> None:
    """Hand the free pages of glibc's arenas back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
