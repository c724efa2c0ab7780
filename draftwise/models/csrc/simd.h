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

// AVX-512 lane sums in one fixed order, shared by the kernels that end 16-lane row sums several at a time. For each
// accumulator: its 128-bit quarters (0+2)+(1+3), then that quarter's lanes (0+2)+(1+3); one sum involves its own
// accumulator's lanes only, whichever slot it is in.
// Pairs folded: quarters x(0+2), x(1+3), y(0+2), y(1+3).
__attribute__((target("avx512f"))) inline __m512 fold_halves(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
}

// Two folded pairs: quarter i holds accumulator i's four lane partials.
__attribute__((target("avx512f"))) inline __m512 fold_quarters(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// The lane sums of 4 accumulators, accumulator i's in lane i: the order above.
__attribute__((target("avx512f"))) inline __m128 sums4(const __m512* a) {
  const __m512 q = fold_quarters(fold_halves(a[0], a[1]), fold_halves(a[2], a[3]));
  const __m512 t = _mm512_add_ps(q, _mm512_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));  // lanes 0+2, 1+3
  const __m512 u = _mm512_add_ps(t, _mm512_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1)));  // lane 0: (0+2)+(1+3)
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u));
}

}  // namespace draftwise_simd
#endif
