// Low-bit weight products for the CPU, y[M, N] = x[M, K] @ W[N, K]^T with x float32, and the
// fused decoder layers that use them.
//
// Weights stay in GGUF block formats, 32 inputs per block:
//   q4: codes [N, K/2] uint8 (byte j of a block = input j in the low nibble, input j+16 in the
//       high nibble, as in a Q4_1 block) and scales [N, 2, K/32] float16 (scale dw, then
//       minimum m): w = dw * c + m.
//   q8: codes [N, K] int8 and scales [N, K/32] float16: w = dw * c (a Q8_0 block).
// Scales are float16 as in the GGUF (F16C widens 8 at a time): a q4 block reads 20 bytes, not 24.
// The activations are quantized per row and block to int8 (see "int8 activations" below) and
// each weight block is multiplied in integers, once per tile of activation rows (`product`); every
// output is summed in the same order whatever the number of rows or the tile it falls in, so
// row r of a call equals that row computed alone, bit for bit (a tree verify gives the numbers
// of one-token decodes). The columns are split over ATen's threads. The kernels need AVX2, FMA
// and F16C and use AVX512-VNNI where the CPU has it.
// ATen's tensor, its parallel loop, the few factory ops used and pybind11 with torch's tensor
// casters: a third of the compile time of <torch/extension.h>, which pulls in all of libtorch's
// C++ API.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/rms_norm.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
// cpu_lowbit.load() checks the CPU before building
#error "the low-bit kernels need AVX2, FMA and F16C"
#endif
#include <immintrin.h>

#include "cpu_vec.h"

namespace {

constexpr int64_t kGroup = 32;

#define LOWBIT_INLINE __attribute__((always_inline)) inline

// ---- Low-bit products with int8 activations --------------------------------------------------
// Each call first quantizes its activation rows per block of 32 inputs, as llama.cpp does for
// its Q4_1 / Q8_0 dot products (a Q8_1 block): d = absmax / 127, q = round-half-even(x / d) as
// x * (1 / d), s = d * sum(q). A weight block then meets an activation block in integers:
//   q4 (w = dw * c + m, c in 0..15):  sum(w * x) = dw * d * sum(c * q) + m * s
//   q8 (w = dw * c, c in -127..127):  sum(w * x) = dw * d * sum(c * q)
// The weights are packed 8 output columns together (`pack_q4` / `pack_q8` in cpu_lowbit.py):
// one 32-byte vector holds 4 consecutive inputs of each of the 8 columns, so `maddubs`
// (u8 x s8 -> int16 pairs) against 4 activation bytes broadcast to every lane, then `madd`
// (-> int32), leaves the 8 columns' partial sums in the 8 lanes: no horizontal sums, and the
// scales of 8 columns are one vector. q4 sums a block's 8 steps in int16 (at most
// 8 * 2 * 15 * 127 = 30480, no overflow); q8 (codes up to 127: 2 * 127 * 127 = 32258 a step)
// widens every step. Where the CPU has AVX512-VNNI (AVX-512 Xeons and EPYCs; built with
// -march=native) one `vpdpbusd` on the same 256-bit vectors does maddubs, madd and the add at
// once, straight into int32 (q4 keeps two sums a row, low and high nibbles, so that no row waits
// on one long chain; q8 multiplies the codes shifted to unsigned, c + 128, once for all rows,
// and takes 128 * sum(q) back off, where the AVX2 path moves each code's sign onto every row's
// activations). Both paths sum the same integers exactly, so they give the same bits.
// -DLOWBIT_EMULATE_VNNI builds the VNNI path with an exact AVX2 `vpdpbusd`, so that a CPU
// without VNNI tests it too (tests/test_cpu_lowbit.py).
// Every output lane sums its blocks in order, so each row gets the same bits whatever the
// number of rows in the call or the tile it falls in.

LOWBIT_INLINE float hmax(__m256 v) {  // the largest of the 8 lanes
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

struct Acts {  // activation rows quantized per block: q [M, K] int8; d, s and sum(q) [M, K/32]
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  int64_t K, B;
};

Acts quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t B = K / kGroup;
  Acts a{std::vector<int8_t>(M * K), std::vector<float>(M * B), std::vector<float>(M * B),
         std::vector<int32_t>(M * B), K, B};
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < M * B; ++i) {
    const float* xb = x + i * kGroup;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    const float d = hmax(amax) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i n[4];
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                              _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + i * kGroup),
                        _mm256_permutevar8x32_epi32(packed, order));
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t),
                       _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
    a.d[i] = d;
    a.sum[i] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    a.s[i] = d * float(a.sum[i]);
  }
  return a;
}

// A weight packed 8 columns together, per group g of 8 columns and block b:
//   q4: codes [G, B, 4, 32] uint8: vector p holds inputs 8p..8p+3 (low nibbles) and
//       8p+4..8p+7 (high nibbles), 4 bytes a column; scales [G, B, 2, 8] float16 (dw, then m).
//   q8: codes [G, B, 8, 32] int8: vector s holds inputs 4s..4s+3, 4 bytes a column;
//       scales [G, B, 8] float16.
template <bool kQ4>
struct Packed {
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits
  int64_t B;
  static constexpr int64_t kBytes = kQ4 ? 128 : 256, kScales = kQ4 ? 16 : 8;
};

LOWBIT_INLINE __m256 load8_half(const uint16_t* p) {  // 8 float16 values as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// n floats (a multiple of 8) -> float16, rounded to nearest even as torch's conversion rounds
LOWBIT_INLINE void store8_half(const float* x, uint16_t* out, int64_t n) {
  for (int64_t e = 0; e < n; e += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + e),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + e), _MM_FROUND_TO_NEAREST_INT));
}

LOWBIT_INLINE __m256i broadcast4(const int8_t* p) {  // 4 activation bytes to all 8 lanes
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// GCC reassociates a chain of integer adds: it hoists every `maddubs` of a tile ahead of the
// adds, and on AVX2's 16 vector registers the products of 4 rows spill to the stack. An empty
// asm statement keeps each running sum at its place in the chain. Built without it
// (-DLOWBIT_IN_ORDER=0), on an AVX2 EPYC a decoder layer's q4 products at 4 rows take 13%
// longer, the lm_head's q8 product 31%, and EAGLE-3 decodes 14% slower.
#ifndef LOWBIT_IN_ORDER
#define LOWBIT_IN_ORDER 1
#endif
LOWBIT_INLINE __m256i in_order(__m256i v) {
  if constexpr (LOWBIT_IN_ORDER) asm("" : "+v"(v));
  return v;
}

// dot4: acc + the sums of 4 u8 x s8 products per int32 lane (exact: no saturation for these
// codes), one instruction with VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
LOWBIT_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#elif defined(LOWBIT_EMULATE_VNNI)  // the VNNI path on a CPU without it, for its test
constexpr bool kVnni = true;
LOWBIT_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) {  // vpdpbusd's exact sums
  // bytes 0 and 2, then 1 and 3, of each lane widened to int16 (u unsigned, s signed)
  const __m256i even = _mm256_madd_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0xff)),
                                         _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
  const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
  return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
}
#else
constexpr bool kVnni = false;
LOWBIT_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return in_order(
      _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))));
}
#endif

// dot4 against 4 activation bytes at p, broadcast to every lane. With VNNI the broadcast is
// the instruction's own memory operand (EVEX embedded broadcast, {1to8}): one instruction a
// row instead of a broadcast and a product. On an AVX-512 EPYC the 8- and 16-row products
// of a decoder layer and the lm_head run 8-11% faster (in cache,
// `benchmarks/lowbit_kernels.py`); -DLOWBIT_EMBEDDED_BROADCAST=0 builds without.
#ifndef LOWBIT_EMBEDDED_BROADCAST
#define LOWBIT_EMBEDDED_BROADCAST 1
#endif
LOWBIT_INLINE __m256i dot4_at(__m256i acc, __m256i u, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (LOWBIT_EMBEDDED_BROADCAST) {
    asm("vpdpbusd %2%{1to8%}, %1, %0"
        : "+v"(acc)
        : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
#endif
  return dot4(acc, u, broadcast4(p));
}

// The weights a product reads a block at a time stream from memory (a one-token step reads
// every layer once), and the hardware's prefetchers stop at each 4 KB page: without a hint
// the multiplies wait on memory and the rows of a tree verify add their compute to the wait.
// Each block asks for the codes kPrefetch bytes ahead and the scales as far ahead in blocks
// (a hint: addresses past the tensor's end do not fault). 4 KB is the best distance on an AMX
// Xeon (2 KB is slower, 8-16 KB the same). Building with
// -DLOWBIT_PREFETCH_BYTES=0 turns the hints off (`benchmarks/lowbit_kernels.py --streamed
// --compare-flags=-DLOWBIT_PREFETCH_BYTES=0` times both builds).
#ifndef LOWBIT_PREFETCH_BYTES
#define LOWBIT_PREFETCH_BYTES 4096
#endif
constexpr int64_t kPrefetch = LOWBIT_PREFETCH_BYTES;

template <bool kQ4>
LOWBIT_INLINE void prefetch(const uint8_t* codes, const uint16_t* scales) {
  if constexpr (kPrefetch > 0) {
    const char* c = reinterpret_cast<const char*>(codes) + kPrefetch;
#pragma GCC unroll 4
    for (int64_t line = 0; line < Packed<kQ4>::kBytes; line += 64)
      _mm_prefetch(c + line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales) +
                     kPrefetch / Packed<kQ4>::kBytes * Packed<kQ4>::kScales * 2, _MM_HINT_T0);
  }
}

// R activation rows x the 8 columns of group g over all blocks: out[r] = 8 outputs.
template <int R, bool kQ4>
LOWBIT_INLINE void tile(const Packed<kQ4>& w, const Acts& x, int64_t g, int64_t m0,
                        __m256 out[R]) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.B; ++b) {
    const uint8_t* wc = w.codes + (g * w.B + b) * Packed<kQ4>::kBytes;
    const uint16_t* ws = w.scales + (g * w.B + b) * Packed<kQ4>::kScales;
    prefetch<kQ4>(wc, ws);
    const int8_t* xb[R];
    __m256i sum[R], sum_hi[R];  // sum_hi: VNNI's high-nibble sums (AVX2 adds all into sum)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xb[r] = x.q.data() + (m0 + r) * x.K + b * kGroup;
      sum[r] = sum_hi[r] = _mm256_setzero_si256();
    }
    if constexpr (kQ4) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * p));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          if constexpr (kVnni) {
            sum[r] = dot4_at(sum[r], lo, xb[r] + 8 * p);
            sum_hi[r] = dot4_at(sum_hi[r], hi, xb[r] + 8 * p + 4);
          } else {
            sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(lo, broadcast4(xb[r] + 8 * p)));
            sum[r] = in_order(_mm256_add_epi16(
                sum[r], _mm256_maddubs_epi16(hi, broadcast4(xb[r] + 8 * p + 4))));
          }
        }
      }
      const __m256 dw = load8_half(ws), m = load8_half(ws + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * x.B + b;
        const __m256i total = kVnni ? _mm256_add_epi32(sum[r], sum_hi[r])
                                    : _mm256_madd_epi16(sum[r], ones);
        const __m256 f = _mm256_cvtepi32_ps(total);
        acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[i]), acc[r]);
      }
    } else if constexpr (kVnni) {
      // codes c + 128 (c ^ 0x80, unsigned, once for every row) against the signed activations:
      // sum((c + 128) * q) - 128 * sum(q) = sum(c * q), the integers of the AVX2 path below
      const __m256i flip = _mm256_set1_epi8(char(0x80));
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i u = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * s)), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sum[r] = dot4_at(sum[r], u, xb[r] + 4 * s);
      }
      const __m256 dw = load8_half(ws);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * x.B + b;
        const __m256i total = _mm256_sub_epi32(sum[r], _mm256_set1_epi32(128 * x.sum[i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), acc[r]);
      }
    } else {  // u8 x s8 pairs saturate int16 past 32767: |c| against q with c's sign
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * s));
        const __m256i a = _mm256_abs_epi8(v);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          sum[r] = dot4(sum[r], a, _mm256_sign_epi8(broadcast4(xb[r] + 4 * s), v));
      }
      const __m256 dw = load8_half(ws);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(x.d[(m0 + r) * x.B + b])), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Two groups of 8 columns in one 512-bit tile, where the CPU has AVX-512 with VNNI: each 4-byte
// activation broadcast (the instruction's own memory operand, {1to16}) then feeds 16 columns
// instead of 8, and each instruction of the tile covers twice the columns, so a row costs half
// the loads and half the instructions. Every lane does the 256-bit tile's operations in the
// same order (the packed layout is the same: a vector joins the two groups' vectors), so the
// results have the same bits. For q4 weights (the decoder layers) of 8 rows or more only:
// paired, a product that waits on memory reads two streams, the two groups' blocks, which
// costs more than it saves at fewer rows and for the lm_head's q8 product at 1-8 rows. On an
// AVX-512 EPYC, streamed from memory (`lowbit_kernels.py --streamed`), 30 paired decoder
// layers and the lm_head take 7-8% longer at 1 and 4 rows and 5% / 14% less at 8 / 16 rows.
// -DLOWBIT_ZMM=0 builds without.
#ifndef LOWBIT_ZMM
#define LOWBIT_ZMM 1
#endif
#if LOWBIT_ZMM && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define LOWBIT_PAIR_GROUPS 1
constexpr int64_t kPairRows = 8;  // the fewest rows of a paired product

LOWBIT_INLINE __m512i join2(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

LOWBIT_INLINE __m512 load16_half(const uint16_t* a, const uint16_t* b) {  // 8 float16 of each
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

LOWBIT_INLINE __m512i dot16_at(__m512i acc, __m512i u, const int8_t* p) {  // `dot4_at`, 16 lanes
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Asks for block b of group g (its codes and scales) now; a hint: past the weight's end it
// does not fault.
template <bool kQ4>
LOWBIT_INLINE void prefetch_block(const Packed<kQ4>& w, int64_t g, int64_t b) {
  if constexpr (kPrefetch > 0) {
    const char* c = reinterpret_cast<const char*>(w.codes + (g * w.B + b) * Packed<kQ4>::kBytes);
#pragma GCC unroll 4
    for (int64_t line = 0; line < Packed<kQ4>::kBytes; line += 64)
      _mm_prefetch(c + line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + (g * w.B + b) * Packed<kQ4>::kScales),
                 _MM_HINT_T0);
  }
}

// `tile` over groups g and g + 1 of a q4 weight: out[r] = their 16 outputs of row m0 + r.
template <int R>
LOWBIT_INLINE void tile16(const Packed<true>& w, const Acts& x, int64_t g, int64_t m0,
                          __m512 out[R]) {
  constexpr int64_t kBytes = Packed<true>::kBytes, kScales = Packed<true>::kScales;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.B; ++b) {
    const uint8_t* wa = w.codes + (g * w.B + b) * kBytes;
    const uint8_t* wb = wa + w.B * kBytes;  // group g + 1, block b
    const uint16_t* sa = w.scales + (g * w.B + b) * kScales;
    const uint16_t* sb = sa + w.B * kScales;
    // the thread reads the two groups' blocks side by side: ask for the blocks kPrefetch bytes
    // ahead in that order (past block B - 1, the next pair's, which follows group g + 1)
    const int64_t ahead = b + kPrefetch / (2 * kBytes);
    const int64_t pg = ahead < w.B ? g : g + 2, pb = ahead < w.B ? ahead : ahead - w.B;
    prefetch_block(w, pg, pb);
    prefetch_block(w, pg + 1, pb);
    const int8_t* xb[R];
    __m512i sum[R], sum_hi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xb[r] = x.q.data() + (m0 + r) * x.K + b * kGroup;
      sum[r] = sum_hi[r] = _mm512_setzero_si512();
    }
    const __m512i low4 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = join2(wa + 32 * p, wb + 32 * p);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        sum[r] = dot16_at(sum[r], lo, xb[r] + 8 * p);
        sum_hi[r] = dot16_at(sum_hi[r], hi, xb[r] + 8 * p + 4);
      }
    }
    const __m512 dw = load16_half(sa, sb), m = load16_half(sa + 8, sb + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * x.B + b;
      const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[r], sum_hi[r]));
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[i]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#else
#define LOWBIT_PAIR_GROUPS 0
#endif

LOWBIT_INLINE void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#if LOWBIT_PAIR_GROUPS
LOWBIT_INLINE void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

// R rows x the 8 * G columns of groups g .. g + G - 1 into y: G = 1, `tile`; G = 2, `tile16`
// (the last group may be padded: only its real columns are written)
template <int R, int G, bool kQ4>
void group_rows(const Packed<kQ4>& w, const Acts& x, float* y, int64_t N, int64_t g, int64_t m0) {
  static_assert(G == 1 || G == 2, "one group or two");
  std::conditional_t<G == 1, __m256, __m512> out[R];
  if constexpr (G == 1) {
    tile<R>(w, x, g, m0, out);
  } else {
#if LOWBIT_PAIR_GROUPS
    tile16<R>(w, x, g, m0, out);
#endif
  }
  const int64_t n0 = 8 * g, width = std::min<int64_t>(8 * G, N - n0);
  for (int r = 0; r < R; ++r) {
    if (width == 8 * G) {
      store(y + (m0 + r) * N + n0, out[r]);
    } else {  // the last group of a width that is not a multiple of 8 (padded columns)
      alignas(64) float t[8 * G];
      store(t, out[r]);
      std::memcpy(y + (m0 + r) * N + n0, t, width * sizeof(float));
    }
  }
}

// the last `left` rows (at most R, none when 0), after the full tiles, as one tile
template <int R, int G, bool kQ4>
LOWBIT_INLINE void rows_left(const Packed<kQ4>& w, const Acts& x, float* y, int64_t N, int64_t g,
                             int64_t m0, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) group_rows<R, G>(w, x, y, N, g, m0);
    else rows_left<R - 1, G>(w, x, y, N, g, m0, left);
  }
}

// y [M, N] = x [M, K] @ W^T, into y. Groups of 8 columns (two a tile where they pair, above)
// split over ATen's threads; a group's codes (a few KB) stay in L1 while every tile of rows
// passes over them: tiles of 8 rows where the CPU has 32 vector registers (AVX-512VL; 8-row
// products 4-11% faster; -DLOWBIT_TILE8=0 builds without), then of 4. A last 1 or 2 rows join
// the 4 before them in one tile of 5 or 6, which unpacks the weights' nibbles once for all of
// them (5 and 6 rows' products ~8% faster at the median on an AVX2 EPYC; -DLOWBIT_TILE6=0
// builds without).
#ifndef LOWBIT_TILE6
#define LOWBIT_TILE6 1
#endif
template <bool kQ4>
void product(const Packed<kQ4>& w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const Acts a = quantize_rows(x, M, K);
  constexpr int64_t kLast = LOWBIT_TILE6 ? 6 : 4;  // the most rows of the last tile
  auto every_row = [&](auto groups, int64_t g) {  // all M rows of groups g .. g + G - 1
    constexpr int G = decltype(groups)::value;
    int64_t m = 0;
#if defined(__AVX512VL__) && (!defined(LOWBIT_TILE8) || LOWBIT_TILE8)
    for (; m + 8 <= M; m += 8) group_rows<8, G>(w, a, y, N, g, m);
#endif
    for (; M - m > kLast; m += 4) group_rows<4, G>(w, a, y, N, g, m);
    rows_left<kLast, G>(w, a, y, N, g, m, M - m);
  };
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t g0, int64_t g1) {
    int64_t g = g0;
#if LOWBIT_PAIR_GROUPS
    if constexpr (kQ4)  // two groups a tile (q4: the decoder layers); an odd last group below
      for (; M >= kPairRows && g + 2 <= g1; g += 2)
        every_row(std::integral_constant<int, 2>(), g);
#endif
    for (; g < g1; ++g) every_row(std::integral_constant<int, 1>(), g);
  });
}

const uint16_t* half_bits(const at::Tensor& scales) {
  return reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
}

Packed<true> q4_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t K) {
  return {codes.data_ptr<uint8_t>(), half_bits(scales), K / kGroup};
}

Packed<false> q8_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t K) {
  return {reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), half_bits(scales), K / kGroup};
}

template <bool kQ4>
at::Tensor product(const Packed<kQ4>& w, const at::Tensor& x, int64_t N) {
  auto out = at::empty({x.size(0), N}, x.options());
  product(w, x.data_ptr<float>(), x.size(0), x.size(1), N, out.data_ptr<float>());
  return out;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scales, int64_t N) {
  return product(q4_weight(codes, scales, x.size(1)), x, N);
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scales, int64_t N) {
  return product(q8_weight(codes, scales, x.size(1)), x, N);
}

// Lane k of the result = the sum of a[k]'s 8 lanes, each with the tree
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); `sum1` sums one vector the same way.
LOWBIT_INLINE __m256 sums8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

LOWBIT_INLINE float sum1(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// One decoder layer stack of a Llama-family target for one sequence, float32 activations (int8
// inside the products) and q4 weights (the fused form of `models/target.py`'s layers; `models/cpu_lowbit.py` decides when
// it applies). Per layer: RMSNorm, qkv, RoPE (rotate-half), KV rows [start, start+T) written
// in float16 (half the bytes a step reads from a long cache; llama.cpp's default KV type too),
// grouped-query attention over rows [0, start+T) with an additive bias, o_proj, residual,
// RMSNorm, gate_up, SiLU * up, down, residual. Each query row's numbers depend only on that
// row, the cache rows it sees and their order, never on the other rows of the call.
struct Dims {
  int64_t T, heads, kv_heads, hd, inter, S, max_len;
};

void rms_norm(const float* x, const float* w, float* out, int64_t T, int64_t H, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * H;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += double(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(float(ss / H) + eps);
    for (int64_t i = 0; i < H; ++i) out[t * H + i] = xr[i] * inv * w[i];
  }
}

void rope(float* x, const float* cos, const float* sin, int64_t T, int64_t stride,
          int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * stride + h * hd;
      const float* c = cos + t * hd;
      const float* s = sin + t * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

// One sequence's attention: q [T, heads*hd] (row stride qs) -> out [T, heads*hd]; k/v caches
// [kv_heads, max_len, hd] float16, widened to float32 as they are read. The query rows that
// share a kv head (its g heads x T tokens) go in tasks of up to 8, which pass over the keys and
// values in chunks of 64 that stay in L1 for all of them. A row's scores run over the cache
// rows up to its last visible one (the bias is -inf past it); masked keys weigh exactly 0. So a
// row's numbers do not depend on the other rows of the call, and a tree row equals the same
// token decoded alone after its path.
struct AttnSeq {
  const float* q;
  int64_t qs;
  const uint16_t* kc;  // float16 bits
  const uint16_t* vc;
  const float* bias;
  float* out;
  Dims d;
  int64_t kRows, tasks;  // rows per task, tasks per kv head
};

constexpr int64_t kMaxRows = 8, kChunk = 64;

// Attention takes a task's query rows in pairs where the CPU has 32 vector registers
// (AVX-512VL) for both rows' sums: each key and value vector is then widened once for two rows
// (tree verifies of 3-8 rows 3-12% faster; the same bits).
// -DLOWBIT_ROW_PAIRS=0 builds without.
#if defined(__AVX512VL__) && (!defined(LOWBIT_ROW_PAIRS) || LOWBIT_ROW_PAIRS)
#define LOWBIT_PAIRS 1
#else
#define LOWBIT_PAIRS 0
#endif

// A task takes two query rows at least where rows go in pairs: a one-token step's three heads
// of a kv head then run as a pair and a single, not as three singles.
constexpr int64_t kMinRows = LOWBIT_PAIRS ? 2 : 1;

// The keys and values a row reads stream from the cache (a long context's rows leave the
// caches between layers), and the hardware's prefetchers stop at each 4 KB page. Each group of
// keys asks for the rows kKvAhead keys ahead (a hint: addresses past the cache do not fault).
// With kMinRows, a one-token step at 1,200-2,000 tokens of context is 17-18% faster;
// -DLOWBIT_KV_AHEAD=0 turns the hints off.
#ifndef LOWBIT_KV_AHEAD
#define LOWBIT_KV_AHEAD 64
#endif
constexpr int64_t kKvAhead = LOWBIT_KV_AHEAD;

// Asks for the cache lines of n float16 cache rows (hd wide) kKvAhead rows past `rows`.
LOWBIT_INLINE void prefetch_kv(const uint16_t* rows, int64_t hd, int64_t n) {
  if constexpr (kKvAhead > 0) {
    const char* p = reinterpret_cast<const char*>(rows + kKvAhead * hd);
    for (int64_t line = 0; line < n * hd * 2; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
  }
}

// p[s] = q . key s for s in [s0, s1) (float16 key rows hd apart), 8 keys at a time from s0, then
// one at a time: `sums8` and `sum1` add the lanes alike, so a score has the same bits wherever
// its key lies.
void score_row(const float* q, const uint16_t* keys, int64_t hd, int64_t s0, int64_t s1,
               float* p) {
  const int64_t V = hd / 8;
  int64_t s = s0;
  for (; s + 8 <= s1; s += 8) {
    prefetch_kv(keys + s * hd, hd, 8);
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
    for (int64_t v = 0; v < V; ++v) {
      const __m256 qv = _mm256_loadu_ps(q + 8 * v);
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k)
        a[k] = _mm256_fmadd_ps(qv, load8_half(keys + (s + k) * hd + 8 * v), a[k]);
    }
    _mm256_storeu_ps(p + s, sums8(a));
  }
  for (; s < s1; ++s) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t v = 0; v < V; ++v)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), load8_half(keys + s * hd + 8 * v), a);
    p[s] = sum1(a);
  }
}

#if LOWBIT_PAIRS
// `score_row` for two query rows [s0, s1a) and [s0, s1b) that widen each key vector once for
// both (32 vector registers hold both rows' sums); each row gets `score_row`'s operations.
void score_pair(const float* qa, const float* qb, const uint16_t* keys, int64_t hd, int64_t s0,
                int64_t s1a, int64_t s1b, float* pa, float* pb) {
  const int64_t V = hd / 8, both = std::min(s1a, s1b);
  int64_t s = s0;
  for (; s + 8 <= both; s += 8) {
    prefetch_kv(keys + s * hd, hd, 8);
    __m256 a[8], b[8];
    for (int k = 0; k < 8; ++k) a[k] = b[k] = _mm256_setzero_ps();
    for (int64_t v = 0; v < V; ++v) {
      const __m256 qva = _mm256_loadu_ps(qa + 8 * v), qvb = _mm256_loadu_ps(qb + 8 * v);
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const __m256 key = load8_half(keys + (s + k) * hd + 8 * v);
        a[k] = _mm256_fmadd_ps(qva, key, a[k]);
        b[k] = _mm256_fmadd_ps(qvb, key, b[k]);
      }
    }
    _mm256_storeu_ps(pa + s, sums8(a));
    _mm256_storeu_ps(pb + s, sums8(b));
  }
  score_row(qa, keys, hd, s, s1a, pa);
  score_row(qb, keys, hd, s, s1b, pb);
}
#endif

// out [8V] += the sum over keys k in [k0, k1) of p[k] * v[k] (float16 value rows hd apart), and
// *total += the p[k], in key order (the softmax's denominator, summed while the adds wait on
// the products instead of in a loop of its own). The head width in vectors, V, is a
// compile-time constant so that the V sums stay in registers.
template <int V>
void weigh_values(const float* p, const uint16_t* v, int64_t hd, int64_t k0, int64_t k1,
                  float* out, float* total) {
  __m256 acc[V > 0 ? V : 1];
  float sum = *total;
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) acc[i] = _mm256_loadu_ps(out + 8 * i);
  for (int64_t k = k0; k < k1; ++k) {
    prefetch_kv(v + k * hd, hd, 1);
    if (p[k] == 0.f) continue;  // a masked key (adds nothing to either sum)
    sum += p[k];
    const __m256 pk = _mm256_set1_ps(p[k]);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i)
      acc[i] = _mm256_fmadd_ps(pk, load8_half(v + k * hd + 8 * i), acc[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
  *total = sum;
}

using WeighValues = void (*)(const float*, const uint16_t*, int64_t, int64_t, int64_t, float*,
                            float*);
template <int... V>
constexpr std::array<WeighValues, sizeof...(V)> weigh_table(std::integer_sequence<int, V...>) {
  return {&weigh_values<V>...};
}
constexpr auto kWeighValues = weigh_table(std::make_integer_sequence<int, 17>());  // hd <= 128

#if LOWBIT_PAIRS
// `weigh_values` for two rows over keys [k0, k1), widening each value vector once for both;
// each row gets `weigh_values`' operations in the same order (skipping its own masked keys).
template <int V>
void weigh_pair(const float* pa, const float* pb, const uint16_t* v, int64_t hd, int64_t k0,
                int64_t k1, float* outa, float* outb, float* totala, float* totalb) {
  __m256 a[V > 0 ? V : 1], b[V > 0 ? V : 1];
  float suma = *totala, sumb = *totalb;
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) {
    a[i] = _mm256_loadu_ps(outa + 8 * i);
    b[i] = _mm256_loadu_ps(outb + 8 * i);
  }
  for (int64_t k = k0; k < k1; ++k) {
    prefetch_kv(v + k * hd, hd, 1);
    const bool ua = pa[k] != 0.f, ub = pb[k] != 0.f;  // masked keys weigh 0: skipped
    if (ua) suma += pa[k];
    if (ub) sumb += pb[k];
    const __m256 wa = _mm256_set1_ps(pa[k]), wb = _mm256_set1_ps(pb[k]);
    if (ua && ub) {
#pragma GCC unroll 16
      for (int i = 0; i < V; ++i) {
        const __m256 value = load8_half(v + k * hd + 8 * i);
        a[i] = _mm256_fmadd_ps(wa, value, a[i]);
        b[i] = _mm256_fmadd_ps(wb, value, b[i]);
      }
    } else if (ua) {
#pragma GCC unroll 16
      for (int i = 0; i < V; ++i) a[i] = _mm256_fmadd_ps(wa, load8_half(v + k * hd + 8 * i), a[i]);
    } else if (ub) {
#pragma GCC unroll 16
      for (int i = 0; i < V; ++i) b[i] = _mm256_fmadd_ps(wb, load8_half(v + k * hd + 8 * i), b[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) {
    _mm256_storeu_ps(outa + 8 * i, a[i]);
    _mm256_storeu_ps(outb + 8 * i, b[i]);
  }
  *totala = suma;
  *totalb = sumb;
}

using WeighPair = void (*)(const float*, const float*, const uint16_t*, int64_t, int64_t, int64_t,
                           float*, float*, float*, float*);
template <int... V>
constexpr std::array<WeighPair, sizeof...(V)> pair_table(std::integer_sequence<int, V...>) {
  return {&weigh_pair<V>...};
}
constexpr auto kWeighPair = pair_table(std::make_integer_sequence<int, 17>());
#endif

AttnSeq attn_seq(const float* q, int64_t qs, const uint16_t* kc, const uint16_t* vc,
                 const float* bias, float* out, const Dims& d) {
  const int64_t rows = d.heads / d.kv_heads * d.T;
  // about 4 tasks a thread, so that no thread waits long for the last one
  const int64_t kRows =
      std::clamp<int64_t>(d.heads * d.T / (4 * at::get_num_threads()), kMinRows, kMaxRows);
  return {q, qs, kc, vc, bias, out, d, kRows, (rows + kRows - 1) / kRows};
}

// Every sequence's tasks in one parallel region (one wait for the threads, not one per sequence).
void attention(const std::vector<AttnSeq>& seqs) {
  std::vector<int64_t> first{0};  // first work item of each sequence
  int64_t longest_s = 0;
  for (const auto& a : seqs) {
    first.push_back(first.back() + a.d.kv_heads * a.tasks);
    longest_s = std::max(longest_s, a.d.S);
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(kMaxRows * longest_s);
    const float* qr[kMaxRows];
    const float* br[kMaxRows];
    float* orow[kMaxRows];
    int64_t end[kMaxRows];
    float total[kMaxRows];
    size_t n = 0;
    for (int64_t item = i0; item < i1; ++item) {
      while (item >= first[n + 1]) ++n;
      const AttnSeq& a = seqs[n];
      const Dims& d = a.d;
      const float *q = a.q, *bias = a.bias;
      const uint16_t *kc = a.kc, *vc = a.vc;
      const int64_t qs = a.qs, kRows = a.kRows, tasks = a.tasks, i = item - first[n];
      float* out = a.out;
      const int64_t g = d.heads / d.kv_heads, V = d.hd / 8, rows = g * d.T;
      const float scale = 1.f / std::sqrt(float(d.hd));
      const int64_t j = i / tasks, r0 = (i % tasks) * kRows, nr = std::min(kRows, rows - r0);
      const uint16_t* kh = kc + j * d.max_len * d.hd;
      const uint16_t* vh = vc + j * d.max_len * d.hd;
      int64_t longest = 0;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = j * g + (r0 + r) / d.T, t = (r0 + r) % d.T;
        qr[r] = q + t * qs + h * d.hd;
        orow[r] = out + t * d.heads * d.hd + h * d.hd;
        br[r] = bias ? bias + t * d.S : nullptr;
        end[r] = d.S;
        while (br[r] && end[r] > 1 && br[r][end[r] - 1] == -INFINITY) --end[r];
        longest = std::max(longest, end[r]);
      }
      // Rows in pairs where LOWBIT_PAIRS: a row's numbers are the same either way.
      for (int64_t c0 = 0; c0 < longest; c0 += kChunk)  // scores q . k
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t c1 = std::min(c0 + kChunk, end[r]);
#if LOWBIT_PAIRS
          if (r + 1 < nr) {
            score_pair(qr[r], qr[r + 1], kh, d.hd, c0, c1, std::min(c0 + kChunk, end[r + 1]),
                       scores.data() + r * d.S, scores.data() + (r + 1) * d.S);
            ++r;
            continue;
          }
#endif
          score_row(qr[r], kh, d.hd, c0, c1, scores.data() + r * d.S);
        }
      for (int64_t r = 0; r < nr; ++r) {  // softmax weights, unnormalized, 8 scores a vector
        // Every score goes through the same vector operations wherever it lies, and the total
        // adds the weights in key order, so a row's numbers do not depend on where its keys sit
        // (a tree row's keys have gaps that a decoded row's do not).
        float* p = scores.data() + r * d.S;
        const int64_t S = end[r], full = S / 8 * 8;
        alignas(32) float tail[8], tail_bias[8];  // the last S % 8 scores, padded: bias -inf
        for (int64_t k = 0; k < 8; ++k) {
          tail[k] = full + k < S ? p[full + k] : 0.f;
          tail_bias[k] = full + k < S ? (br[r] ? br[r][full + k] : 0.f) : -INFINITY;
        }
        const __m256 vscale = _mm256_set1_ps(scale);
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        for (int64_t s = 0; s < full; s += 8) {
          const __m256 x = _mm256_loadu_ps(p + s);  // score * scale + bias, one rounding
          const __m256 v = br[r] ? _mm256_fmadd_ps(x, vscale, _mm256_loadu_ps(br[r] + s))
                                 : _mm256_mul_ps(x, vscale);  // = fma(x, scale, 0)
          _mm256_storeu_ps(p + s, v);
          vmx = _mm256_max_ps(vmx, v);
        }
        const __m256 vt = _mm256_fmadd_ps(_mm256_load_ps(tail), vscale, _mm256_load_ps(tail_bias));
        vmx = _mm256_max_ps(vmx, vt);
        vmx = _mm256_set1_ps(hmax(vmx));
        for (int64_t s = 0; s < full; s += 8)
          _mm256_storeu_ps(p + s, vexp(_mm256_sub_ps(_mm256_loadu_ps(p + s), vmx)));
        _mm256_store_ps(tail, vexp(_mm256_sub_ps(vt, vmx)));
        for (int64_t k = 0; full + k < S; ++k) p[full + k] = tail[k];
        total[r] = 0.f;  // summed by `weigh` below
        std::memset(orow[r], 0, d.hd * sizeof(float));
      }
      const WeighValues weigh = kWeighValues[V];
      for (int64_t c0 = 0; c0 < longest; c0 += kChunk)  // weighted values, accumulated in out
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t c1 = std::min(c0 + kChunk, end[r]);
#if LOWBIT_PAIRS
          if (r + 1 < nr) {  // both rows to the shorter one's end, then each alone
            const float *pa = scores.data() + r * d.S, *pb = pa + d.S;
            const int64_t c1b = std::min(c0 + kChunk, end[r + 1]);
            const int64_t both = std::max(c0, std::min(c1, c1b));
            kWeighPair[V](pa, pb, vh, d.hd, c0, both, orow[r], orow[r + 1], &total[r],
                          &total[r + 1]);
            weigh(pa, vh, d.hd, both, c1, orow[r], &total[r]);
            weigh(pb, vh, d.hd, both, c1b, orow[r + 1], &total[r + 1]);
            ++r;
            continue;
          }
#endif
          weigh(scores.data() + r * d.S, vh, d.hd, c0, c1, orow[r], &total[r]);
        }
      for (int64_t r = 0; r < nr; ++r) {
        const __m256 inv = _mm256_set1_ps(1.f / total[r]);
        for (int64_t v = 0; v < V; ++v)
          _mm256_storeu_ps(orow[r] + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(orow[r] + 8 * v), inv));
      }
    }
  });
}

void add_into(float* h, const float* x, int64_t n) {  // h += x (the bits of ATen's add_)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) h[i] += x[i];
}

void silu_mul(const float* gu, float* out, int64_t T, int64_t I) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 g = _mm256_loadu_ps(gu + t * 2 * I + i), u = _mm256_loadu_ps(gu + t * 2 * I + I + i);
      const __m256 e = vexp(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
      _mm256_storeu_ps(out + t * I + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
           int64_t N, int64_t bytes, int64_t scales_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "x has ", x.size(1), " inputs; need a multiple of 32");
  const int64_t G = (N + 7) / 8, B = x.size(1) / kGroup;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == G &&
                  codes.size(1) == B && codes.size(2) == bytes,
              "codes must be contiguous [", G, ", ", B, ", ", bytes, "] for ", N, " outputs and ",
              x.size(1), " inputs, got ", codes.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == G * B * scales_per_block,
              "scales must be contiguous float16 with ", G * B * scales_per_block,
              " values, got ", scales.sizes());
}

}  // namespace

at::Tensor q4_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t N) {
  check(x, codes, scales, N, 128, 16);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "q4 codes must be uint8");
  return q4_matmul(x, codes, scales, N);
}

at::Tensor q8_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t N) {
  check(x, codes, scales, N, 256, 8);
  TORCH_CHECK(codes.scalar_type() == at::kChar, "q8 codes must be int8");
  return q8_matmul(x, codes, scales, N);
}

// A layer stack over the rows of one or more sequences (see `attention` above): the target's
// decoder layers (q4 codes, `embeds` empty) or an EAGLE-3 head's layers (q8 codes; its first
// layer reads cat(norm(embeds), norm(h)), 2H wide). h holds the sequences' rows one after the
// other: sequence i has lens[i] rows, written to its own cache kvs[i] from row starts[i] and
// attending under masks[i] (bool [lens[i], starts[i] + lens[i]], true = visible; turned into an
// additive bias of 0 / -inf here; or empty: every row visible).
// Every step but attention is row by row, and attention runs per sequence, so a sequence's
// numbers are the same whether it runs alone or with others (the scheduler's batched steps).
// weights, per layer in order: input norm, [the first head layer: hidden norm,] qkv codes, qkv
// scales, o codes, o scales, post-attention norm, gate_up codes, gate_up scales, down codes,
// down scales. Returns [h after the last layer [R, H], aux [R, len(aux_ids) * H]: the inputs
// of the layers `aux_ids` (ascending), h under the model's final RMSNorm `final_norm` [H] (the
// lm_head's input; a Python RMSNorm costs ~80 us a call as six ATen ops)].
std::vector<at::Tensor> fused_decoder(at::Tensor h, at::Tensor embeds, at::Tensor cos,
                                         at::Tensor sin, std::vector<at::Tensor> kvs,
                                         std::vector<int64_t> starts, std::vector<int64_t> lens,
                                         std::vector<at::Tensor> masks,
                                         std::vector<at::Tensor> weights,
                                         int64_t heads, int64_t kv_heads, double eps,
                                         std::vector<int64_t> aux_ids, bool q8,
                                         at::Tensor final_norm) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be [R, H] float32");
  const size_t n_seq = kvs.size();
  TORCH_CHECK(n_seq > 0 && starts.size() == n_seq && lens.size() == n_seq && masks.size() == n_seq,
              "one cache, start, length and mask per sequence");
  const bool draft = embeds.numel() > 0;
  const int64_t per_layer = 10, first = draft ? 11 : 10;
  TORCH_CHECK(weights.size() >= size_t(first) && (weights.size() - first) % per_layer == 0,
              "10 weight tensors per layer (11 for a head's first layer), got ", weights.size());
  h = h.contiguous().clone();
  const int64_t layers = 1 + (weights.size() - first) / per_layer;
  const int64_t T = h.size(0), H = h.size(1), hd = kvs[0].size(3);
  const int64_t inter = weights[first - 4].size(0) * 8 / 2;
  TORCH_CHECK(hd % 8 == 0 && hd <= 128, "head_dim ", hd, " unsupported");
  TORCH_CHECK(final_norm.numel() == H && final_norm.scalar_type() == at::kFloat &&
                  final_norm.is_contiguous(),
              "final_norm must be contiguous float32 [", H, "], got ", final_norm.sizes());
  TORCH_CHECK(inter % 8 == 0, "intermediate size unsupported");
  std::vector<Dims> dims;
  std::vector<int64_t> offsets;
  std::vector<std::vector<float>> biases(n_seq);  // [T * S] 0 where visible, -inf where not
  std::vector<const float*> bias_ptrs;
  int64_t rows = 0;
  for (size_t i = 0; i < n_seq; ++i) {
    const auto& kv = kvs[i];
    TORCH_CHECK(kv.is_contiguous() && kv.scalar_type() == at::kHalf &&
                    kv.size(0) == 2 * layers && kv.size(1) == kv_heads && kv.size(3) == hd,
                "kv must be contiguous float16 [2 * layers, kv_heads, max_len, head_dim], got ",
                kv.scalar_type(), " ", kv.sizes());
    Dims d{lens[i], heads, kv_heads, hd, inter, starts[i] + lens[i], kv.size(2)};
    TORCH_CHECK(d.T > 0 && d.S <= d.max_len, "rows past the cache");
    const float* b = nullptr;
    if (masks[i].numel()) {
      const auto& m = masks[i];
      TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kBool && m.dim() == 2 &&
                      m.size(0) == d.T && m.size(1) == d.S,
                  "mask must be contiguous bool [T, start + T] = [", d.T, ", ", d.S, "], got ",
                  m.scalar_type(), " ", m.sizes());
      const bool* visible = m.data_ptr<bool>();
      biases[i].resize(d.T * d.S);
      for (int64_t j = 0; j < d.T * d.S; ++j) biases[i][j] = visible[j] ? 0.f : -INFINITY;
      b = biases[i].data();
    }
    dims.push_back(d);
    offsets.push_back(rows);
    bias_ptrs.push_back(b);
    rows += d.T;
  }
  TORCH_CHECK(rows == T, "the sequences' lengths add up to ", rows, ", h has ", T, " rows");
  // packed weights of whole groups of 8 columns (`FusedDecoder.supports`): N = 8 * groups.
  // Every product writes into a buffer allocated once per call, and the residual adds run
  // here: ATen's empty and add_ cost ~1 and ~2.5 us a call, ~0.25 ms a one-token forward.
  auto mm = [q8, T](const float* x, int64_t K, const at::Tensor& codes,
                    const at::Tensor& s, float* y) {  // y [T, N] = x [T, K] @ W^T
    const int64_t N = codes.size(0) * 8;
    if (q8) product(q8_weight(codes, s, K), x, T, K, N, y);
    else product(q4_weight(codes, s, K), x, T, K, N, y);
  };
  const int64_t qkv_w = (heads + 2 * kv_heads) * hd;
  auto aux = at::empty({T, int64_t(aux_ids.size()) * H}, h.options());
  auto xn = at::empty({T, H}, h.options());
  auto attn = at::empty({T, heads * hd}, h.options());
  auto act = at::empty({T, inter}, h.options());
  auto qkv = at::empty({T, qkv_w}, h.options());
  auto gu = at::empty({T, 2 * inter}, h.options());
  auto proj = at::empty({T, H}, h.options());  // o_proj's and down's outputs
  float* hp = h.data_ptr<float>();
  float* qp = qkv.data_ptr<float>();
  float* pp = proj.data_ptr<float>();
  auto capture = [&](int64_t layer) {
    for (size_t a = 0; a < aux_ids.size(); ++a)
      if (aux_ids[a] == layer)
        for (int64_t t = 0; t < T; ++t)
          std::memcpy(aux.data_ptr<float>() + t * aux.size(1) + a * H, hp + t * H, H * 4);
  };
  const at::Tensor* w = weights.data();
  for (int64_t l = 0; l < layers; ++l) {
    capture(l);
    at::Tensor x = xn;
    if (draft && l == 0) {  // cat(input_layernorm(embeds), hidden_norm(h)) [T, 2H]
      auto e = at::empty({T, H}, h.options());
      rms_norm(embeds.contiguous().data_ptr<float>(), w[0].data_ptr<float>(),
               e.data_ptr<float>(), T, H, eps);
      rms_norm(hp, w[1].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
      x = at::cat({e, xn}, 1);
      ++w;
    } else {
      rms_norm(hp, w[0].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
    }
    mm(x.data_ptr<float>(), x.size(1), w[1], w[2], qp);  // qkv [T, qkv_w]
    rope(qp, cos.data_ptr<float>(), sin.data_ptr<float>(), T, qkv_w, heads + kv_heads, hd);
    std::vector<AttnSeq> parts;
    for (size_t i = 0; i < n_seq; ++i) {  // each sequence: its own cache rows and attention
      const Dims& d = dims[i];
      const float* qs = qp + offsets[i] * qkv_w;
      uint16_t* kc = reinterpret_cast<uint16_t*>(kvs[i].data_ptr<at::Half>()) +
                     (2 * l) * kv_heads * d.max_len * hd;
      uint16_t* vc = kc + kv_heads * d.max_len * hd;
      const int64_t start = starts[i];
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t j = 0; j < kv_heads; ++j) {
          store8_half(qs + t * qkv_w + (heads + j) * hd, kc + (j * d.max_len + start + t) * hd,
                      hd);
          store8_half(qs + t * qkv_w + (heads + kv_heads + j) * hd,
                      vc + (j * d.max_len + start + t) * hd, hd);
        }
      parts.push_back(attn_seq(qs, qkv_w, kc, vc, bias_ptrs[i],
                               attn.data_ptr<float>() + offsets[i] * heads * hd, d));
    }
    attention(parts);
    mm(attn.data_ptr<float>(), heads * hd, w[3], w[4], pp);
    add_into(hp, pp, T * H);
    rms_norm(hp, w[5].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
    mm(xn.data_ptr<float>(), H, w[6], w[7], gu.data_ptr<float>());
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), T, inter);
    mm(act.data_ptr<float>(), inter, w[8], w[9], pp);
    add_into(hp, pp, T * H);
    w += per_layer;
  }
  capture(layers);
  auto normed = at::empty({T, H}, h.options());
  rms_norm(hp, final_norm.data_ptr<float>(), normed.data_ptr<float>(), T, H, eps);
  return {h, aux, normed};
}

// The number of tokens a head step runs over: tokens must be a non-empty 1-D int64 tensor.
static int64_t token_rows(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.size(0) > 0,
              "tokens must be a non-empty 1-D int64 tensor, got ", tokens.scalar_type(), " ",
              tokens.sizes());
  return tokens.size(0);
}

// An EAGLE-3 head's layers and lm_head over T rows, the common part of `head_extend` and
// `head_level`: h [T, H] (after `fc`, or the recycled hidden), the rows' tokens [T], their RoPE
// rows cos / sin [T, head_dim], cache rows [start, start + T), visible [T, start + T] bool
// (empty: every row). The lm_head runs on the last row (every_row false) or on each row (R = 1
// or T). Returns [top-k probabilities [R, k] float32, their target ids [R, k] int64, the
// recycled hidden [R, H]: h after the layers, or h under the final norm with `norm_output`].
static std::vector<at::Tensor> head_rows(at::Tensor h, at::Tensor tokens, at::Tensor embedding,
                                         at::Tensor cos, at::Tensor sin, at::Tensor kv,
                                         int64_t start, at::Tensor visible,
                                         const std::vector<at::Tensor>& weights, int64_t heads,
                                         int64_t kv_heads, double eps, at::Tensor final_norm,
                                         bool norm_output, at::Tensor lm_codes,
                                         at::Tensor lm_scales, int64_t vocab, at::Tensor d2t,
                                         int64_t topk, bool every_row) {
  const int64_t T = tokens.size(0), R = every_row ? T : 1;
  at::Tensor embeds = embedding.index_select(0, tokens);  // [T, H]
  auto out = fused_decoder(h, embeds, cos, sin, {kv}, {start}, {T}, {visible}, weights, heads,
                           kv_heads, eps, {}, true, final_norm);  // [h, aux (none), normed]
  at::Tensor logits = q8_linear(out[2].narrow(0, T - R, R), lm_codes, lm_scales, vocab);
  auto [probs, ids] = logits.softmax(-1).topk(topk, -1);  // [R, k] each, the most likely first
  return {probs, ids.add(d2t.index_select(0, ids.flatten()).view_as(ids)),
          out[norm_output ? 2 : 0].narrow(0, T - R, R).clone()};
}

// An EAGLE-3 head's draft extend in one call, for a head whose linears are q8 codes
// (`accept.extend` on a CPU; `accept.extend_forward`, its Python steps over the same kernels,
// is the reference, and the result has the same bits): the target features through `fc` (no `fc`
// codes: a head without aux states, whose features are its hidden already), the tokens'
// embeddings, `fused_decoder` over rows [start, start + T) of the head's cache under the causal
// mask, the lm_head on the last row, then the top-k of its softmax, mapped to target ids.
// Called from Python as ~25 small steps, this costs ~0.7 ms an iteration on top of the products
// on a 2-core AVX2 CPU. tokens [T] int64; features [T, W] float32; fc_norms: none, or one
// RMSNorm weight [W / A] float32 for each of the A chunks of the features, applied before `fc`
// as `Eagle3Draft.project` applies them (EAGLE-3.1's `fc_norm`); embedding [V, H] float32;
// cos / sin [max_len, head_dim], the head's RoPE tables; kv, weights, heads, kv_heads, eps and
// final_norm as for `fused_decoder`; d2t [Vd] int64, a draft id's offset to its target id.
// Returns [top-k probabilities [k] float32, their target ids [k] int64, the recycled hidden of
// the last row [H]: h after the layers, or h under the final norm with `norm_output`].
std::vector<at::Tensor> head_extend(at::Tensor tokens, at::Tensor features, at::Tensor fc_codes,
                                    at::Tensor fc_scales, std::vector<at::Tensor> fc_norms,
                                    at::Tensor embedding, at::Tensor cos,
                                    at::Tensor sin, at::Tensor kv, int64_t start,
                                    std::vector<at::Tensor> weights, int64_t heads,
                                    int64_t kv_heads, double eps, at::Tensor final_norm,
                                    bool norm_output, at::Tensor lm_codes, at::Tensor lm_scales,
                                    int64_t vocab, at::Tensor d2t, int64_t topk) {
  const int64_t T = token_rows(tokens), H = final_norm.numel();
  TORCH_CHECK(features.dim() == 2 && features.size(0) == T, "features must be [", T,
              ", width], got ", features.sizes());
  TORCH_CHECK(start >= 0 && start + T <= cos.size(0), "rows [", start, ", ", start + T,
              ") past the RoPE table's ", cos.size(0));
  at::Tensor h = features.contiguous();
  if (!fc_norms.empty()) {  // the ops of `Eagle3Draft.project`, so the same bits
    const int64_t A = static_cast<int64_t>(fc_norms.size()), chunk = h.size(1) / A;
    TORCH_CHECK(chunk * A == h.size(1), "features of width ", h.size(1), " do not split into ",
                A, " fc_norm chunks");
    std::vector<at::Tensor> normed;
    for (int64_t a = 0; a < A; ++a)
      normed.push_back(at::rms_norm(h.narrow(1, a * chunk, chunk), {chunk}, fc_norms[a], eps));
    h = at::cat(normed, 1);  // [T, W]
  }
  if (fc_codes.numel()) h = q8_linear(h, fc_codes, fc_scales, H);  // [T, H]
  at::Tensor visible = at::empty({0}, tokens.options().dtype(at::kBool));
  if (T > 1) {  // row t sees cache rows [0, start + t]; one row sees every row
    visible = at::empty({T, start + T}, visible.options());
    bool* v = visible.data_ptr<bool>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < start + T; ++j) v[t * (start + T) + j] = j <= start + t;
  }
  auto out = head_rows(h, tokens, embedding, cos.narrow(0, start, T), sin.narrow(0, start, T),
                       kv, start, visible, weights, heads, kv_heads, eps, final_norm,
                       norm_output, lm_codes, lm_scales, vocab, d2t, topk, false);
  return {out[0][0], out[1][0], out[2][0]};
}

// One draft decode step of an EAGLE-3 head, the level `head_draft_tree` runs K nodes at a time:
// the frontier's K tokens [K] and recycled hidden [K, H] at one position (`position`, the same
// for every node: its depth past the committed length), written to cache rows [start, start +
// K) and seeing what visible [K, start + K] bool allows (the committed rows, each node's
// ancestors, itself), the lm_head on every row, then each row's top-k of its softmax, mapped to
// target ids. Returns [top-k probabilities [K, k] float32, their target ids [K, k] int64, the
// recycled hidden [K, H]].
static std::vector<at::Tensor> head_level(at::Tensor tokens, at::Tensor hidden,
                                          at::Tensor embedding, at::Tensor cos, at::Tensor sin,
                                          int64_t position, at::Tensor kv, int64_t start,
                                          at::Tensor visible,
                                          const std::vector<at::Tensor>& weights,
                                          int64_t heads, int64_t kv_heads, double eps,
                                          at::Tensor final_norm, bool norm_output,
                                          at::Tensor lm_codes, at::Tensor lm_scales,
                                          int64_t vocab, at::Tensor d2t, int64_t topk) {
  const int64_t K = tokens.size(0);
  at::Tensor c = cos.narrow(0, position, 1).expand({K, -1}).contiguous();  // [K, head_dim]
  at::Tensor s = sin.narrow(0, position, 1).expand({K, -1}).contiguous();
  return head_rows(hidden, tokens, embedding, c, s, kv, start, visible, weights, heads, kv_heads,
                   eps, final_norm, norm_output, lm_codes, lm_scales, vocab, d2t, topk, true);
}

// An EAGLE-3 head's whole draft in one call (`draft.draft` on a CPU, for the heads `head_extend`
// serves except that `fc` plays no part; `draft.draft_levels`, a Python loop of draft forwards,
// `top_children` and `expand`, is the reference, with the same bits): the extend's top-k (level 1:
// probabilities topk_p [K] float32, target ids topk_ids [K] int64, the recycled hidden [H]), then
// `steps - 1` levels, each a decode step over the K best paths so far (`head_level`, at position
// seq + level, cache rows seq + level * K onwards, each node seeing the committed rows, its
// ancestors and itself) and the expansion to their K * K children, whose K best paths are the next
// level's frontier. The levels stop once the frontier's best path scores below step_cut (0: never;
// `draft.going_on`). Candidate layout as `draft.Frontier`'s. The expansion's ~25 small torch steps
// from Python cost ~0.2 ms a level on a 2-core AVX-512 CPU, ~4% of a k2 s2 n5 iteration; here too
// the top-k of the paths is `at::topk`, so ties fall as they do in Python. Returns [scores [C]
// float32 (cumulative path probabilities), tokens [C] int64 (target ids), parents [C] int64
// (candidate index, -1 below the root)], C = K + (L - 1) * K * K for the L levels that ran (L =
// steps without a step cut).
std::vector<at::Tensor> head_draft_tree(at::Tensor topk_p, at::Tensor topk_ids, at::Tensor hidden,
                                        int64_t seq, int64_t steps, at::Tensor embedding,
                                        at::Tensor cos, at::Tensor sin, at::Tensor kv,
                                        std::vector<at::Tensor> weights, int64_t heads,
                                        int64_t kv_heads, double eps, at::Tensor final_norm,
                                        bool norm_output, at::Tensor lm_codes,
                                        at::Tensor lm_scales, int64_t vocab, at::Tensor d2t,
                                        double step_cut) {
  const int64_t K = token_rows(topk_ids), H = final_norm.numel();
  TORCH_CHECK(topk_p.dim() == 1 && topk_p.size(0) == K && topk_p.scalar_type() == at::kFloat,
              "topk_p must be [", K, "] float32, got ", topk_p.scalar_type(), " ",
              topk_p.sizes());
  TORCH_CHECK(hidden.dim() == 1 && hidden.size(0) == H, "hidden must be [", H, "], got ",
              hidden.sizes());
  TORCH_CHECK(steps >= 1 && seq >= 0, "steps must be >= 1 and seq >= 0, got ", steps, " and ",
              seq);
  TORCH_CHECK(seq + steps - 1 <= cos.size(0), "draft positions up to ", seq + steps - 2,
              " past the RoPE table's ", cos.size(0));
  TORCH_CHECK(seq + (steps - 1) * K <= kv.size(2), "draft rows up to ", seq + (steps - 1) * K,
              " past the head cache's ", kv.size(2));
  const auto long_opts = topk_ids.options();
  std::vector<at::Tensor> scores{topk_p.contiguous()}, tokens{topk_ids.contiguous()},
      parents{at::full({K}, -1, long_opts)};
  // the frontier: its nodes' candidate indices, path scores, tokens, hidden and ancestry
  // (anc[r * (levels * K) + j]: scratch row seq + j is an ancestor of node r)
  std::vector<int64_t> index(K);
  for (int64_t r = 0; r < K; ++r) index[r] = r;
  at::Tensor score = scores[0], ids = tokens[0];
  at::Tensor h = hidden.contiguous().expand({K, H}).contiguous();  // [K, H]
  std::vector<uint8_t> anc;
  int64_t offset = K;
  for (int64_t level = 0; level + 1 < steps; ++level) {
    // the best path, read in place (no op: `sync_count` counts none); compared in double, as
    // Python compares
    const float* path_scores = score.data_ptr<float>();
    if (step_cut > 0 && double(*std::max_element(path_scores, path_scores + K)) < step_cut)
      break;
    const int64_t start = seq + level * K, width = start + K;
    at::Tensor visible = at::empty({K, width}, long_opts.dtype(at::kBool));  // [K, start + K]
    bool* v = visible.data_ptr<bool>();
    for (int64_t r = 0; r < K; ++r) {
      bool* row = v + r * width;
      std::fill(row, row + seq, true);
      for (int64_t j = 0; j < level * K; ++j) row[seq + j] = anc[r * level * K + j];
      for (int64_t j = 0; j < K; ++j) row[start + j] = j == r;
    }
    auto ch = head_level(ids, h, embedding, cos, sin, seq + level, kv, start, visible, weights,
                         heads, kv_heads, eps, final_norm, norm_output, lm_codes, lm_scales,
                         vocab, d2t, K);  // [child probabilities [K, K], target ids [K, K], h]
    at::Tensor path = score.unsqueeze(1).mul(ch[0]).flatten();  // [K * K] cumulative probability
    at::Tensor level_parents = at::empty({K * K}, long_opts);
    int64_t* lp = level_parents.data_ptr<int64_t>();
    for (int64_t j = 0; j < K * K; ++j) lp[j] = index[j / K];
    at::Tensor level_tokens = ch[1].flatten();
    scores.push_back(path);
    tokens.push_back(level_tokens);
    parents.push_back(level_parents);
    auto [best_score, best] = path.topk(K);  // the next frontier: the K best paths
    const int64_t* b = best.data_ptr<int64_t>();
    std::vector<int64_t> slot(K);
    std::vector<uint8_t> next_anc(K * (level + 1) * K);
    for (int64_t r = 0; r < K; ++r) {
      slot[r] = b[r] / K;  // the frontier node it hangs below
      index[r] = offset + b[r];
      uint8_t* row = next_anc.data() + r * (level + 1) * K;
      std::copy_n(anc.data() + slot[r] * level * K, level * K, row);
      for (int64_t j = 0; j < K; ++j) row[level * K + j] = j == slot[r];
    }
    anc = std::move(next_anc);
    score = best_score;
    ids = level_tokens.index_select(0, best);
    h = ch[2].index_select(0, at::from_blob(slot.data(), {K}, long_opts.device(at::kCPU)));
    offset += K * K;
  }
  return {at::cat(scores), at::cat(tokens), at::cat(parents)};
}

void register_step(pybind11::module& m);  // cpu_step.cpp, built into the same module

// The products and the layers let go of Python's lock while they run (they touch no Python
// object; pybind11 converts the arguments before and the results after): a prefill or a verify
// holds up no other thread, such as the web server streaming the first token of an answer while
// the head reads the prompt. The per-iteration steps of cpu_step.cpp take microseconds and keep
// the lock.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using unlocked = pybind11::call_guard<pybind11::gil_scoped_release>;
  register_step(m);
  m.def("q4_linear", &q4_linear, unlocked(), "x [M, K] f32 @ packed q4 weight [N, K]^T -> [M, N]");
  m.def("q8_linear", &q8_linear, unlocked(), "x [M, K] f32 @ packed q8 weight [N, K]^T -> [M, N]");
  m.def("fused_decoder", &fused_decoder, unlocked(), "fused q4 target / q8 head layers over the rows of one or more sequences");
  m.def("head_extend", &head_extend, unlocked(), "an EAGLE-3 head's q8 draft extend: fc, layers, lm_head, top-k");
  m.def("head_draft_tree", &head_draft_tree, unlocked(), "an EAGLE-3 head's q8 draft: its decode steps over the best paths and their expansion");
}
