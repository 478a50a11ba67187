"""Counting host syncs: the operations that make the host wait for a device.

`HostSyncs` counts, on any device, what would stall the host on a GPU:
  * scalar reads: `.item()`, `int()`, `float()`, `bool()` of a tensor, a tensor used as a Python
    index or slice bound (`aten._local_scalar_dense`; `aten.item` / `aten.is_nonzero` in
    inference mode, where they are not decomposed);
  * `torch.equal` (returns a Python bool);
  * `.tolist()` / `.numpy()` of a CPU tensor (on a GPU their copy to the host is what counts);
  * copies from a device to the CPU (`aten._to_copy`, `aten.copy_`);
  * uploads of Python data (`torch.tensor(data)`, `torch.as_tensor(data)`): a copy from
    pageable host memory, which waits for the device on CUDA. A Python scalar written into a
    tensor is not counted, though on CUDA it waits too: code that
    runs there uploads through a pinned buffer (`tree.uploaded`);
  * ops whose output shape depends on the data (`nonzero`, `masked_select`, boolean indexing).
On CPU nothing waits, but each of these is a sync when the same code runs on a GPU, so the CPU
count of a code path is its GPU count, except where the code branches on the device (the CPU's
partial top-p sort checks its mass on the host; a GPU sorts fully) or syncs inside C++. On
CUDA, `CudaSyncs` counts what `torch.cuda.set_sync_debug_mode("warn")` reports (it also sees
syncs inside C++ ops). Copies of tensors from the CPU to a device are not counted (a CPU run
makes none).
`per_step` counts per item of an iterator (one engine iteration per event of `EagleEngine.stream`).
Not here: removing syncs (`scheduler.py`, `accept.py`, `verify.py`) or the report (`selfcheck.py`).
"""
from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")
aten = torch.ops.aten
PACKAGE = str(Path(__file__).resolve().parent.parent)  # eagle_engine/
SCALAR_READS = {aten._local_scalar_dense.default: "scalar read",  # outside inference mode
                aten.item.default: "scalar read",  # in inference mode (not decomposed there)
                aten.is_nonzero.default: "scalar read",  # bool() in inference mode
                aten.equal.default: "torch.equal"}
DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default}  # output size read from data
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
HOST_LISTS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}
UPLOADS = {torch.tensor, torch.as_tensor}  # with Python data (not a tensor) to convert


def caller() -> str:
    """file:line of the innermost frame of this package outside this module ('?' if none)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(PACKAGE) and not frame.filename.endswith("sync_count.py"):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


def sync_kind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """The kind of host sync an aten call makes, or None."""
    if func in SCALAR_READS:
        return SCALAR_READS[func]
    if func in DATA_SHAPED:
        return "data-dependent shape"
    if func in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices):
            return "data-dependent shape"
    if func in COPIES:
        src, dst_device = args[0], kwargs.get("device")
        if func is aten.copy_.default:
            src, dst_device = args[1], args[0].device
        if dst_device is not None and torch.device(dst_device).type == "cpu" and (
                src.device.type != "cpu"):
            return "copy to host"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.owner.record(kind)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_LISTS and args[0].device.type == "cpu":
            self.owner.record(HOST_LISTS[func])
        elif func in UPLOADS and not isinstance(args[0], torch.Tensor):
            self.owner.record("upload")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Context manager: counts host syncs (see the module docstring) made inside it, by kind and
    by the package line that made them. Every op in it goes through Python: for tests and
    reports, never for timed runs."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.where: Counter[str] = Counter()  # "kind at file:line"
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def record(self, kind: str) -> None:
        self.kinds[kind] += 1
        self.where[f"{kind} at {caller()}"] += 1

    def __enter__(self) -> HostSyncs:
        self._stack.enter_context(_Function(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


class CudaSyncs:
    """Context manager: counts the syncs `torch.cuda.set_sync_debug_mode("warn")` reports inside
    it (CUDA only; it also sees syncs inside C++ ops), by the Python line that made them."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self._caught = warnings.catch_warnings(record=True)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __enter__(self) -> CudaSyncs:
        self._log = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(*exc)
        for w in self._log:
            if "synchroniz" in str(w.message):
                self.kinds["cuda sync"] += 1
                self.where[f"cuda sync at {Path(w.filename).name}:{w.lineno}"] += 1


def counter_for(device: torch.device) -> HostSyncs | CudaSyncs:
    """`CudaSyncs` on CUDA, `HostSyncs` elsewhere."""
    return CudaSyncs() if device.type == "cuda" else HostSyncs()


def per_step(items: Iterator[T], device: torch.device = torch.device("cpu")
             ) -> Iterator[tuple[T, HostSyncs | CudaSyncs]]:
    """Each item of `items` with the syncs made while producing it (the generator's work up to
    that item: for `EagleEngine.stream`, one iteration and its event), counted by
    `counter_for(device)`."""
    while True:
        with counter_for(device) as syncs:
            try:
                item = next(items)
            except StopIteration:
                return
        yield item, syncs
