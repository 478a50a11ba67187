"""The cost model of an EAGLE-3 iteration on this CPU, with its bounds, in one run:

    PYTHONPATH=. python benchmarks/cost_model.py [--context 300] [--rounds 21] \
        [--compare-flags=-DLOWBIT_EMBEDDED_BROADCAST=0] [--json docs/figures]

The bundled q4 target and default head. Every item is timed once a round, in turn, and the
medians are kept (a slow spell of the machine hits all items alike):

- `bound_ms`: a streaming read of exactly the bytes a one-token forward reads (every weight
  tensor of the target: the decoder's q4 codes and scales, the q8 lm_head, the norms), 256-bit
  loads split over the threads, each tensor in turn as the forward reads them;
- `forward_ms`: the target's one-token forward after `--context` tokens, and `bound_share`:
  bound / forward (plain decoding's share of its read-bandwidth bound);
- `verify_vs_1`: a tree-shaped (causal) verify of 4, 8 and 16 rows against one row;
- `row_ms`: what each row past 8 adds ((t16 - t8) / 8), the multiply-adds of a row (decoder
  and lm_head), their rate and its share of `peak_gmacs`: the dot-product instruction's
  throughput on all threads (`vpdpbusd` where the CPU has AVX512-VNNI, `vpmaddubsw` +
  `vpmaddwd` on AVX2 alone; 32 multiply-adds of int8 a 256-bit instruction), registers only;
- `draft_step_vs_1` (a draft decode step over `topk` rows) and `extend_vs_1` (an extend of 3
  accepted tokens), each timed right after a target forward, as the loop runs them (the head's
  weights then come back from memory), and `*_warm` back to back.

`--compare-flags` also builds the low-bit kernels with those compiler flags added and times
both builds in the same rounds, the items in reverse order every other round (the engine's
kernels are swapped between items): the A/B of a kernel change in one process. Prints JSON
with the CPU class.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from eagle_engine.accept import extend
from eagle_engine.config import EngineConfig
from eagle_engine.draft import draft
from eagle_engine.engine import EagleEngine
from eagle_engine.hardware import cpu_flags
from eagle_engine.io_struct import EagleDraftExtendInput, EagleDraftInput
from eagle_engine.kernels import cpu_lowbit
from eagle_engine.models.cpu_lowbit import LowBitLinear
from eagle_engine.models.layers import RMSNorm
from eagle_engine.tools.autotune import tree_label
from eagle_engine.tools.bench import provenance, target_forward, write_report
from eagle_engine.tools.cli_args import pick_head

PROBE_SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include <vector>

// Reads every byte of each tensor once (256-bit loads, 4 KB chunks over the threads);
// returns an xor of what it read so that the loads are not dropped.
int64_t stream_read(std::vector<at::Tensor> tensors) {
  int64_t out = 0;
  for (const auto& t : tensors) {
    const char* p = static_cast<const char*>(t.data_ptr());
    const int64_t n = t.nbytes() / 32;
    std::vector<int64_t> part(at::get_num_threads(), 0);
    at::parallel_for(0, n, 128, [&](int64_t a, int64_t b) {
      __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
      int64_t i = a;
      for (; i + 4 <= b; i += 4) {
        x0 = _mm256_xor_si256(x0, _mm256_loadu_si256((const __m256i*)(p + 32 * i)));
        x1 = _mm256_xor_si256(x1, _mm256_loadu_si256((const __m256i*)(p + 32 * i + 32)));
        x2 = _mm256_xor_si256(x2, _mm256_loadu_si256((const __m256i*)(p + 32 * i + 64)));
        x3 = _mm256_xor_si256(x3, _mm256_loadu_si256((const __m256i*)(p + 32 * i + 96)));
      }
      for (; i < b; ++i) x0 = _mm256_xor_si256(x0, _mm256_loadu_si256((const __m256i*)(p + 32 * i)));
      const __m256i x = _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
      part[at::get_thread_num()] ^= _mm256_extract_epi64(x, 0) ^ _mm256_extract_epi64(x, 3);
    });
    for (int64_t v : part) out ^= v;
  }
  return out;
}

// int8 multiply-adds per second on all threads: 12 independent 256-bit accumulators, each
// step 32 u8 x s8 products into int32 lanes.
double dot_peak(int64_t steps) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> sink(threads, 0);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t b) {
    __m256i acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
    __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(5);
    for (int64_t k = 0; k < steps / 12; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        acc[i] = _mm256_dpbusd_epi32(acc[i], u, s);
#else
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                            _mm256_set1_epi16(1)));
#endif
      }
      asm volatile("" : "+x"(u), "+x"(s));
    }
    int64_t x = 0;
    for (int i = 0; i < 12; ++i) x += _mm256_extract_epi32(acc[i], 0);
    sink[a] = x;
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile int64_t keep = sink[0];  // the sums are used: the loop is not dropped
  (void)keep;
  return double(threads) * (steps / 12 * 12) * 32 / s / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_read", &stream_read);
  m.def("dot_peak", &dot_peak);
}
"""

ROWS = (1, 4, 8, 16)


def probe() -> object:
    """The read and peak probes above, built at first use."""
    from torch.utils.cpp_extension import load_inline
    return load_inline("eagle_cost_probe", [PROBE_SOURCE],
                       extra_cflags=["-O2", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"])


@contextlib.contextmanager
def build(flags: tuple[str, ...]) -> Iterator[None]:
    """The engine's low-bit kernels built with `flags` added, while inside."""
    if not flags:
        yield
        return
    module = cpu_lowbit.load(flags)
    base = cpu_lowbit.load
    cpu_lowbit.load = lambda extra_flags=(): module  # the engine calls `cpu_lowbit.load()`
    try:
        yield
    finally:
        cpu_lowbit.load = base


def forward_bytes(engine: EagleEngine) -> list[torch.Tensor]:
    """Every tensor a one-token forward reads in full: the low-bit weights and the norms."""
    out = []
    for m in engine.target.modules():
        if isinstance(m, LowBitLinear):
            out += [m.codes, m.scales]
        elif isinstance(m, RMSNorm):
            out.append(m.weight)
    return out


def row_macs(engine: EagleEngine) -> int:
    """Multiply-adds of one row through the target's decoder linears and lm_head."""
    return sum(m.in_features * m.out_features for m in engine.target.modules()
               if isinstance(m, LowBitLinear))


def items(engine: EagleEngine, head: str, context: int) -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (timed callable, untimed callable run just before it, or None)."""
    out: dict[str, tuple[Callable, Callable | None]] = {
        f"verify_{n}": (target_forward(engine, n, context), None) for n in ROWS}
    model = engine.heads[head]
    cache = model.new_cache(context + 64)
    k = engine.default_tree.topk
    width = EagleDraftExtendInput.hidden_size_for(model.cfg)

    def ext() -> None:
        extend(model, EagleDraftExtendInput(tokens=torch.tensor([5, 6, 7]),
                                            hidden=torch.randn(3, width), seq_len=context),
               cache, k)

    state = EagleDraftInput(topk_p=torch.full((k,), 1.0 / k), topk_ids=torch.arange(5, 5 + k),
                            hidden=torch.randn(model.cfg.hidden_size), root=torch.tensor([4]),
                            seq_len=context + 3)
    steps = replace(engine.default_tree, num_steps=2, step_cut=0.0)

    def draft_step() -> None:  # one decode step past level 1 (a 2-level draft)
        draft(model, state, cache, steps)

    forward = out["verify_1"][0]
    out |= {"extend": (ext, forward), "extend_warm": (ext, ext),
            "draft_step": (draft_step, forward), "draft_step_warm": (draft_step, draft_step)}
    return out


@torch.inference_mode()
def measure(engine: EagleEngine, head: str, context: int, rounds: int,
            builds: list[tuple[str, ...]], probe_mod: object) -> dict:
    weights = forward_bytes(engine)
    named = {(b, name): fn for b in builds for name, fn in items(engine, head, context).items()}
    times: dict = {key: [] for key in named}
    times |= {("", "bound"): [], ("", "peak"): []}
    order = list(named.items())
    for r in range(rounds + 2):  # two warm-up rounds
        # the builds take turns going first: what runs first in a round runs slower
        for (b, name), (fn, before) in (order if r % 2 == 0 else order[::-1]):
            with build(b):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if r >= 2:
                times[(b, name)].append(dt)
        t0 = time.perf_counter()
        probe_mod.stream_read(weights)
        if r >= 2:
            times[("", "bound")].append(time.perf_counter() - t0)
            times[("", "peak")].append(probe_mod.dot_peak(24_000_000))
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    peak = med[("", "peak")]
    macs = row_macs(engine)
    report = {"bound_ms": round(med[("", "bound")] * 1e3, 3),
              "bytes_mb": round(sum(t.nbytes for t in weights) / 1e6, 1),
              "peak_gmacs": round(peak, 1), "row_macs_m": round(macs / 1e6, 1), "builds": {}}
    for b in builds:
        one = med[(b, "verify_1")]
        row = (med[(b, "verify_16")] - med[(b, "verify_8")]) / 8
        report["builds"][" ".join(b) or "default"] = {
            "forward_ms": round(one * 1e3, 3),
            "bound_share": round(med[("", "bound")] / one, 3),
            "verify_vs_1": {n: round(med[(b, f"verify_{n}")] / one, 3) for n in ROWS[1:]},
            "row_ms": round(row * 1e3, 3),
            "row_gmacs": round(macs / row / 1e9, 1),
            "row_peak_share": round(macs / row / 1e9 / peak, 3),
            "draft_step_vs_1": round(med[(b, "draft_step")] / one, 3),
            "draft_step_warm_vs_1": round(med[(b, "draft_step_warm")] / one, 3),
            "extend_vs_1": round(med[(b, "extend")] / one, 3),
            "extend_warm_vs_1": round(med[(b, "extend_warm")] / one, 3),
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--compare-flags", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    engine = EagleEngine.load(EngineConfig())
    head = pick_head(engine, "bundled")
    builds = [()] + ([tuple(args.compare_flags.split())] if args.compare_flags else [])
    report = {"kind": "cost_model", "context": args.context, "rounds": args.rounds,
              "head": head, "tree": tree_label(engine.default_tree),
              "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
              **measure(engine, head, args.context, args.rounds, builds, probe()),
              "provenance": provenance()}
    print(json.dumps(report, indent=1))
    if args.json:
        write_report(Path(args.json), report)


if __name__ == "__main__":
    main()
