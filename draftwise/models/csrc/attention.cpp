// draftwise's attention for decoding and verification feeds: every query is computed over the keys it may see, one
// after another in cache order, by arithmetic that depends on nothing but that query and those keys. A token's
// attention output is therefore the same bits whether the forward carries it alone, beside 15 other tokens of its
// row (a verification, a token tree), or beside 31 other rows: PyTorch's scaled_dot_product_attention picks its
// blocking and its reduction order from the shapes of the whole call, which moves the last bits of a row's result
// with its batch-mates (found by swapping it alone for a per-query reference: every other operation of the
// forward already gave equal bits).
//
// For one query head h (kv head h / G) and its visible keys j_1 < j_2 < ... < j_L:
//   s_l = (q . k_{j_l}) * scale       one 8-lane accumulator over the head dimension, then a fixed sum of its lanes
//   p_l = exp(s_l - max_l s_l)        one vectorised exp, lanes assigned by l (the key's rank among the visible)
//   o   = (sum_l p_l v_{j_l}) / sum_l p_l    the total in 8 lanes by l, then a fixed sum; the output in l order
// A score depends on its query and key only, so the AVX2 path computes them for 8 consecutive cache positions at
// once (8 accumulators, their lanes summed by one transposing network: no horizontal sum a key) and keeps those the
// query sees; everything after the scores goes by rank, so a token-tree query and the same query over the same keys
// laid out contiguously give equal bits. A task is one kv head and one query token, or (a wide feed) a tile of up to
// 8 query tokens of a row: the G query heads that share the kv head, and the tile's queries, read each key once.
//
// Where the CPU has AVX-512 (and the head dimension is a multiple of 32), the same scheme runs at 16 lanes with the
// G query heads of a kv head computed together (see `load_pairs`); its scores are summed in another fixed order than
// the AVX2 path's, so a machine gives one set of bits for every feed, and `attend(..., avx512=False)` runs the AVX2
// path there (DRAFTWISE_AVX512=0 for the whole process).
//
// The cache may hold float32 or bfloat16 keys and values (queries and all arithmetic are float32). A bfloat16 cache
// halves the bytes a decoding step reads; the AVX2 path reads it in place, widening 8 elements at a time in registers
// (exactly: the same bits as a float32 copy, without writing one).
#include <torch/extension.h>
#include "simd.h"
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AT_X86 1
#endif

namespace {

constexpr int TILE = 8;  // the most queries a task takes (the AVX2 path's tile)

struct Task {
  const float* q;                  // [G, D] of this token
  const void *keys, *values;       // this kv head's rows in page 0 of the pool (float32, or bfloat16 where bf16)
  const int32_t* pages;            // the row's pages: positions p * P .. p * P + P - 1 sit in page pages[p]
  int64_t P, page_bytes;           // positions a page; bytes from one page of the pool to the next
  bool bf16;
  const bool* visible;             // [KV] or null (every key 0 .. kv - 1)
  int64_t kv, G, D;
  float scale;
  float* out;                      // [G, D]

  // The row of position j in `base` (keys or values): its page's rows are contiguous, D elements apart.
  const char* row(const void* base, int64_t j) const {
    return static_cast<const char*>(base) + int64_t(pages[j / P]) * page_bytes + (j % P) * D * (bf16 ? 2 : 4);
  }
  // An address from which position j's row is j * D elements on, for j in the page holding position j0 (the value
  // kernels index rows by position; a block of positions never spans two pages).
  const void* page_origin(const void* base, int64_t j0) const {
    return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(row(base, j0)) -
                                         uintptr_t(j0 * D * (bf16 ? 2 : 4)));
  }
};

inline float widen(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The visible keys' indices, in order. Returns whether they are the positions 0 .. L - 1 (a causal prompt's or a
// decoding row's keys, every query's but a token tree's): a key's rank is then its position, which the callers use
// to skip searching and gathering by rank (the arithmetic is the same either way).
bool visible_keys(const Task& t, std::vector<int32_t>& index) {
  int64_t L = t.kv;
  if (t.visible != nullptr) {  // the leading visible keys, then whether any other is visible (memchr: whole words)
    const void* hole = std::memchr(t.visible, 0, size_t(t.kv));
    L = hole ? static_cast<const bool*>(hole) - t.visible : t.kv;
    if (L < t.kv && std::memchr(t.visible + L, 1, size_t(t.kv - L)) != nullptr) {
      index.clear();
      for (int64_t j = 0; j < t.kv; ++j)
        if (t.visible[j]) index.push_back(int32_t(j));
      return false;
    }
  }
  index.resize(size_t(L));
  for (int64_t j = 0; j < L; ++j) index[j] = int32_t(j);
  return true;
}

void task_scalar(const Task& t, std::vector<int32_t>& index, std::vector<float>& scores) {
  visible_keys(t, index);
  const int64_t L = int64_t(index.size()), D = t.D;
  auto at = [&](const char* row, int64_t d) {  // element d of a row `Task::row` found
    return t.bf16 ? widen(reinterpret_cast<const uint16_t*>(row)[d]) : reinterpret_cast<const float*>(row)[d];
  };
  scores.resize(t.G * (L + 8));
  for (int64_t g = 0; g < t.G; ++g) {
    float* s = scores.data() + g * (L + 8);
    const float* q = t.q + g * D;
    float top = -INFINITY;
    for (int64_t l = 0; l < L; ++l) {
      float dot = 0.f;
      const char* key = t.row(t.keys, index[l]);
      for (int64_t d = 0; d < D; ++d) dot += q[d] * at(key, d);
      s[l] = dot * t.scale;
      top = std::max(top, s[l]);
    }
    float total = 0.f;
    for (int64_t l = 0; l < L; ++l) { s[l] = std::exp(s[l] - top); total += s[l]; }
    float* o = t.out + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t l = 0; l < L; ++l) {
      const char* value = t.row(t.values, index[l]);
      for (int64_t d = 0; d < D; ++d) o[d] += s[l] * at(value, d);
    }
    if (L > 0)
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
  }
}

#ifdef AT_X86
#define AT_TARGET __attribute__((target("avx2,fma")))

using draftwise_simd::hsum;

// exp(x) for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r
// (relative error about 2e-7), 2^n from the exponent bits; below -87 it is 0.
AT_TARGET inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor_ = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, floor_, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// 8 consecutive elements of a cache row from `at` on, as float32 (bfloat16: widened exactly, in registers).
template <bool BF16>
AT_TARGET inline __m256 load8(const void* row, int64_t at) {
  if constexpr (BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(row) + at);
  }
}

// Eight keys' scores at once: k[m] is key m's row (D elements, D a multiple of 8, float32 or bfloat16 read straight
// from the cache). Key m's score is one accumulator over the head dimension in order, then its lanes summed as
// ((0+1)+(2+3)) + ((4+5)+(6+7)) by a transposing network (the same for every m), times the scale.
template <bool BF16>
AT_TARGET inline void score8(const float* q, const void* const* k, int64_t D, float scale, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, load8<BF16>(k[0], d), a0);
    a1 = _mm256_fmadd_ps(x, load8<BF16>(k[1], d), a1);
    a2 = _mm256_fmadd_ps(x, load8<BF16>(k[2], d), a2);
    a3 = _mm256_fmadd_ps(x, load8<BF16>(k[3], d), a3);
    a4 = _mm256_fmadd_ps(x, load8<BF16>(k[4], d), a4);
    a5 = _mm256_fmadd_ps(x, load8<BF16>(k[5], d), a5);
    a6 = _mm256_fmadd_ps(x, load8<BF16>(k[6], d), a6);
    a7 = _mm256_fmadd_ps(x, load8<BF16>(k[7], d), a7);
  }
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per key: 01+23 | 45+67
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  _mm256_storeu_ps(s, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

// o[0 .. 8 LANES) += sum over ranks c0 .. c1 - 1, in order, of p[c] * v[keys_of[c]] (v: the value rows, D apart). The
// LANES accumulators are registers (a compile-time count), independent chains that hide the multiply-add latency.
template <int LANES, bool BF16>
AT_TARGET inline void value_sums(const float* p, const int32_t* keys_of, int64_t c0, int64_t c1, const void* v,
                                 int64_t D, float* o) {
  __m256 acc[LANES];
  for (int r = 0; r < LANES; ++r) acc[r] = _mm256_loadu_ps(o + 8 * r);
  for (int64_t c = c0; c < c1; ++c) {
    const __m256 weight = _mm256_set1_ps(p[c]);
    const int64_t row = int64_t(keys_of[c]) * D;
    for (int r = 0; r < LANES; ++r) acc[r] = _mm256_fmadd_ps(weight, load8<BF16>(v, row + 8 * r), acc[r]);
  }
  for (int r = 0; r < LANES; ++r) _mm256_storeu_ps(o + 8 * r, acc[r]);
}

// The first rank from c on whose key is at position j1 or later (the query's visible keys before j1 end there);
// with keys 0 .. L - 1 (`prefix`), min(L, j1).
inline int64_t ranks_before(const int32_t* index, int64_t L, int64_t c, int64_t j1, bool prefix) {
  if (prefix) return std::max(c, std::min(L, j1));
  while (c < L && index[c] < j1) ++c;
  return c;
}

// A SIMD width's two inner loops (the rest of a tile's work is shared):
// - scores: the scores of the 8 keys whose rows are rows[0 .. 8), for every query head g of the task, into
//   s[g * stride + m] (already times the scale);
// - values: o_g += sum over ranks c0 .. c1 - 1, in order, of p_g[c] * v[keys_of[c]] for every head g of the task
//   (p_g = p + g * stride, o_g its output row), each output lane one chain of multiply-adds in rank order.
struct Kernels {
  void (*scores)(const Task& t, const void* const* rows, float* s, int64_t stride);
  void (*values)(const Task& t, const float* p, int64_t stride, const int32_t* keys_of, int64_t c0, int64_t c1);
};

template <bool BF16>
AT_TARGET void scores_avx2(const Task& t, const void* const* rows, float* s, int64_t stride) {
  for (int64_t g = 0; g < t.G; ++g) score8<BF16>(t.q + g * t.D, rows, t.D, t.scale, s + g * stride);
}

template <bool BF16>
AT_TARGET void values_avx2(const Task& t, const float* p, int64_t stride, const int32_t* keys_of, int64_t c0,
                           int64_t c1) {
  const int64_t D = t.D;
  for (int64_t g = 0; g < t.G; ++g) {
    const float* pg = p + g * stride;
    float* o = t.out + g * D;
    for (int64_t d = 0; d < D; d += 64) {
      const void* v = static_cast<const char*>(t.values) + d * (BF16 ? 2 : 4);  // column d of row 0
      switch (std::min<int64_t>(8, (D - d) / 8)) {
        case 8: value_sums<8, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 7: value_sums<7, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 6: value_sums<6, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 5: value_sums<5, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 4: value_sums<4, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 3: value_sums<3, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        case 2: value_sums<2, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
        default: value_sums<1, BF16>(pg, keys_of, c0, c1, v, D, o + d); break;
      }
    }
  }
}

// A query's scores s[0 .. L) become exp(s - max) (lanes L .. stride zero); returns their total, summed in 8 lanes
// by rank, then hsum.
AT_TARGET float softmax_avx2(float* s, int64_t L, int64_t stride) {
  for (int64_t l = L; l < stride; ++l) s[l] = s[0];  // tail lanes: a visible score, never summed
  __m256 top8 = _mm256_loadu_ps(s);
  for (int64_t l = 8; l < stride; l += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + l));
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = lanes[0];
  for (int m = 1; m < 8; ++m) top = std::max(top, lanes[m]);
  const __m256 m = _mm256_set1_ps(top);
  for (int64_t l = 0; l < stride; l += 8)
    _mm256_storeu_ps(s + l, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + l), m)));
  for (int64_t l = L; l < stride; ++l) s[l] = 0.f;
  __m256 total = _mm256_setzero_ps();
  for (int64_t l = 0; l < stride; l += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(s + l));
  return hsum(total);
}

AT_TARGET void divide_avx2(float* o, int64_t D, float total) {
  const __m256 t = _mm256_set1_ps(total);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(o + d), t));
}

// AVX-512 (D a multiple of 32): the same scheme at 16 lanes, and the G query heads of a kv head computed together,
// so that each key (and value) row is loaded once for all of them. The head dimension goes in chunks of 32, each as
// its even and its odd elements: 32 bfloat16 numbers are one 512-bit load whose 32-bit lanes hold an (even, odd)
// pair, widened exactly by a shift and a mask (no shuffle). Queries come split the same way (`transpose_chunks`).
// - A key's score is one 16-lane accumulator over the chunks in order, lane l taking elements 2l then 2l + 1 of each
//   chunk, then its lanes summed by one fixed network (`sums4`); a float32 cache is split into the same lanes (two
//   permutes a chunk), so both caches give the same bits.
// - The value sums are the same chains of multiply-adds as the AVX2 path's, one output element each: a bfloat16
//   cache's outputs come out split (evens, odds of each chunk) and are put back in order at the end.
#define AT_TARGET512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// Chunk c of a row's 32 elements from `at` on, as float32: its even elements, and its odd ones.
template <bool BF16>
AT_TARGET512 inline void load_pairs(const void* row, int64_t at, __m512& even, __m512& odd) {
  if constexpr (BF16) {
    const __m512i h = _mm512_loadu_si512(static_cast<const uint16_t*>(row) + at);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int(0xFFFF0000u))));
  } else {
    const float* f = static_cast<const float*>(row) + at;
    const __m512 a = _mm512_loadu_ps(f), b = _mm512_loadu_ps(f + 16);
    even = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
    odd = _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
  }
}


using draftwise_simd::sums4;  // for every key: quarters (0+2)+(1+3), then within the quarter lanes (0+2)+(1+3)

// GN query heads (split, D apart) against the 4 keys at k[0 .. 4): scores into s[g * stride + m]. Four keys a pass
// keep every head's query chunk in registers with the 4 GN accumulators (8 keys would need all 32 registers for
// those alone, and reload the queries for every key).
template <int GN, bool BF16>
AT_TARGET512 inline void score4x(const float* q, int64_t D, const void* const* k, float scale, float* s,
                                 int64_t stride) {
  __m512 acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int m = 0; m < 4; ++m) acc[g][m] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512 first[GN], second[GN];
    for (int g = 0; g < GN; ++g) {
      first[g] = _mm512_loadu_ps(q + g * D + d);
      second[g] = _mm512_loadu_ps(q + g * D + d + 16);
    }
    for (int m = 0; m < 4; ++m) {
      __m512 even, odd;
      load_pairs<BF16>(k[m], d, even, odd);
      for (int g = 0; g < GN; ++g) {
        acc[g][m] = _mm512_fmadd_ps(first[g], even, acc[g][m]);
        acc[g][m] = _mm512_fmadd_ps(second[g], odd, acc[g][m]);
      }
    }
  }
  const __m128 by = _mm_set1_ps(scale);
  for (int g = 0; g < GN; ++g) _mm_storeu_ps(s + g * stride, _mm_mul_ps(sums4(acc[g]), by));
}

// GN query heads against the 8 keys at k[0 .. 8), four at a time.
template <int GN, bool BF16>
AT_TARGET512 inline void score8x(const float* q, int64_t D, const void* const* k, float scale, float* s,
                                 int64_t stride) {
  score4x<GN, BF16>(q, D, k, scale, s, stride);
  score4x<GN, BF16>(q, D, k + 4, scale, s + 4, stride);
}

template <bool BF16>
AT_TARGET512 void scores_avx512(const Task& t, const void* const* rows, float* s, int64_t stride) {
  const int64_t D = t.D;
  int64_t g = 0;
  for (; g + 3 <= t.G; g += 3) score8x<3, BF16>(t.q + g * D, D, rows, t.scale, s + g * stride, stride);
  if (t.G - g == 2) score8x<2, BF16>(t.q + g * D, D, rows, t.scale, s + g * stride, stride);
  if (t.G - g == 1) score8x<1, BF16>(t.q + g * D, D, rows, t.scale, s + g * stride, stride);
}

// GN heads' outputs o + g * D over CHUNKS chunks of 32 columns from column 0 of v (and o), ranks c0 .. c1. A bfloat16
// cache's outputs are kept split (a chunk's evens, then its odds); a float32 cache's in order.
template <int GN, int CHUNKS, bool BF16>
AT_TARGET512 inline void value_sums32(const float* p, int64_t stride, const int32_t* keys_of, int64_t c0, int64_t c1,
                                      const void* v, int64_t D, float* o) {
  __m512 acc[GN][2 * CHUNKS];
  for (int g = 0; g < GN; ++g)
    for (int r = 0; r < 2 * CHUNKS; ++r) acc[g][r] = _mm512_loadu_ps(o + g * D + 16 * r);
  for (int64_t c = c0; c < c1; ++c) {
    __m512 weight[GN];
    for (int g = 0; g < GN; ++g) weight[g] = _mm512_set1_ps(p[g * stride + c]);
    const int64_t row = int64_t(keys_of[c]) * D;
    for (int r = 0; r < CHUNKS; ++r) {
      __m512 first, second;
      if constexpr (BF16) {
        load_pairs<true>(v, row + 32 * r, first, second);
      } else {
        first = _mm512_loadu_ps(static_cast<const float*>(v) + row + 32 * r);
        second = _mm512_loadu_ps(static_cast<const float*>(v) + row + 32 * r + 16);
      }
      for (int g = 0; g < GN; ++g) {
        acc[g][2 * r] = _mm512_fmadd_ps(weight[g], first, acc[g][2 * r]);
        acc[g][2 * r + 1] = _mm512_fmadd_ps(weight[g], second, acc[g][2 * r + 1]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int r = 0; r < 2 * CHUNKS; ++r) _mm512_storeu_ps(o + g * D + 16 * r, acc[g][r]);
}

template <int GN, bool BF16>
AT_TARGET512 inline void value_columns32(const float* p, int64_t stride, const int32_t* keys_of, int64_t c0,
                                         int64_t c1, const void* values, int64_t D, float* o) {
  for (int64_t d = 0; d < D; d += 64) {
    const void* v = static_cast<const char*>(values) + d * (BF16 ? 2 : 4);  // column d of row 0
    if (D - d >= 64) value_sums32<GN, 2, BF16>(p, stride, keys_of, c0, c1, v, D, o + d);
    else value_sums32<GN, 1, BF16>(p, stride, keys_of, c0, c1, v, D, o + d);
  }
}

template <bool BF16>
AT_TARGET512 void values_avx512(const Task& t, const float* p, int64_t stride, const int32_t* keys_of, int64_t c0,
                                int64_t c1) {
  const int64_t D = t.D;
  int64_t g = 0;
  for (; g + 3 <= t.G; g += 3)
    value_columns32<3, BF16>(p + g * stride, stride, keys_of, c0, c1, t.values, D, t.out + g * D);
  if (t.G - g == 2) value_columns32<2, BF16>(p + g * stride, stride, keys_of, c0, c1, t.values, D, t.out + g * D);
  if (t.G - g == 1) value_columns32<1, BF16>(p + g * stride, stride, keys_of, c0, c1, t.values, D, t.out + g * D);
}

// Up to TILE queries of one row and kv head, each computed exactly as it would be alone: its scores (each from its
// query and key only), then by rank among its visible keys its maximum, exponentials, total and output sums. The
// cache is walked once, a block of positions at a time (the block stays in L1 while every query of the tile and
// its G heads read it).
struct Tile {
  Task query[TILE];
  int n;
};

struct Scratch {
  std::vector<int32_t> index[TILE];
  std::vector<float> scores[TILE], totals, positions;
};

// Cache rows are read from memory (a batch's cache is far larger than the caches): the keys a few groups ahead of
// the scores, and the values the second pass will read, are asked for early (hints, which never fault; the page
// table is read only for positions up to the task's last visible key).
constexpr int64_t PREFETCH_AHEAD = 32;

inline void prefetch_rows(const char* at, int64_t bytes, int hint) {
  for (int64_t b = 0; b < bytes; b += 64)
    if (hint == _MM_HINT_T0) _mm_prefetch(at + b, _MM_HINT_T0);
    else _mm_prefetch(at + b, _MM_HINT_T1);
}

void run_tile(const Tile& tile, Scratch& w, const Kernels& kernels) {
  const Task& t0 = tile.query[0];
  const int64_t D = t0.D, G = t0.G, bytes = t0.bf16 ? 2 : 4;
  // positions a block: 8-16 KB of rows, a power of two (at most 64), so a block never spans two pages
  int64_t block = 8;
  while (block < 64 && 2 * block * D <= 4096) block *= 2;
  int64_t L[TILE], stride[TILE], cursor[TILE], last = -1;
  bool prefix[TILE];
  for (int i = 0; i < tile.n; ++i) {
    prefix[i] = visible_keys(tile.query[i], w.index[i]);
    L[i] = int64_t(w.index[i].size());
    stride[i] = (L[i] + 7) / 8 * 8;
    w.scores[i].resize(G * stride[i] + 8);
    cursor[i] = 0;
    if (L[i]) last = std::max(last, int64_t(w.index[i][L[i] - 1]));
  }
  w.positions.resize(G * block);
  // scores: each block of positions once; a query's scores for the 8-position groups holding its visible keys
  // there, kept by rank
  for (int64_t j0 = 0; j0 <= last; j0 += block) {
    const int64_t j1 = std::min(j0 + block, last + 1);
    const char* k = t0.row(t0.keys, j0);  // row j0, read in place; the block's rows follow it
    for (int i = 0; i < tile.n; ++i) {
      const int32_t* index = w.index[i].data();
      const int64_t c0 = cursor[i], c1 = cursor[i] = ranks_before(index, L[i], c0, j1, prefix[i]);
      if (c1 == c0) continue;
      const Task& t = tile.query[i];
      const int64_t from = (index[c0] - j0) / 8 * 8, to = index[c1 - 1] - j0 + 1;
      for (int64_t p = from; p < to; p += 8) {
        // the keys PREFETCH_AHEAD positions on, in whichever page holds them (a block never spans two pages, but
        // the positions ahead may be in the next block's)
        prefetch_rows(t0.row(t0.keys, std::min(j0 + p + PREFETCH_AHEAD, last)), 8 * D * bytes, _MM_HINT_T0);
        prefetch_rows(t0.row(t0.values, j0 + p), 8 * D * bytes, _MM_HINT_T1);
        const void* rows[8];
        for (int m = 0; m < 8; ++m) rows[m] = k + std::min<int64_t>(p + m, j1 - j0 - 1) * D * bytes;
        kernels.scores(t, rows, w.positions.data() + p, block);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = w.scores[i].data() + g * stride[i];
        const float* at = w.positions.data() + g * block - j0;
        if (prefix[i]) std::memcpy(s + c0, at + c0, sizeof(float) * size_t(c1 - c0));  // rank c is position c
        else for (int64_t c = c0; c < c1; ++c) s[c] = at[index[c]];
      }
    }
  }
  w.totals.resize(TILE * G);
  for (int i = 0; i < tile.n; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      std::memset(tile.query[i].out + g * D, 0, sizeof(float) * D);
      if (L[i]) w.totals[i * G + g] = softmax_avx2(w.scores[i].data() + g * stride[i], L[i], stride[i]);
    }
    cursor[i] = 0;
  }
  // the values, a block of positions at a time; a query's output lanes stay in registers over the block: each
  // lane's multiply-adds are the same, in rank order
  for (int64_t j0 = 0; j0 <= last; j0 += block) {
    const int64_t j1 = std::min(j0 + block, last + 1);
    for (int i = 0; i < tile.n; ++i) {
      const int32_t* keys_of = w.index[i].data();
      const int64_t c0 = cursor[i], c1 = cursor[i] = ranks_before(keys_of, L[i], c0, j1, prefix[i]);
      if (c1 == c0) continue;
      Task t = tile.query[i];
      t.values = t.page_origin(t.values, j0);
      kernels.values(t, w.scores[i].data(), stride[i], keys_of, c0, c1);
    }
  }
  for (int i = 0; i < tile.n; ++i)
    if (L[i])
      for (int64_t g = 0; g < G; ++g) divide_avx2(tile.query[i].out + g * D, D, w.totals[i * G + g]);
}

const auto has_avx2 = draftwise_simd::avx2_fma;

// AVX-512 F/BW/VL/DQ, unless DRAFTWISE_AVX512=0 (read once).
bool has_avx512() {
  static const bool yes = [] {
    const char* off = std::getenv("DRAFTWISE_AVX512");
    return !(off && std::string(off) == "0") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && has_avx2();
  }();
  return yes;
}

const Kernels avx2_f32{scores_avx2<false>, values_avx2<false>}, avx2_bf16{scores_avx2<true>, values_avx2<true>},
    avx512_f32{scores_avx512<false>, values_avx512<false>}, avx512_bf16{scores_avx512<true>, values_avx512<true>};
#endif

}  // namespace

// Each chunk of 32 elements of x's last dimension read as [a, b] and written as [b, a]: (16, 2) lays a chunk out as
// its 16 even elements, then its 16 odd ones (the AVX-512 path's lanes); (2, 16) puts it back in order.
static torch::Tensor transpose_chunks(const torch::Tensor& x, int64_t a, int64_t b) {
  auto sizes = x.sizes().vec();
  sizes.back() /= 32;
  sizes.push_back(a);
  sizes.push_back(b);
  return x.reshape(sizes).transpose(-1, -2).contiguous().reshape(x.sizes());
}

// q: [R, W, H, D] float32; keys, values: [R, KVH, C, D] float32 or bfloat16 (the forward's cache rows), or with
// `pages` a pool [N, KVH, P, D] of pages of P positions (P a multiple of 64), whose row r holds positions
// p * P .. p * P + P - 1 in page pages[r, p] (pages: [R, >= ceil(kv / P)] int32; entries past a row's keys are never
// read); visible: [R, W, KV] bool or None (every key 0 .. kv - 1); counts: real queries a row (the rest are padding,
// left zero). Returns [R, W, H, D] float32. Where a row's keys sit changes none of its bits.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> visible,
                     std::vector<int64_t> counts, int64_t kv, double scale, bool portable, bool avx512,
                     c10::optional<torch::Tensor> pages) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [R, W, H, D] float32");
  const auto dtype = keys.scalar_type();
  TORCH_CHECK(keys.dim() == 4 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && keys.is_contiguous() &&
              values.sizes() == keys.sizes() && values.scalar_type() == dtype && values.is_contiguous(),
              "keys, values: [R, KVH, C, D] or [pages, KVH, P, D], float32 or bfloat16 (both the same), contiguous");
  const int64_t R = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = keys.size(1), C = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && KVH > 0 && H % KVH == 0, "q and keys do not match");
  TORCH_CHECK(int64_t(counts.size()) == R, "one count a row");
  TORCH_CHECK(kv >= 0, "kv past the cache");
  // a flat cache is a pool of R pages of C positions, row r's one page being page r
  std::vector<int32_t> own;
  const int32_t* table;
  int64_t P, table_width;
  if (pages.has_value() && pages->defined()) {
    const auto& t = *pages;
    P = C;
    TORCH_CHECK(P % 64 == 0, "pages of a multiple of 64 positions");
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous() && t.dim() == 2 && t.size(0) == R &&
                t.size(1) * P >= kv, "pages: [R, >= kv / P] int32, contiguous");
    table = t.data_ptr<int32_t>();
    table_width = t.size(1);
    const int64_t N = keys.size(0);
    for (int64_t i = 0; i < t.numel(); ++i) TORCH_CHECK(table[i] >= 0 && table[i] < N, "a page past the pool");
  } else {
    TORCH_CHECK(keys.size(0) == R, "q and keys do not match");
    TORCH_CHECK(kv <= C, "kv past the cache");
    P = std::max<int64_t>(C, 1);
    table_width = 1;
    own.resize(R);
    for (int64_t r = 0; r < R; ++r) own[r] = int32_t(r);
    table = own.data();
  }
  const bool* mask = nullptr;
  if (visible.has_value() && visible->defined()) {
    const auto& v = *visible;
    TORCH_CHECK(v.scalar_type() == torch::kBool && v.is_contiguous() && v.dim() == 3 && v.size(0) == R &&
                v.size(1) == W && v.size(2) >= kv, "visible: [R, W, >= kv] bool, contiguous");
    mask = v.data_ptr<bool>();
  }
  const int64_t mask_kv = mask ? visible->size(2) : 0;
  auto out = torch::zeros_like(q);
  const int64_t G = H / KVH;
  const bool bf16 = dtype == torch::kBFloat16;
  const int64_t bytes = bf16 ? 2 : 4;
#ifdef AT_X86
  const bool fast = !portable && has_avx2() && D % 8 == 0;
  const bool wide = fast && avx512 && has_avx512() && D % 32 == 0;
  const Kernels& kernels = wide ? (bf16 ? avx512_bf16 : avx512_f32) : (bf16 ? avx2_bf16 : avx2_f32);
  if (wide) q = transpose_chunks(q, 16, 2);  // the AVX-512 path's lanes: each chunk of 32 as its evens, then odds
#else
  const bool fast = false;
  const bool wide = false;
#endif
  const float* qp = q.data_ptr<float>();
  const char *kp = static_cast<const char*>(keys.data_ptr()), *vp = static_cast<const char*>(values.data_ptr());
  float* op = out.data_ptr<float>();
  // queries a task takes: a tile of a wide feed (a prompt chunk), of any feed over a long context, or of a narrow
  // feed (verification) where rows and kv heads alone make tasks enough for the threads, shares its key loads; a
  // narrow feed of few rows over a short context keeps one query a task, for more tasks to share out. Each query's
  // bits are the same either way.
#ifdef AT_X86
  const int64_t per = fast && W > 1 && (W >= 2 * TILE || kv >= 1024 || R * KVH >= 4 * at::get_num_threads()) ? TILE : 1;
#else
  const int64_t per = 1;
#endif
  const int64_t spans = (W + per - 1) / per, tasks = R * spans * KVH;
  // tasks are claimed one at a time by whichever thread is free: rows of a batch differ in length (and a prompt
  // chunk's late queries see more keys), so equal shares of tasks are not equal shares of work. Which thread runs a
  // task changes none of its arithmetic.
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#ifdef AT_X86
    Scratch scratch;
#endif
    std::vector<int32_t> index;
    std::vector<float> scores;
    for (int64_t t; (t = claimed.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t r = t / (spans * KVH), span = (t / KVH) % spans, g = t % KVH;
      const int64_t w0 = span * per, w1 = std::min(std::min(W, w0 + per), counts[r]);
      auto task = [&](int64_t w) {
        const int64_t head_at = g * C * D * bytes;
        return Task{qp + ((r * W + w) * H + g * G) * D, kp + head_at, vp + head_at, table + r * table_width, P,
                    KVH * C * D * bytes, bf16, mask ? mask + (r * W + w) * mask_kv : nullptr, kv, G, D,
                    float(scale), op + ((r * W + w) * H + g * G) * D};
      };
      if (w0 >= w1) continue;
#ifdef AT_X86
      if (fast) {
        Tile tile;
        tile.n = int(w1 - w0);
        for (int64_t w = w0; w < w1; ++w) tile.query[w - w0] = task(w);
        run_tile(tile, scratch, kernels);
        continue;
      }
#endif
      for (int64_t w = w0; w < w1; ++w) task_scalar(task(w), index, scores);
    }
  });
  return wide && bf16 ? transpose_chunks(out, 2, 16) : out;  // a bfloat16 cache's value sums come out split
}

// Whether attend's AVX-512 path runs here (a head dimension that is a multiple of 32 takes it).
bool attention_avx512() {
#ifdef AT_X86
  return has_avx512();
#else
  return false;
#endif
}
