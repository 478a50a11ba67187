// Low-bit weight x fp32 activation products for the CPU: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Weights stay in GGUF block formats, 32 inputs per block:
//   q4: codes [N, K/2] uint8 (byte j of a block = input j in the low nibble, input j+16 in the
//       high nibble, as in a Q4_1 block) and dm [N, K/32, 2] float (scale d, minimum m):
//       w = d * q + m.
//   q8: codes [N, K] int8 and d [N, K/32] float: w = d * q (a Q8_0 block).
// Each weight block is unpacked once per tile of up to 8 (AVX-512) or 4 (AVX2) activation rows
// (register-blocked over rows and output columns), so the cost of a call grows with the rows far
// slower than unpacking per row would; from 32 rows on (a prefill) the weight is unpacked once
// into a dense matrix for one GEMM. Every output is summed in the same order whatever the number of
// rows or the tile it falls in: row r of a call equals that row computed alone, bit for bit
// (a tree verify of N < 32 tokens gives the same numbers as N one-token decodes). The columns are
// split over ATen's threads. Without AVX2 + FMA a scalar loop computes the same products
// (in another summation order).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOWBIT_SIMD 1
#endif

namespace {

constexpr int64_t kGroup = 32;

#ifdef LOWBIT_SIMD
#define LOWBIT_INLINE __attribute__((always_inline)) inline

#ifdef __AVX512F__
// A block's 32 weights as 2 x 16 floats; tiles of up to 8 activation rows.
struct Simd {
  using F = __m512;
  static constexpr int kVecs = 2, kLanes = 16, kMaxRows = 8;

  static LOWBIT_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static LOWBIT_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static LOWBIT_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static LOWBIT_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static LOWBIT_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static LOWBIT_INLINE F max(F a, F b) { return _mm512_max_ps(a, b); }
  static LOWBIT_INLINE F min(F a, F b) { return _mm512_min_ps(a, b); }
  static LOWBIT_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static LOWBIT_INLINE F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static LOWBIT_INLINE F zero_below(F v, F x, float t) {  // v where x >= t, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GE_OQ), v);
  }
  static LOWBIT_INLINE F pow2(F n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static LOWBIT_INLINE F zero() { return _mm512_setzero_ps(); }
  static LOWBIT_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static LOWBIT_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static LOWBIT_INLINE float sum(F a, F b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  static LOWBIT_INLINE void q4(const uint8_t* codes, float d, float m, F w[kVecs]) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const F vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4))), vd, vm);
    w[1] = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4))), vd, vm);
  }
  static LOWBIT_INLINE void q8(const int8_t* codes, float d, F w[kVecs]) {
    const F vd = _mm512_set1_ps(d);
    for (int j = 0; j < kVecs; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j));
      w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vd);
    }
  }
};
#else
// A block's 32 weights as 4 x 8 floats; tiles of up to 4 activation rows.
struct Simd {
  using F = __m256;
  static constexpr int kVecs = 4, kLanes = 8, kMaxRows = 4;

  static LOWBIT_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static LOWBIT_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static LOWBIT_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static LOWBIT_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static LOWBIT_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static LOWBIT_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }
  static LOWBIT_INLINE F min(F a, F b) { return _mm256_min_ps(a, b); }
  static LOWBIT_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static LOWBIT_INLINE F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static LOWBIT_INLINE F zero_below(F v, F x, float t) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GE_OQ));
  }
  static LOWBIT_INLINE F pow2(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static LOWBIT_INLINE F zero() { return _mm256_setzero_ps(); }
  static LOWBIT_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static LOWBIT_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static LOWBIT_INLINE float sum(F a, F b) {
    const __m256 s = _mm256_add_ps(a, b);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  static LOWBIT_INLINE F widen(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
  static LOWBIT_INLINE void q4(const uint8_t* codes, float d, float m, F w[kVecs]) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    const F vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(widen(lo), vd, vm);
    w[1] = _mm256_fmadd_ps(widen(_mm_srli_si128(lo, 8)), vd, vm);
    w[2] = _mm256_fmadd_ps(widen(hi), vd, vm);
    w[3] = _mm256_fmadd_ps(widen(_mm_srli_si128(hi, 8)), vd, vm);
  }
  static LOWBIT_INLINE void q8(const int8_t* codes, float d, F w[kVecs]) {
    const F vd = _mm256_set1_ps(d);
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd);
    }
  }
};
#endif
using F = Simd::F;

struct Q4Blocks {
  const uint8_t* codes;
  const float* dm;
  int64_t blocks;  // K / 32
  LOWBIT_INLINE void unpack(int64_t n, int64_t b, F w[Simd::kVecs]) const {
    const int64_t i = n * blocks + b;
    Simd::q4(codes + i * 16, dm[2 * i], dm[2 * i + 1], w);
  }
};

struct Q8Blocks {
  const int8_t* codes;
  const float* d;
  int64_t blocks;
  LOWBIT_INLINE void unpack(int64_t n, int64_t b, F w[Simd::kVecs]) const {
    const int64_t i = n * blocks + b;
    Simd::q8(codes + i * kGroup, d[i], w);
  }
};

// R activation rows x C output columns. Every output has two accumulators (the first and the
// second half of each block), so it sees the same sequence of operations for any R and C.
template <int R, int C, class W>
LOWBIT_INLINE void tile(const W& w, const float* x, int64_t K, float* y, int64_t N, int64_t n0) {
  constexpr int V = Simd::kVecs, L = Simd::kLanes;
  F acc[C][R][2];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = Simd::zero();
  for (int64_t b = 0; b < w.blocks; ++b) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      F v[V];
      w.unpack(n0 + c, b, v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + b * kGroup;
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j)
          acc[c][r][2 * j / V] = Simd::fmadd(v[j], Simd::load(xr + j * L), acc[c][r][2 * j / V]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n0 + c] = Simd::sum(acc[c][r][0], acc[c][r][1]);
}

template <int R, class W>
void rows(const W& w, const float* x, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int C = R >= 4 ? 1 : 4 / R;  // keep about 8 accumulators in registers
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<R, C>(w, x, K, y, N, n);
  for (; n < n1; ++n) tile<R, 1>(w, x, K, y, N, n);
}

template <class W>
void matmul(const W& w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  constexpr int T = Simd::kMaxRows;
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t c0, int64_t c1) {
    const int64_t n0 = c0 * 4, n1 = std::min(N, c1 * 4);
    int64_t m = 0;
    for (; m + T <= M; m += T) rows<T>(w, x + m * K, K, y + m * N, N, n0, n1);
    for (; m + 4 <= M; m += 4) rows<4>(w, x + m * K, K, y + m * N, N, n0, n1);
    const int64_t left = M - m;
    if (left == 3) rows<3>(w, x + m * K, K, y + m * N, N, n0, n1);
    if (left == 2) rows<2>(w, x + m * K, K, y + m * N, N, n0, n1);
    if (left == 1) rows<1>(w, x + m * K, K, y + m * N, N, n0, n1);
  });
}

// Many rows (a prefill): unpack the weight once into a dense float matrix and run one GEMM.
constexpr int64_t kDenseRows = 32;

template <class W>
torch::Tensor product(const W& w, const torch::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M >= kDenseRows) {
    auto dense = torch::empty({N, K}, x.options());
    float* p = dense.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < w.blocks; ++b) {
          F v[Simd::kVecs];
          w.unpack(n, b, v);
          for (int j = 0; j < Simd::kVecs; ++j)
            Simd::store(p + n * K + b * kGroup + j * Simd::kLanes, v[j]);
        }
    });
    return at::mm(x, dense.t());
  }
  auto y = torch::empty({M, N}, x.options());
  matmul(w, x.data_ptr<float>(), M, K, y.data_ptr<float>(), N);
  return y;
}

// exp(x) per lane (Cephes-style range reduction and a degree-6 polynomial, ~2 ulp); exactly 0
// below -86 (so -inf scores of masked keys add nothing at all, and no result is a denormal,
// which would make every later product with it slow).
LOWBIT_INLINE F vexp(F x) {
  const F clamped = Simd::max(x, Simd::set1(-86.f));
  const F t = Simd::min(clamped, Simd::set1(88.3f));
  const F n = Simd::round(Simd::mul(t, Simd::set1(1.44269504088896341f)));
  F r = Simd::fmadd(n, Simd::set1(-0.693359375f), t);
  r = Simd::fmadd(n, Simd::set1(2.12194440e-4f), r);
  F p = Simd::set1(1.f / 720);
  p = Simd::fmadd(p, r, Simd::set1(1.f / 120));
  p = Simd::fmadd(p, r, Simd::set1(1.f / 24));
  p = Simd::fmadd(p, r, Simd::set1(1.f / 6));
  p = Simd::fmadd(p, r, Simd::set1(0.5f));
  p = Simd::fmadd(p, r, Simd::set1(1.f));
  p = Simd::fmadd(p, r, Simd::set1(1.f));
  return Simd::zero_below(Simd::mul(p, Simd::pow2(n)), x, -86.f);
}

// One decoder layer stack of a Llama-family target for one sequence, fp32 activations and q4
// weights (the fused form of `models/target.py`'s layers; `models/cpu_lowbit.py` decides when
// it applies). Per layer: RMSNorm, qkv, RoPE (rotate-half), KV rows [start, start+T) written,
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

// q [T, heads*hd] (row stride qs) -> out [T, heads*hd]; k/v caches [kv_heads, max_len, hd]
void attention(const float* q, int64_t qs, const float* kc, const float* vc, const float* bias,
               float* out, const Dims& d) {
  const int64_t g = d.heads / d.kv_heads, L = Simd::kLanes, V = d.hd / L;
  const float scale = 1.f / std::sqrt(float(d.hd));
  at::parallel_for(0, d.heads * d.T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(d.S + L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / d.T, t = i % d.T;
      const float* qh = q + t * qs + h * d.hd;
      const float* kh = kc + (h / g) * d.max_len * d.hd;
      const float* vh = vc + (h / g) * d.max_len * d.hd;
      const float* b = bias ? bias + t * d.S : nullptr;
      float mx = -INFINITY;
      for (int64_t s = 0; s < d.S; ++s) {
        if (b && b[s] == -INFINITY) {
          p[s] = -INFINITY;
          continue;
        }
        F acc = Simd::zero();
        for (int64_t j = 0; j < V; ++j)
          acc = Simd::fmadd(Simd::load(qh + j * L), Simd::load(kh + s * d.hd + j * L), acc);
        p[s] = Simd::sum(acc, Simd::zero()) * scale + (b ? b[s] : 0.f);
        mx = std::max(mx, p[s]);
      }
      const F vmx = Simd::set1(mx);
      int64_t s = 0;
      for (; s + L <= d.S; s += L) Simd::store(&p[s], vexp(Simd::sub(Simd::load(&p[s]), vmx)));
      if (s < d.S) {  // tail: pad with -inf (exp -> 0) through a scratch vector
        float tail[64];
        for (int64_t j = 0; j < L; ++j) tail[j] = s + j < d.S ? p[s + j] : -INFINITY;
        Simd::store(tail, vexp(Simd::sub(Simd::load(tail), vmx)));
        for (int64_t j = 0; s + j < d.S; ++j) p[s + j] = tail[j];
      }
      float total = 0.f;
      for (int64_t k = 0; k < d.S; ++k) total += p[k];
      F acc[8];
      for (int64_t j = 0; j < V; ++j) acc[j] = Simd::zero();
      for (int64_t k = 0; k < d.S; ++k) {
        if (p[k] == 0.f) continue;
        const F pk = Simd::set1(p[k]);
        for (int64_t j = 0; j < V; ++j)
          acc[j] = Simd::fmadd(pk, Simd::load(vh + k * d.hd + j * L), acc[j]);
      }
      const F inv = Simd::set1(1.f / total);
      float* o = out + t * d.heads * d.hd + h * d.hd;
      for (int64_t j = 0; j < V; ++j) Simd::store(o + j * L, Simd::mul(acc[j], inv));
    }
  });
}

void silu_mul(const float* gu, float* out, int64_t T, int64_t I) {
  const int64_t L = Simd::kLanes;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; i += L) {
      const F g = Simd::load(gu + t * 2 * I + i), u = Simd::load(gu + t * 2 * I + I + i);
      const F e = vexp(Simd::sub(Simd::zero(), g));
      const F sig = Simd::div(Simd::set1(1.f), Simd::add(Simd::set1(1.f), e));
      Simd::store(out + t * I + i, Simd::mul(Simd::mul(g, sig), u));
    }
}

torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& dm) {
  return product(Q4Blocks{codes.data_ptr<uint8_t>(), dm.data_ptr<float>(), x.size(1) / kGroup},
                 x, codes.size(0));
}
#else
template <class Weight>
void scalar_matmul(Weight weight, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r = 0; r < M; ++r) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += weight(n, k) * x[r * K + k];
        y[r * N + n] = s;
      }
  });
}
#endif

void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
           int64_t codes_per_row, int64_t scales_per_row) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "x has ", x.size(1), " inputs; need a multiple of 32");
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == codes_per_row,
              "codes must be contiguous [N, ", codes_per_row, "], got ", codes.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  scales.numel() == codes.size(0) * scales_per_row,
              "scales must be contiguous float32 with ", codes.size(0) * scales_per_row,
              " values, got ", scales.sizes());
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor dm) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check(x, codes, dm, K / 2, 2 * (K / kGroup));
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "q4 codes must be uint8");
#ifdef LOWBIT_SIMD
  return q4_matmul(x, codes, dm);
#else
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float* s = dm.data_ptr<float>();
  scalar_matmul([=](int64_t n, int64_t k) {
    const int64_t b = n * (K / kGroup) + k / kGroup, j = k % kGroup;
    const uint8_t byte = q[b * 16 + (j % 16)];
    return s[2 * b] * float(j < 16 ? byte & 15 : byte >> 4) + s[2 * b + 1];
  }, x.data_ptr<float>(), M, K, y.data_ptr<float>(), N);
  return y;
#endif
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check(x, codes, d, K, K / kGroup);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "q8 codes must be int8");
#ifdef LOWBIT_SIMD
  return product(Q8Blocks{codes.data_ptr<int8_t>(), d.data_ptr<float>(), K / kGroup}, x, N);
#else
  auto y = torch::empty({M, N}, x.options());
  const int8_t* q = codes.data_ptr<int8_t>();
  const float* s = d.data_ptr<float>();
  scalar_matmul([=](int64_t n, int64_t k) {
    return s[n * (K / kGroup) + k / kGroup] * float(q[n * K + k]);
  }, x.data_ptr<float>(), M, K, y.data_ptr<float>(), N);
  return y;
#endif
}


// A layer stack for one sequence (see `attention` above): the target's decoder layers (q4
// codes, `embeds` empty) or an EAGLE-3 head's layers (q8 codes; its first layer reads
// cat(norm(embeds), norm(h)), 2H wide). weights, per layer in order: input norm, [the first
// head layer: hidden norm,] qkv codes, qkv scales, o codes, o scales, post-attention norm,
// gate_up codes, gate_up scales, down codes, down scales. Returns [h after the last layer
// [T, H], aux [T, len(aux_ids) * H]: the inputs of the layers `aux_ids` (ascending)].
std::vector<torch::Tensor> fused_decoder(torch::Tensor h, torch::Tensor embeds, torch::Tensor cos,
                                         torch::Tensor sin, torch::Tensor kv, int64_t start,
                                         torch::Tensor bias, std::vector<torch::Tensor> weights,
                                         int64_t heads, int64_t kv_heads, double eps,
                                         std::vector<int64_t> aux_ids, bool q8) {
#ifdef LOWBIT_SIMD
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat, "h must be [T, H] float32");
  const bool draft = embeds.numel() > 0;
  const int64_t per_layer = 10, first = draft ? 11 : 10;
  TORCH_CHECK(weights.size() >= size_t(first) && (weights.size() - first) % per_layer == 0,
              "10 weight tensors per layer (11 for a head's first layer), got ", weights.size());
  h = h.contiguous().clone();
  const int64_t layers = 1 + (weights.size() - first) / per_layer;
  const int64_t T = h.size(0), H = h.size(1), hd = kv.size(3);
  TORCH_CHECK(kv.is_contiguous() && kv.size(0) == 2 * layers && kv.size(1) == kv_heads,
              "kv must be contiguous [2 * layers, kv_heads, max_len, head_dim]");
  TORCH_CHECK(hd % Simd::kLanes == 0 && hd <= 8 * Simd::kLanes, "head_dim ", hd, " unsupported");
  Dims d{T, heads, kv_heads, hd, weights[first - 4].size(0) / 2, start + T, kv.size(2)};
  TORCH_CHECK(d.S <= d.max_len, "rows past the cache");
  TORCH_CHECK(d.inter % Simd::kLanes == 0, "intermediate size unsupported");
  const float* b = nullptr;
  if (bias.numel()) {
    TORCH_CHECK(bias.is_contiguous() && bias.size(0) == T && bias.size(1) == d.S,
                "bias must be [T, start + T]");
    b = bias.data_ptr<float>();
  }
  auto mm = [q8](const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& s) {
    if (q8)
      return product(Q8Blocks{codes.data_ptr<int8_t>(), s.data_ptr<float>(), x.size(1) / kGroup},
                     x, codes.size(0));
    return q4_matmul(x, codes, s);
  };
  const int64_t qkv_w = (heads + 2 * kv_heads) * hd;
  auto aux = torch::empty({T, int64_t(aux_ids.size()) * H}, h.options());
  auto xn = torch::empty({T, H}, h.options());
  auto attn = torch::empty({T, heads * hd}, h.options());
  auto act = torch::empty({T, d.inter}, h.options());
  float* hp = h.data_ptr<float>();
  auto capture = [&](int64_t layer) {
    for (size_t a = 0; a < aux_ids.size(); ++a)
      if (aux_ids[a] == layer)
        for (int64_t t = 0; t < T; ++t)
          std::memcpy(aux.data_ptr<float>() + t * aux.size(1) + a * H, hp + t * H, H * 4);
  };
  const torch::Tensor* w = weights.data();
  for (int64_t l = 0; l < layers; ++l) {
    capture(l);
    torch::Tensor x = xn;
    if (draft && l == 0) {  // cat(input_layernorm(embeds), hidden_norm(h)) [T, 2H]
      auto e = torch::empty({T, H}, h.options());
      rms_norm(embeds.contiguous().data_ptr<float>(), w[0].data_ptr<float>(),
               e.data_ptr<float>(), T, H, eps);
      rms_norm(hp, w[1].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
      x = torch::cat({e, xn}, 1);
      ++w;
    } else {
      rms_norm(hp, w[0].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
    }
    auto qkv = mm(x, w[1], w[2]);  // [T, qkv_w]
    float* qp = qkv.data_ptr<float>();
    rope(qp, cos.data_ptr<float>(), sin.data_ptr<float>(), T, qkv_w, heads + kv_heads, hd);
    float* kc = kv.data_ptr<float>() + (2 * l) * kv_heads * d.max_len * hd;
    float* vc = kc + kv_heads * d.max_len * hd;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < kv_heads; ++j) {
        std::memcpy(kc + (j * d.max_len + start + t) * hd, qp + t * qkv_w + (heads + j) * hd, hd * 4);
        std::memcpy(vc + (j * d.max_len + start + t) * hd,
                    qp + t * qkv_w + (heads + kv_heads + j) * hd, hd * 4);
      }
    attention(qp, qkv_w, kc, vc, b, attn.data_ptr<float>(), d);
    h.add_(mm(attn, w[3], w[4]));
    rms_norm(hp, w[5].data_ptr<float>(), xn.data_ptr<float>(), T, H, eps);
    auto gu = mm(xn, w[6], w[7]);
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), T, d.inter);
    h.add_(mm(act, w[8], w[9]));
    w += per_layer;
  }
  capture(layers);
  return {h, aux};
#else
  TORCH_CHECK(false, "fused_decoder needs AVX2 + FMA");
#endif
}

bool vectorized() {
#ifdef LOWBIT_SIMD
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x [M, K] f32 @ q4 weight [N, K]^T -> [M, N]");
  m.def("q8_linear", &q8_linear, "x [M, K] f32 @ q8 weight [N, K]^T -> [M, N]");
  m.def("fused_decoder", &fused_decoder, "fused q4 target / q8 head layers for one sequence");
  m.def("vectorized", &vectorized, "built with the AVX2 + FMA kernels");
}
