"""The app's serving machinery: `EngineThread`, the one thread that makes every engine call,
`Visitors`, the answers being streamed (background work waits for none), and `StopFlags`, the
Stop button's flags.
Not here: the handlers (`handlers.py`), the background work (`background.py`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """The one thread that makes every engine call of the app: load, warm-up and each step.
    libgomp gives each thread that starts parallel work its own OpenMP pool, and once there are
    more OpenMP threads than cores their workers stop spinning between parallel regions, so
    every oneDNN linear and attention call waits for sleeping workers: stepped from Gradio's
    worker threads after a load in the main thread, the engine decodes 1.6-1.75x slower on a
    2-core CPU. One thread also runs one step
    at a time, so the step a cancelled run had in flight finishes before the next run's
    prefill starts."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn` on the thread without waiting (the scheduler's steps)."""
        return self._pool.submit(fn, *args)


class Visitors:
    """The answers being streamed now (every handler that runs the engine for a visitor holds
    `answering` while it does), so that background work runs only between them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._streaming = 0
        self.started = 0  # answers started since the app began

    @contextmanager
    def answering(self) -> Iterator[None]:
        with self._changed:
            self._streaming += 1
            self.started += 1
        try:
            yield
        finally:
            with self._changed:
                self._streaming -= 1
                self._changed.notify_all()

    @property
    def idle(self) -> bool:
        with self._changed:
            return self._streaming == 0

    def wait_idle(self) -> int:
        """Block until no answer streams; the number of answers started by then."""
        with self._changed:
            self._changed.wait_for(lambda: self._streaming == 0)
            return self.started


class StopFlags:
    """The Stop button, the cooperative way: a session's streaming answer holds a flag that it
    reads after every engine step, and ends with a last frame once the flag is set. Gradio's
    `cancels` alone ends a run between two frames, which can leave a red "Error" badge on
    the status line, so `cancels` only ends an answer that has not ended within STOP_WAIT_S.
    Stop cannot take back an answer still waiting in Gradio's queue, which has no flag yet:
    Gradio cancels running events only.
    A session streams one answer at a time: two would write the same chat, and
    the last to end would drop the other's turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[threading.Event, threading.Event]] = {}  # stop, ended

    @contextmanager
    def running(self, session: str | None) -> Iterator[threading.Event | None]:
        """The flag of an answer streaming for `session` (None: an answer no Stop can reach);
        yields None instead when the session already streams one."""
        flags = (threading.Event(), threading.Event())
        with self._lock:
            busy = session is not None and session in self._runs
            if session is not None and not busy:
                self._runs[session] = flags
        if busy:
            yield None
            return
        try:
            yield flags[0]
        finally:
            flags[1].set()
            with self._lock:
                if session is not None:
                    del self._runs[session]

    def streaming(self, session: str | None) -> bool:
        with self._lock:
            return session is not None and session in self._runs

    def stop(self, session: str | None, timeout: float) -> bool:
        """Set the flag of `session`'s streaming answer and wait until it has ended; False when
        none was streaming or it did not end within `timeout` seconds."""
        with self._lock:
            flags = self._runs.get(session) if session is not None else None
        if flags is None:
            return False
        flags[0].set()
        return flags[1].wait(timeout)
