// Vector helpers shared by `cpu_lowbit.cpp` (attention's softmax) and `cpu_step.cpp` (the
// sampler's softmax). Not here: anything with state or a torch type.
#pragma once

#include <immintrin.h>

// exp(x) per lane (Cephes-style range reduction and a degree-6 polynomial, ~2 ulp); exactly 0
// below -86 (so -inf scores of masked keys add nothing at all, and no result is a denormal,
// which would make every later product with it slow).
__attribute__((always_inline)) inline __m256 vexp(__m256 x) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), t);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 pow2 = _mm256_castsi256_ps(  // 2^n for integral n in [-126, 127]
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_and_ps(_mm256_mul_ps(p, pow2), _mm256_cmp_ps(x, _mm256_set1_ps(-86.f), _CMP_GE_OQ));
}
