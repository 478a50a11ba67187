"""Whether this process gets the CPU it asked for, and the engine's thread count under load.

A CPU engine steps with `torch.get_num_threads()` threads (OpenMP / ATen's pool) that meet at a
barrier after every parallel region. When other processes take the cores, the OS deschedules
one of them now and then, and every barrier waits for it: on a 2-core AVX-512 EPYC with one
busy process per core, plain q4 decoding on two threads ran at ~20-25% of its quiet speed and a
tree at ~6%, on one thread at ~60-70% (`benchmarks/contention.py`).

`CpuShare` is the detector: the process's CPU time over wall time x threads while the engine
worked. Quiet, the engine's threads run all the time (~0.97 on two threads); with one busy
process per core the share falls to ~0.5. `STARVED_BELOW` separates the two.

`ThreadGovernor` acts on it, on the thread that steps the engine: after each `WINDOW_S` of step
time it reads the share of those steps; starved on more than one thread, it drops to one;
on one thread, after `RETRY_S` it tries every thread again, and the next window decides.
The q4 / q8 kernels and attention partition their work over output rows, so a thread count
changes which thread computes a number, never the number: greedy output is the same on any
count (tests/test_cpu_share.py).
Not here: what the app or the tuner do with a starved reading (`tools/autotune.py`,
`playground/`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

STARVED_BELOW = 0.8  # CPU time / (wall time x threads) under which the process lacks cores
WINDOW_S = 0.5  # step time per reading of the share
RETRY_S = 5.0  # on fewer threads, try every thread again after this long


@dataclass(frozen=True)
class CpuShare:
    """CPU seconds the process used over `wall_s` seconds of `threads` threads' work."""

    cpu_s: float
    wall_s: float
    threads: int

    @property
    def share(self) -> float:
        """1.0: every thread ran all the time; 0.5: half the time."""
        return self.cpu_s / (self.wall_s * self.threads) if self.wall_s > 0 else 1.0

    def starved(self, below: float = STARVED_BELOW) -> bool:
        return self.share < below


class CpuClock:
    """Measures a stretch of work: `with CpuClock() as c: ...`, then `c.reading`."""

    def __enter__(self) -> CpuClock:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        self.reading: CpuShare | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.reading = CpuShare(time.process_time() - self._cpu,
                                time.perf_counter() - self._wall, torch.get_num_threads())


@dataclass
class ThreadGovernor:
    """The engine's thread count: `max_threads` while the process gets its cores, one while it
    does not. `account(reading)` after every step, on the stepping thread; `apply()` before
    it (another governor on the same thread may have set another count)."""

    max_threads: int
    threads: int = field(init=False)
    _cpu: float = field(init=False, default=0.0)
    _wall: float = field(init=False, default=0.0)
    _since: float = field(init=False, default=0.0)  # step time since the last change

    def __post_init__(self) -> None:
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        self.threads = self.max_threads

    @property
    def thinned(self) -> bool:
        """Running on fewer threads than asked for: the machine is busy."""
        return self.threads < self.max_threads

    def apply(self) -> None:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def account(self, reading: CpuShare) -> None:
        """Add a step's reading; after `WINDOW_S` of steps, decide the thread count."""
        self._cpu += reading.cpu_s
        self._wall += reading.wall_s
        self._since += reading.wall_s
        if self._wall < WINDOW_S:
            return
        window = CpuShare(self._cpu, self._wall, self.threads)
        self._cpu = self._wall = 0.0
        if not self.thinned and self.threads > 1 and window.starved():
            self._set(1)
        elif self.thinned and self._since >= RETRY_S:
            self._set(self.max_threads)

    def _set(self, threads: int) -> None:
        self.threads, self._since = threads, 0.0
        self.apply()
