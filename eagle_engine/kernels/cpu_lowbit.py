"""The CPU low-bit matmul kernels (`cpu_lowbit.cpp`): built at first use, cached on disk.

No library does this job well on these CPUs: PyTorch's `_weight_int4pack_mm_for_cpu` unpacks
the weights again for every 4 activation rows and is slow with fp32 activations, the only fast
float activation dtype on an AVX2-only CPU. The C++ kernels keep the
weights in GGUF block formats (q4: Q4_1 codes with a float16 scale and minimum per 32 inputs;
q8: Q8_0 codes with a float16 scale), quantize each activation row to int8 per block of 32 (as
llama.cpp does) and multiply in integers with AVX2 (one `vpdpbusd` per 4 inputs where the CPU has
AVX512-VNNI: the same integers, so the same bits), each weight block loaded once for up to 4
activation rows; every row gets the bits it would get alone. `load()` compiles them with
`torch.utils.cpp_extension` for this machine (`-march=native`) into the user cache, in a folder
keyed by the torch version, the compiler flags, the source and the CPU's vector flags, so a
later start only loads the built module. torch's builder marks a build with a `lock` file that a
killed build leaves behind, and every later start would wait on it forever; `load()` therefore
builds under an OS file lock (`flock`, released when its process dies), and a `lock` file found
while holding it belongs to no live build and is removed. The `*_reference` functions compute
the same product in float64 from the dequantized weight and the dequantized int8 activations:
the tests hold the kernels to them. Not here: packing a model's weights (`models/cpu_lowbit.py`).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..hardware import LOWBIT_CPU_FLAGS, cache_root, compiler_available, cpu_flags

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_suffix(".cpp"), Path(__file__).with_name("cpu_step.cpp")]
HEADERS = [Path(__file__).with_name("cpu_vec.h")]
GROUP = 32  # inputs per block (scale, minimum)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]


def source_digest() -> str:
    """sha256 of the C++ sources and headers: a changed source builds anew and measures anew."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)).hexdigest()


def build_dir(flags: list[str]) -> Path:
    key = "|".join([torch.__version__, " ".join(flags), " ".join(cpu_flags()), source_digest()])
    return cache_root() / "kernels" / hashlib.sha256(key.encode()).hexdigest()[:16]


@cache
def load(extra_flags: tuple[str, ...] = ()) -> ModuleType:
    """The compiled module (built on the first call on this machine, ~1 min on 2 cores).
    `extra_flags` builds a variant beside it under its own name (benchmarks compare builds,
    e.g. `("-mno-avx512vnni",)` for the AVX2 products on a VNNI CPU)."""
    if not compiler_available():
        raise ConfigError("the q4 CPU weights need a C++ compiler (g++) to build their kernel "
                          "at first use; install g++ or choose --weights dense")
    if not set(LOWBIT_CPU_FLAGS) <= set(cpu_flags()):
        raise ConfigError(f"the q4 CPU kernels need AVX2, FMA and F16C; this CPU has "
                          f"{cpu_flags()}; choose --weights dense")
    from torch.utils.cpp_extension import load as load_extension

    flags = FLAGS + list(extra_flags)
    name = "eagle_cpu_lowbit" + (
        "_" + hashlib.sha256(" ".join(extra_flags).encode()).hexdigest()[:8] if extra_flags else "")
    out = build_dir(flags)
    out.mkdir(parents=True, exist_ok=True)
    fresh = not any(out.glob("*.so"))
    t0 = time.perf_counter()
    if fresh:
        log.info("building the CPU low-bit kernels in %s (first start only)", out)
    with open(out / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits while another process builds; freed if it dies
        stale = out / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was stopped", stale)
            stale.unlink()
        try:
            module = load_extension(name, [str(s) for s in SOURCES], extra_cflags=flags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(out),
                                    verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            raise ConfigError(f"building the q4 CPU kernels in {out} failed ({e}); choose "
                              "--weights dense, or install g++, ninja and the Python headers"
                              ) from e
    if fresh:
        log.info("built the CPU low-bit kernels in %.1fs", time.perf_counter() - t0)
    return module


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int
              ) -> torch.Tensor:
    """x [M, K] float32 @ q4 weight [n, K]^T -> [M, n]; codes and scales packed (`pack_q4`)."""
    return load().q4_linear(x, codes, scales, n)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int
              ) -> torch.Tensor:
    """x [M, K] float32 @ q8 weight [n, K]^T -> [M, n]; codes and scales packed (`pack_q8`)."""
    return load().q8_linear(x, codes, scales, n)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [G * 8, ...] with zero rows appended (the kernels work on groups of 8)."""
    extra = -t.shape[0] % 8
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def pack_q4(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural Q4_1 codes [N, K/2] and float16 scales [N, 2, K/32] -> the kernel's layout, 8 columns
    together (see `cpu_lowbit.cpp`): codes [G, B, 128] uint8, byte (g, b, 32p + 4j + i) =
    code(8g+j, 32b+8p+i) | code(8g+j, 32b+8p+4+i) << 4; scales [G, B, 2, 8]."""
    c = _pad_rows(unpack_nibbles(codes))  # [G*8, K] values 0..15
    G, B = c.shape[0] // 8, c.shape[1] // GROUP
    c = c.view(G, 8, B, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [G, B, p, j, i, half]
    packed = c[..., 0] | (c[..., 1] << 4)
    s = _pad_rows(scales).view(G, 8, 2, B).permute(0, 3, 2, 1)  # [G, B, 2, 8]
    return packed.reshape(G, B, 128).contiguous(), s.contiguous()


def unpack_q4(codes: torch.Tensor, scales: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q4`: natural codes [n, K/2] and scales [n, 2, K/32]."""
    G, B = codes.shape[:2]
    c = codes.view(G, B, 4, 8, 4)  # [G, B, p, j, i]
    c = torch.stack([c & 15, c >> 4], -1)  # [G, B, p, j, i, half]
    c = c.permute(0, 3, 1, 2, 5, 4).reshape(G * 8, B * GROUP)[:n]  # [n, K]
    natural = c.view(n, B, 2, GROUP // 2)
    natural = natural[:, :, 0] | (natural[:, :, 1] << 4)  # [n, B, 16]
    s = scales.permute(0, 3, 2, 1).reshape(G * 8, 2, B)[:n]
    return natural.reshape(n, B * GROUP // 2).contiguous(), s.contiguous()


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural Q8_0 codes [N, K] int8 and float16 scales [N, K/32] -> codes [G, B, 256], element
    (g, b, 32s + 4j + i) = code(8g+j, 32b+4s+i), and scales [G, B, 8]."""
    c = _pad_rows(codes)
    G, B = c.shape[0] // 8, c.shape[1] // GROUP
    packed = c.view(G, 8, B, 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, s, j, i]
    s = _pad_rows(scales).view(G, 8, B).permute(0, 2, 1)  # [G, B, 8]
    return packed.reshape(G, B, 256).contiguous(), s.contiguous()


def unpack_q8(codes: torch.Tensor, scales: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q8`: natural codes [n, K] and scales [n, K/32]."""
    G, B = codes.shape[:2]
    c = codes.view(G, B, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(G * 8, B * GROUP)[:n]
    return c.contiguous(), scales.permute(0, 2, 1).reshape(G * 8, B)[:n].contiguous()


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Natural Q4_1 codes [N, K/2] -> [N, K] uint8 values 0..15 (input j of a block in the low
    nibble of byte j, input j + 16 in its high nibble)."""
    N = codes.shape[0]
    blocks = codes.view(N, -1, GROUP // 2)  # [N, K/32, 16]
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).view(N, -1)


def q4_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K/2] uint8, scales [N, 2, K/32] float16 -> weight [N, K] float32 (w = dw*c + m)."""
    N = codes.shape[0]
    c = unpack_nibbles(codes).view(N, -1, GROUP).double()  # [N, K/32, 32]
    dw, m = scales[:, 0, :, None].double(), scales[:, 1, :, None].double()
    return (c * dw + m).float().view(N, -1)


def q8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scales [N, K/32] float16 -> weight [N, K] float32."""
    N = codes.shape[0]
    return (codes.view(N, -1, GROUP).float() * scales[..., None].float()).view(N, -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> the activations the kernels multiply, [M, K] float64: per row and
    block of 32, d = absmax / 127 and q = round-half-even(x * (1 / d)), giving d * q."""
    M, K = x.shape
    blocks = x.view(M, K // GROUP, GROUP)
    d = blocks.abs().amax(-1, keepdim=True) / 127  # [M, K/32, 1]
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return ((blocks * inv).round().double() * d.double()).view(M, K)


def q4_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The q4 kernel's definition (tests/test_cpu_lowbit.py): x [M, K] quantized to int8 per
    block of 32 as the kernel does, times the dequantized codes, in float64."""
    w = q4_dequantize(codes, scales).double()
    return F.linear(quantize_activations(x), w).float()


def q8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The q8 kernel's definition, as `q4_linear_reference`."""
    w = q8_dequantize(codes, scales).double()
    return F.linear(quantize_activations(x), w).float()
