"""`CaptureGuard`: refuses, by name, every op a CUDA graph cannot hold.

A graph replays fixed kernels on fixed addresses, so a captured function may not read a value
on the host (`.item()`, `float(t)`, `if t:`, which dispatch `item` or `_local_scalar_dense`) nor run
an op whose output shape depends on values (`nonzero`, `masked_select`, `unique`,
`repeat_interleave` with a tensor of repeats and no output size, boolean-mask indexing, ...).
Under the guard such an op raises `CaptureUnsafe` naming it, on any device: the CPU tests run
every static phase under it, and on a GPU each runner runs once under it before its capture,
so a failure names the op rather than a CUDA error. A host copy that dispatches no op
(`.tolist()` of a CPU tensor) is caught by running the phases on the meta device, where no
value exists (tests/test_capture_guard.py).
Not here: the runners (`cuda_graph.py`).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that read a value on the host or shape their output by values
UNSAFE = {
    aten._local_scalar_dense.default: "reads a value on the host (.item(), float(), bool())",
    aten.item.default: "reads a value on the host (.item(), float(), bool())",
    aten.nonzero.default: "has a data-dependent output shape",
    aten.masked_select.default: "has a data-dependent output shape",
    aten._unique2.default: "has a data-dependent output shape",
    aten.unique_dim.default: "has a data-dependent output shape",
    aten.unique_consecutive.default: "has a data-dependent output shape",
    aten.bincount.default: "has a data-dependent output shape",
    aten.index.Tensor: None,  # checked below: boolean-mask indexing shapes by values
    aten.repeat_interleave.Tensor: None,  # checked below: needs output_size
    aten.allclose.default: "reads a value on the host",
    aten.equal.default: "reads a value on the host",
    aten.is_nonzero.default: "reads a value on the host",
}


class CaptureUnsafe(RuntimeError):
    """An op that no CUDA graph can hold ran under `CaptureGuard`."""


class CaptureGuard(TorchDispatchMode):
    """Raise `CaptureUnsafe` on any op in `UNSAFE` while active (a context manager)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in UNSAFE:
            why = UNSAFE[func]
            if func is aten.index.Tensor:
                masks = [i for i in args[1] if i is not None and i.dtype == torch.bool]
                why = "indexes by a boolean mask (a data-dependent shape)" if masks else None
            elif func is aten.repeat_interleave.Tensor:
                why = None if kwargs.get("output_size") is not None else (
                    "repeats by a tensor without output_size (a data-dependent shape)")
            if why is not None:
                raise CaptureUnsafe(f"{func} {why}: no CUDA graph can capture it")
        return func(*args, **kwargs)
