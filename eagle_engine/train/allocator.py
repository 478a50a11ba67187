"""Handing the freed pages that jemalloc keeps back to the system during long CPU training runs.

The README preloads jemalloc with freed pages kept (`dirty_decay_ms:-1`): PyTorch's CPU
allocator caches nothing, and without that setting every large tensor of a step is a fresh
mapping that the kernel zeroes page by page (steps about 2x slower).
Kept pages are never returned on their own, so a run's resident memory grows as tensors of new
sizes come, until a machine's memory runs out and the OOM killer ends the run.
`purge_freed_pages` returns them; without jemalloc it does nothing. Not here: when
the training loop calls it (`trainer.py`).
"""
from __future__ import annotations

import ctypes

ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL


def purge_freed_pages() -> bool:
    """Return the pages jemalloc holds for freed memory, in every arena -> whether jemalloc is
    loaded and did so (False under any other allocator)."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except AttributeError:  # not preloaded: glibc's malloc returns large blocks itself
        return False
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    return mallctl(f"arena.{ALL_ARENAS}.purge".encode(), None, None, None, 0) == 0
