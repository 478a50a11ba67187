"""The app's start-up measurements, made after the page serves: each target's verify cost in
plain steps (the speedup estimate, `speed_estimate.measure`) and, on a CPU at a first start,
which weights and tree decode fastest here (`eagle_engine.tools.autotune`).

A visitor comes first. Every measurement is a series of short decodings (24-128 tokens), and
`StartupWork.call` runs each on the engine thread only while no answer streams
(`serving.Visitors`): a visitor's request waits at most for the decoding in flight, and a
decoding during which a visitor's answer started (its steps may have been shared, its time
is not the machine's alone) is run again. A measurement the machine's load spoils (the tuner
reads the process's CPU share) keeps the CPU class's static tree.
Not here: what the measurements compute (`speed_estimate.py`, `autotune.py`), the handlers
that read them (`handlers.py`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from eagle_engine.tools import autotune

from .serving import EngineThread, Visitors
from .speed_estimate import VerifyCost, measure

log = logging.getLogger("app")


class StartupWork:
    """The measurements of `engines` (the first is the page's default target) with `head`,
    on `worker` between `visitors`' answers: costs go into `costs` (keyed by weights label),
    the tuned tree into the engines (`autotune.apply`) and their fastest-first order into
    `ranked`. `tune`: measure weights and tree (a CPU engine, no cached measurement)."""

    def __init__(self, engines: list[Any], head: str | None, worker: EngineThread,
                 visitors: Visitors, costs: dict[str, VerifyCost | None], tune: bool) -> None:
        self.engines, self.head, self.worker, self.visitors = engines, head, worker, visitors
        self.costs, self.tune = costs, tune
        self.ranked: list[Any] | None = None  # once tuned: the engines, fastest first
        self.done = threading.Event()
        self.stage = "waiting for the page to serve"

    def call(self, unit: Callable[[], Any]) -> Any:
        """`unit()` on the engine thread once no answer streams; again if one started while
        it ran."""
        while True:
            started = self.visitors.wait_idle()
            result = self.worker.call(unit)
            if self.visitors.started == started:
                return result

    def run(self) -> None:
        """Every measurement in turn: the default target's verify cost first (the tiles wait
        for it), then the tuning, then the other targets' costs. A failure is logged; the
        app serves on with what it has."""
        t0 = time.perf_counter()
        try:
            for i, engine in enumerate(self.engines):
                self.stage = f"measuring the {engine.config.weights_label} target's verify cost"
                self.costs[engine.config.weights_label] = measure(engine, self.head,
                                                                  run=self.call)
                if i == 0 and self.tune:
                    self.stage = "measuring which weights and tree decode fastest here"
                    tuned = autotune.tune(self.engines, self.head, call=self.call)
                    self.ranked = autotune.apply(self.engines, tuned)
        except Exception:  # noqa: BLE001 - runs unobserved; the app serves on without them
            log.exception("a start-up measurement failed (%s)", self.stage)
        finally:
            self.stage = "done"
            self.done.set()
            log.info("start-up measurements done in %.1f s, between visitors' answers",
                     time.perf_counter() - t0)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="startup-measurements", daemon=True)
        thread.start()
        return thread
