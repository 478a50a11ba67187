"""The CPU low-bit matmul kernels (`cpu_lowbit.cpp`): built at first use, cached on disk.

No library does this job well on these CPUs: PyTorch's `_weight_int4pack_mm_for_cpu` unpacks
the weights again for every 4 activation rows and is slow with fp32 activations, the only fast
activation dtype on an AVX2-only CPU (docs/results.md, section 2). The C++ kernels multiply fp32
activations by weights kept in GGUF block formats (q4: Q4_1 codes with a scale and a minimum per
32 inputs; q8: Q8_0 codes with a scale), unpack each block once for up to 4 activation rows,
and give every row the same bits it would get alone. `load()` compiles them with
`torch.utils.cpp_extension` for this machine (`-march=native`) into the user cache, in a folder
keyed by the torch version, the compiler flags, the source and the CPU's vector flags, so a
later start only loads the built module. The `*_reference` functions dequantize and call
`F.linear`: the tests hold the kernels to them. Not here: packing a model's weights
(`models/cpu_lowbit.py`).
"""
from __future__ import annotations

import hashlib
import logging
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from ..config import ConfigError, cache_root, compiler_available

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
GROUP = 32  # inputs per block (scale, minimum)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")


def cpu_flags() -> tuple[str, ...]:
    """The vector flags of this CPU that `-march=native` can use (empty off Linux/x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return tuple(f for f in CPU_FLAGS if f in present)


def build_dir(flags: list[str]) -> Path:
    key = "|".join([torch.__version__, " ".join(flags), " ".join(cpu_flags()),
                    hashlib.sha256(SOURCE.read_bytes()).hexdigest()])
    return cache_root() / "kernels" / hashlib.sha256(key.encode()).hexdigest()[:16]


@cache
def load(avx2_only: bool = False) -> ModuleType:
    """The compiled module (built on the first call on this machine, ~1 min on 2 cores).
    `avx2_only` builds the AVX2 kernels even on an AVX-512 CPU (the tests check both)."""
    if not compiler_available():
        raise ConfigError("the q4 CPU weights need a C++ compiler (g++) to build their kernel "
                          "at first use; install g++ or choose --weights dense")
    from torch.utils.cpp_extension import load as load_extension

    flags = FLAGS + (["-mno-avx512f"] if avx2_only else [])
    out = build_dir(flags)
    out.mkdir(parents=True, exist_ok=True)
    fresh = not any(out.glob("*.so"))
    t0 = time.perf_counter()
    if fresh:
        log.info("building the CPU low-bit kernels in %s (first start only)", out)
    name = "eagle_cpu_lowbit_avx2" if avx2_only else "eagle_cpu_lowbit"
    try:
        module = load_extension(name, [str(SOURCE)], extra_cflags=flags,
                                extra_ldflags=["-fopenmp"], build_directory=str(out),
                                verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise ConfigError(f"building the q4 CPU kernels in {out} failed ({e}); choose "
                          "--weights dense, or install g++, ninja and the Python headers") from e
    if fresh:
        log.info("built the CPU low-bit kernels in %.1fs", time.perf_counter() - t0)
    return module


def q4_linear(x: torch.Tensor, codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ q4 weight [N, K]^T -> [M, N]; codes [N, K/2] uint8, dm [N, K/32, 2]."""
    return load().q4_linear(x, codes, dm)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ q8 weight [N, K]^T -> [M, N]; codes [N, K] int8, d [N, K/32]."""
    return load().q8_linear(x, codes, d)


def q4_dequantize(codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """codes [N, K/2] uint8, dm [N, K/32, 2] -> weight [N, K] float32 (w = d*q + m, fused as
    the kernel does: one rounding)."""
    N = codes.shape[0]
    blocks = codes.view(N, -1, GROUP // 2)  # [N, K/32, 16]
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # [N, K/32, 32]
    d, m = dm[..., :1].double(), dm[..., 1:].double()
    return (q.double() * d + m).float().view(N, -1)


def q8_dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, d [N, K/32] -> weight [N, K] float32."""
    N = codes.shape[0]
    return (codes.view(N, -1, GROUP).float() * d[..., None]).view(N, -1)


def q4_linear_reference(x: torch.Tensor, codes: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    return F.linear(x, q4_dequantize(codes, dm))


def q8_linear_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return F.linear(x, q8_dequantize(codes, d))
