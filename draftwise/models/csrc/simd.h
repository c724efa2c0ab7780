// What draftwise's kernels share on x86: the CPU checks their fast paths need, and the one horizontal sum every
// kernel ends an 8-lane row sum with (a fixed order, so a row's result never depends on which kernel path ran it).
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace draftwise_simd {

// AVX2 and FMA: every kernel's fast path.
inline bool avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// AVX2, FMA and F16C: the kernels that read fp16 scales or weights.
inline bool avx2_fma_f16c() {
  static const bool yes = avx2_fma() && __builtin_cpu_supports("f16c");
  return yes;
}

// Lanes (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1: the scalar paths' order.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

}  // namespace draftwise_simd
#endif
