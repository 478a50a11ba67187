"""Hardware probing: what this machine's CPU and compilers can do, and where built artifacts
are kept. Read by `config.py` (which dtype and weights to default to), the kernel build and
the benchmarks' reports. Not here: any choice made from these facts (`config.py`).
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
from pathlib import Path

import torch


def cache_root() -> Path:
    """Where converted targets and built kernels are kept between starts."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle_engine"


def native_bf16(device: str) -> bool:
    """bf16 matrix products run natively: on a CUDA GPU of compute capability 8.0 or later
    (Ampere on; a T4 or V100 has no bf16 tensor cores), or on a CPU with AVX512-BF16 or AMX. A
    CPU without them emulates bf16 products of several tokens (on an AVX2-only CPU a 16-token
    verify cost ~9x one token in bf16, ~2x in fp32, `bench --costs`)."""
    if device.startswith("cuda"):  # a GPU this process cannot see is taken for a recent one
        return not torch.cuda.is_available() or cuda_capability(device) >= (8, 0)
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cuda_capability(device: str) -> tuple[int, int]:
    """The compute capability of CUDA `device` ("cuda" or "cuda:N")."""
    return torch.cuda.get_device_capability(torch.device(device))


@functools.cache
def compiler_available() -> bool:
    """A C++ compiler is on the PATH: the q4 CPU kernels are built with it at first use."""
    return shutil.which("c++") is not None or shutil.which("g++") is not None


CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_bf16")
LOWBIT_CPU_FLAGS = ("avx2", "fma", "f16c")  # what the q4 / q8 kernels need


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The vector flags of this CPU that `-march=native` can use (empty off Linux/x86); read
    once a process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return tuple(f for f in CPU_FLAGS if f in present)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (`platform.machine()` off Linux); read once a process."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                platform.machine())


def cpu_isa(flags: tuple[str, ...] | None = None) -> str:
    """The widest vector unit of this CPU: "AMX", "AVX-512", "AVX2" or "x86-64"."""
    flags = cpu_flags() if flags is None else flags
    return ("AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags
            else "AVX2" if "avx2" in flags else "x86-64")


def cpu_class(flags: tuple[str, ...] | None = None, model: str | None = None) -> str:
    """The class a figure is measured on, as the README names them: "AMX Xeon", "AVX-512 EPYC",
    "AVX2 EPYC" (`cpu_isa`, then the vendor's line)."""
    isa = cpu_isa(flags)
    model = cpu_model() if model is None else model
    line = next((name for name in ("EPYC", "Xeon", "Ryzen", "Core") if name in model), model)
    return f"{isa} {line}"
