// draftwise's product of float32 activations with float weights (float32, bfloat16 or float16), for decoding and
// verification feeds: y[m, n] = sum_k x[m, k] w[n, k], each output summed in 8 lanes over k in order (one fused
// multiply-add a lane and chunk of 8), then one fixed horizontal sum. No step depends on M, the number of activation
// rows: a row's result is the same bits whether it is multiplied alone or beside 15 others (oneDNN's and MKL's
// products pick their kernels and blocking from M, which moves a row's last bits with its batch-mates).
// Tiles of 4 output rows and 2 activation rows keep 8 sums in registers; a weight row is read once per pair of rows.
#include <torch/extension.h>
#include "simd.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FL_X86 1
#endif

namespace {

enum Type { F32 = 0, BF16 = 1, F16 = 2 };

inline float scalar_weight(const void* w, int type, int64_t i) {
  if (type == F32) return static_cast<const float*>(w)[i];
  const uint16_t h = static_cast<const uint16_t*>(w)[i];
  if (type == BF16) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return float(c10::Half(h, c10::Half::from_bits()));
}

void rows_scalar(const float* x, const void* w, int type, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t size = type == F32 ? 4 : 2;
  for (int64_t n = n0; n < n1; ++n) {
    const void* row = static_cast<const uint8_t*>(w) + n * K * size;
    for (int64_t m = 0; m < M; ++m) {
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K; ++k) lanes[k % 8] += x[m * K + k] * scalar_weight(row, type, k);
      y[m * N + n] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    }
  }
}

#ifdef FL_X86
#define FL_TARGET __attribute__((target("avx2,fma,f16c")))

using draftwise_simd::hsum;

template <int TYPE>
FL_TARGET inline __m256 load_weights(const void* w, int64_t k) {
  if constexpr (TYPE == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + k);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k));
    if constexpr (TYPE == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

// R output rows (R <= 4) times J activation rows (J <= 2): R * J sums in registers over the whole of K.
template <int TYPE, int R, int J>
FL_TARGET inline void tile(const float* x, const void* const* w, float* y, int64_t K, int64_t N, int64_t n, int64_t m) {
  __m256 acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xs[J];
    for (int j = 0; j < J; ++j) xs[j] = _mm256_loadu_ps(x + (m + j) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 v = load_weights<TYPE>(w[r], k);
      for (int j = 0; j < J; ++j) acc[j][r] = _mm256_fmadd_ps(v, xs[j], acc[j][r]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) y[(m + j) * N + n + r] = hsum(acc[j][r]);
}

template <int TYPE, int R>
FL_TARGET void rows_r(const float* x, const void* const* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<TYPE, R, 2>(x, w, y, K, N, n, m);
  if (m < M) tile<TYPE, R, 1>(x, w, y, K, N, n, m);
}

template <int TYPE>
FL_TARGET void rows_avx2(const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                         int64_t n1) {
  const int64_t size = TYPE == F32 ? 4 : 2;
  for (int64_t n = n0; n < n1; n += 4) {
    const void* rows[4];
    const int64_t R = std::min<int64_t>(4, n1 - n);
    for (int64_t r = 0; r < R; ++r) rows[r] = static_cast<const uint8_t*>(w) + (n + r) * K * size;
    switch (R) {
      case 4: rows_r<TYPE, 4>(x, rows, y, M, K, N, n); break;
      case 3: rows_r<TYPE, 3>(x, rows, y, M, K, N, n); break;
      case 2: rows_r<TYPE, 2>(x, rows, y, M, K, N, n); break;
      default: rows_r<TYPE, 1>(x, rows, y, M, K, N, n);
    }
  }
}

const auto has_avx2 = draftwise_simd::avx2_fma_f16c;
#endif

}  // namespace

// x: [M, K] float32; w: [N, K] float32, bfloat16 or float16. Returns [M, N] float32.
torch::Tensor fmm(torch::Tensor x, torch::Tensor w, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w: [N, K] contiguous, K as x's");
  int type;
  switch (w.scalar_type()) {
    case torch::kFloat32: type = F32; break;
    case torch::kBFloat16: type = BF16; break;
    case torch::kFloat16: type = F16; break;
    default: TORCH_CHECK(false, "w: float32, bfloat16 or float16");
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
#ifdef FL_X86
  if (!portable && has_avx2() && K % 8 == 0) {
    // chunks of whole tiles (multiples of 4 output rows), so that a row's tile never depends on the split
    at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
      if (type == F32) rows_avx2<F32>(xp, wp, yp, M, K, N, n0, n1);
      else if (type == BF16) rows_avx2<BF16>(xp, wp, yp, M, K, N, n0, n1);
      else rows_avx2<F16>(xp, wp, yp, M, K, N, n0, n1);
    });
    return y;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows_scalar(xp, wp, type, yp, M, K, N, n0, n1); });
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// bmm16: bfloat16 activations x bfloat16 weights on CPUs with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake,
// Sapphire Rapids and later), float32 out. Each output is summed in 16 float32 lanes over k in order, a pair of
// products a lane and chunk of 32 (vdpbf16ps: the products of two bfloat16 numbers are exact in float32), then one
// fixed horizontal sum. As in fmm, nothing depends on M: tiles of 4 output rows and up to 4 activation rows, and the
// activation rows taken in blocks (for the cache) never change an output's order of operations. Callers use it for
// every width or for none, so a row's result is the same bits whatever its batch-mates.
#ifdef FL_X86
namespace {

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

using draftwise_simd::sums4;

// Where a product's outputs go: float32 rows y, or (y16 set) bfloat16 rows rounded to nearest even as PyTorch's
// conversion rounds (NaN to 0x7FC0); bias (or null) added in float32 first, as `y + bias` would.
struct Out {
  float* y;
  uint16_t* y16;
  const float* bias;
};

// Four float32 values rounded to bfloat16 (c10::BFloat16's round to nearest even), in the low 64 bits.
BF_TARGET inline __m128i bf16x4(__m128 v) {
  const __m128i u = _mm_castps_si128(v);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), odd), 16);
  r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7FC0), _mm_castps_si128(_mm_cmpunord_ps(v, v)));
  return _mm_packus_epi32(r, r);
}

template <int R, int J>
BF_TARGET inline void tile16(const uint16_t* x, const uint16_t* const* w, const Out& out, int64_t K, int64_t N,
                             int64_t n, int64_t m) {
  __m512 acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xs[J];
    for (int j = 0; j < J; ++j) xs[j] = (__m512bh)_mm512_loadu_si512(x + (m + j) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(w[r] + k);
      for (int j = 0; j < J; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], v, xs[j]);
    }
  }
  const __mmask8 mask = __mmask8((1 << R) - 1);
  for (int j = 0; j < J; ++j) {
    __m512 a[4];
    for (int r = 0; r < 4; ++r) a[r] = r < R ? acc[j][r] : _mm512_setzero_ps();
    __m128 sums = sums4(a);
    if (out.bias) sums = _mm_add_ps(sums, _mm_maskz_loadu_ps(mask, out.bias + n));
    if (out.y16) _mm_mask_storeu_epi16(out.y16 + (m + j) * N + n, mask, bf16x4(sums));
    else _mm_mask_storeu_ps(out.y + (m + j) * N + n, mask, sums);
  }
}

template <int R>
BF_TARGET void rows16_r(const uint16_t* x, const uint16_t* const* w, const Out& y, int64_t m0, int64_t m1, int64_t K,
                        int64_t N, int64_t n) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) tile16<R, 4>(x, w, y, K, N, n, m);
  switch (m1 - m) {
    case 3: tile16<R, 3>(x, w, y, K, N, n, m); break;
    case 2: tile16<R, 2>(x, w, y, K, N, n, m); break;
    case 1: tile16<R, 1>(x, w, y, K, N, n, m); break;
    default: break;
  }
}

constexpr int64_t PREFETCH_GROUPS = 8;  // how many groups of 4 weight rows ahead the next weights are asked for

// Output rows n0 .. n1 for every activation row. A decoding step's few rows (at most one block) meet each weight row
// once, as the weights stream from memory. A prompt's rows go in blocks (~192 KB of activations, in the core's L2)
// over panels of weight rows (~384 KB, L2 too), every block over one panel before the next panel: a large weight
// (a 1.5B model's 55 MB gate and up) is read from memory once, not once per block. The order of the tiles changes
// no output's arithmetic.
BF_TARGET void rows16(const uint16_t* x, const uint16_t* w, const Out& y, int64_t M, int64_t K, int64_t N,
                      int64_t n0, int64_t n1) {
  const int64_t block = std::max<int64_t>(4, (int64_t(192) * 1024 / (K * 2)) / 4 * 4);
  const bool one_pass = M <= block;
  const int64_t panel = one_pass ? n1 - n0 : std::max<int64_t>(4, (int64_t(384) * 1024 / (K * 2)) / 4 * 4);
  for (int64_t p0 = n0; p0 < n1; p0 += panel) {
    const int64_t p1 = std::min(n1, p0 + panel);
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t n = p0; n < p1; n += 4) {
        const uint16_t* rows[4];
        const int64_t R = std::min<int64_t>(4, p1 - n);
        for (int64_t r = 0; r < R; ++r) rows[r] = w + (n + r) * K;
        // one pass: rows a few groups ahead are asked for while these are used (a hint, only for rows that exist)
        if (one_pass) {
          const char* next = reinterpret_cast<const char*>(w + (n + 4 * PREFETCH_GROUPS) * K);
          const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(4, N - n - 4 * PREFETCH_GROUPS)) * K * 2;
          for (int64_t b = 0; b < ahead; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
        }
        switch (R) {
          case 4: rows16_r<4>(x, rows, y, m0, m1, K, N, n); break;
          case 3: rows16_r<3>(x, rows, y, m0, m1, K, N, n); break;
          case 2: rows16_r<2>(x, rows, y, m0, m1, K, N, n); break;
          default: rows16_r<1>(x, rows, y, m0, m1, K, N, n);
        }
      }
    }
  }
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                          && __builtin_cpu_supports("avx512bf16") && draftwise_simd::avx2_fma();
  return yes;
}

}  // namespace
#endif

// Whether bmm16 runs here (AVX512-BF16).
bool bf16_native() {
#ifdef FL_X86
  return has_avx512_bf16();
#else
  return false;
#endif
}

// x: [M, K] contiguous bfloat16; w: [N, K] contiguous bfloat16; K a multiple of 32; bias: [N] float32 or None.
// Returns [M, N] float32, or bfloat16 with bf16_out (rounded once, after the bias: the bits of `(y + bias).to(bf16)`,
// without writing and reading the float32 rows).
torch::Tensor bmm16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool bf16_out) {
  TORCH_CHECK(bf16_native(), "bmm16 needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: [M, K] contiguous bf16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.size(1) == x.size(1),
              "w: [N, K] contiguous bf16, K as x's");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "bmm16: K must be a multiple of 32");
  const bool biased = bias.has_value() && bias->defined();
  if (biased)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 &&
                bias->is_contiguous(), "bias: [N] contiguous float32");
  auto y = torch::empty({M, N}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  if (M == 0 || N == 0) return y;
#ifdef FL_X86
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const Out out{bf16_out ? nullptr : y.data_ptr<float>(),
                bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr,
                biased ? bias->data_ptr<float>() : nullptr};
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    rows16(xp, wp, out, M, K, N, t0 * 4, std::min(N, t1 * 4));
  });
#endif
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// rmsnorm: y = x / sqrt(mean(x^2) + eps) * w for each row of x [M, K] (float32 or bfloat16, w the same type), in
// float32 inside and rounded to x's type once at the end: one call, where PyTorch's CPU rms_norm on bf16 runs several
// kernels (about 30 us a decoding row). A row's sum of squares goes over k in 8 lanes in order, then the fixed
// horizontal sum: its result never depends on the other rows.
namespace {

template <typename T>
inline float as_f32(T v) { return static_cast<float>(v); }

template <typename T>
void norm_rows_scalar(const T* x, const T* w, T* y, int64_t m0, int64_t m1, int64_t K, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* row = x + m * K;
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < K; ++k) lanes[k % 8] = std::fma(as_f32(row[k]), as_f32(row[k]), lanes[k % 8]);
    // hsum's order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1
    const float total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    const float r = 1.0f / std::sqrt(total / float(K) + eps);
    for (int64_t k = 0; k < K; ++k) y[m * K + k] = T((as_f32(row[k]) * r) * as_f32(w[k]));
  }
}

#ifdef FL_X86
template <typename T>
FL_TARGET inline __m256 load_row8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The same arithmetic as norm_rows_scalar (K a multiple of 8): lane l sums k = l, l + 8, ... by fused multiply-adds.
template <typename T>
FL_TARGET void norm_rows_avx2(const T* x, const T* w, T* y, int64_t m0, int64_t m1, int64_t K, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* row = x + m * K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = load_row8(row + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(draftwise_simd::hsum(acc) / float(K) + eps);
    const __m256 scale = _mm256_set1_ps(r);
    float out[8];
    for (int64_t k = 0; k < K; k += 8) {
      _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_mul_ps(load_row8(row + k), scale), load_row8(w + k)));
      for (int i = 0; i < 8; ++i) y[m * K + k + i] = T(out[i]);
    }
  }
}
#endif

}  // namespace

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat32 ||
              x.scalar_type() == torch::kBFloat16), "x: [M, K] contiguous float32 or bfloat16");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.size(0) == x.size(1),
              "w: [K] contiguous, x's type");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty_like(x);
  if (M == 0 || K == 0) return y;
  const float e = float(eps);
#ifdef FL_X86
  const bool fast = !portable && has_avx2() && K % 8 == 0;
#else
  const bool fast = false;
#endif
  auto run = [&](auto* xp, auto* wp, auto* yp) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
#ifdef FL_X86
      if (fast) return norm_rows_avx2(xp, wp, yp, m0, m1, K, e);
#endif
      norm_rows_scalar(xp, wp, yp, m0, m1, K, e);
    });
  };
  if (x.scalar_type() == torch::kFloat32) run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}
