// draftwise's product of activations with weights kept in a GGUF file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0),
// byte for byte as the file stores them: 4.5 bits a Q4_K weight, 6.56 a Q6_K one, nothing decoded ahead of time.
//
// Each activation row is first quantised to int8, as llama.cpp does (its Q8_K and Q8_0): per block of 256 inputs
// (K-quant weights) or 32 (Q5_0, Q8_0), a float32 scale amax / 127 and codes round(x * 127 / amax), with the sums of
// every 16 codes for the K-quants' offsets and mins. A weight block's product with the row is then an exact integer
// sum (u8 x s8 pairs, int32 lanes) taken to float once per block:
//   Q4_K  d * xd * sum_j sc_j * (q . x)_j  -  dmin * xd * sum_j m_j * sum_j(x)          (8 groups of 32)
//   Q6_K  d * xd * sum_g sc_g * ((q . x)_g - 32 * sum_g(x))                              (16 groups of 16)
//   Q5_0, Q8_0  d * xd * (q . x)                                                         (q signed)
// Everything about a row (its quantisation, its integer sums, its float accumulation over the blocks in a fixed
// order, the final 8-lane sum) is computed the same way whatever the number of rows M: a row's result never depends
// on its batch-mates. A K-quant block is decoded in registers once for every tile of up to 8 activation rows it
// meets (cheaper here than decoding it once into memory for all of them); a Q5_0 or Q8_0 block once per pass of up
// to 8 rows.
#include <torch/extension.h>
#include "simd.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#include <string>
#include <cstdlib>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QB_X86 1
#endif

namespace {

enum Kind { Q4K = 0, Q6K = 1, Q50 = 2, Q80 = 3 };
constexpr int KIND_WEIGHTS[4] = {256, 256, 32, 32};   // weights a block
constexpr int KIND_BYTES[4] = {144, 210, 22, 34};     // bytes a block
constexpr int MCHUNK = 16;                            // activation rows a pass over a weight row

float half(const uint8_t* p) {  // little-endian IEEE fp16 -> float, exact
  const uint16_t h = uint16_t(p[0] | (p[1] << 8));
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The activations, quantised row by row.
struct Quantised {
  int64_t M, K, qblock;     // qblock: inputs a scale (256 or 32)
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d;     // [M, K / qblock]
  std::vector<int16_t> s16; // [M, K / 16]: sums of every 16 codes
};

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) void quantise_block_avx2(const float* x, int64_t n, float inverse, int8_t* q) {
  const __m256 inv = _mm256_set1_ps(inverse), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t i = 0; i < n; i += 8) {  // n is 32 or 256
    __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
}
const auto quantise_fast = draftwise_simd::avx2_fma;
#endif

// Both paths compute the same codes: |x| maxima are exact, the multiply is one rounding, then round to nearest even.
void quantise(const float* x, int64_t M, int64_t K, int64_t qblock, Quantised& out) {
  out.M = M; out.K = K; out.qblock = qblock;
  out.q.resize(M * K); out.d.resize(M * (K / qblock)); out.s16.resize(M * (K / 16));
  // on the calling thread unless there are over a million activations
  at::parallel_for(0, M, std::max<int64_t>(4, (int64_t(1) << 20) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      int8_t* qr = out.q.data() + m * K;
      for (int64_t b = 0; b < K / qblock; ++b) {
        float amax = 0.f;
        for (int64_t i = 0; i < qblock; ++i) amax = std::max(amax, std::fabs(xr[b * qblock + i]));
        const float inverse = amax > 0.f ? 127.f / amax : 0.f;
        out.d[m * (K / qblock) + b] = amax / 127.f;
#if defined(__x86_64__) || defined(_M_X64)
        if (quantise_fast()) { quantise_block_avx2(xr + b * qblock, qblock, inverse, qr + b * qblock); continue; }
#endif
        for (int64_t i = 0; i < qblock; ++i) {
          const float v = std::nearbyint(xr[b * qblock + i] * inverse);
          qr[b * qblock + i] = int8_t(std::max(-127.f, std::min(127.f, v)));
        }
      }
      for (int64_t g = 0; g < K / 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += qr[g * 16 + i];
        out.s16[m * (K / 16) + g] = int16_t(s);
      }
    }
  });
}

// Q4_K's 6-bit scales and mins of its 8 groups.
inline void q4k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63; mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The unsigned or signed codes of one block, one byte a weight, in order.
inline void codes_of_block(int kind, const uint8_t* blk, uint8_t* out) {
  if (kind == Q4K) {
    const uint8_t* qs = blk + 16;
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 32; ++i) { out[64 * p + i] = qs[32 * p + i] & 15; out[64 * p + 32 + i] = qs[32 * p + i] >> 4; }
  } else if (kind == Q6K) {
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 32; ++i) {
        const uint8_t a = ql[64 * h + i], b = ql[64 * h + 32 + i], c = qh[32 * h + i];
        out[128 * h + i] = (a & 15) | ((c & 3) << 4);
        out[128 * h + 32 + i] = (b & 15) | (((c >> 2) & 3) << 4);
        out[128 * h + 64 + i] = (a >> 4) | (((c >> 4) & 3) << 4);
        out[128 * h + 96 + i] = (b >> 4) | (((c >> 6) & 3) << 4);
      }
  } else if (kind == Q50) {
    uint32_t high; std::memcpy(&high, blk + 2, 4);
    const uint8_t* qs = blk + 6;
    for (int i = 0; i < 16; ++i) {
      out[i] = uint8_t(int((qs[i] & 15) | (((high >> i) & 1) << 4)) - 16);
      out[i + 16] = uint8_t(int((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4)) - 16);
    }
  } else {
    std::memcpy(out, blk + 2, 32);
  }
}

// ---- portable: exact integer sums a block, then float in block order ------------------------------------------
void rows_scalar(int kind, const uint8_t* w, int64_t row_bytes, const Quantised& xq, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
  const int64_t K = xq.K, blocks = K / KIND_WEIGHTS[kind], per = KIND_WEIGHTS[kind];
  uint8_t codes[256];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < xq.M; ++m) {
      const int8_t* qx = xq.q.data() + m * K;
      const float* dx = xq.d.data() + m * (K / xq.qblock);
      const int16_t* sx = xq.s16.data() + m * (K / 16);
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * KIND_BYTES[kind];
        codes_of_block(kind, blk, codes);
        const int8_t* x = qx + b * per;
        if (kind == Q4K) {
          uint8_t sc[8], mn[8];
          q4k_scales(blk + 4, sc, mn);
          int64_t main = 0, mins = 0;
          for (int j = 0; j < 8; ++j) {
            int64_t dot = 0;
            for (int i = 0; i < 32; ++i) dot += int(codes[32 * j + i]) * x[32 * j + i];
            main += sc[j] * dot;
            mins += mn[j] * (sx[b * 16 + 2 * j] + sx[b * 16 + 2 * j + 1]);
          }
          acc += dx[b] * (half(blk) * float(main) - half(blk + 2) * float(mins));
        } else if (kind == Q6K) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          int64_t total = 0;
          for (int g = 0; g < 16; ++g) {
            int64_t dot = 0;
            for (int i = 0; i < 16; ++i) dot += int(codes[16 * g + i]) * x[16 * g + i];
            total += sc[g] * (dot - 32 * sx[b * 16 + g]);
          }
          acc += dx[b] * half(blk + 208) * float(total);
        } else {
          int64_t dot = 0;
          for (int i = 0; i < 32; ++i) dot += int(int8_t(codes[i])) * x[i];
          acc += dx[b] * half(blk) * float(dot);
        }
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef QB_X86
#define QB_TARGET __attribute__((target("avx2,fma,f16c")))

using draftwise_simd::hsum;

QB_TARGET inline float f16(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

QB_TARGET inline __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A Q5_0 or Q8_0 block unpacked once for every activation row of a pass: its signed codes and their magnitudes.
struct Block {
  __m256i q, abs;
  float d;
};

// The activations laid out for the K-quant tiles: rows in tiles of up to TILE (8, then 4, 3, 2, 1 for the rest),
// each tile block-interleaved, so that one pointer and constant offsets reach every row of a tile at block b: codes
// at q + (b * R + r) * 256, sums of 16 at s16 + (b * R + r) * 16, scales at d[b * R + r]. Built once a product from
// the quantised rows (a copy of M x K bytes).
constexpr int TILE = 8;

struct Tiles {
  // a tile's first row and rows; its codes start at m0 * K in q, its sums at m0 * K / 16, its scales at m0 * K / 256
  struct One { int64_t m0; int R; };
  std::vector<One> tiles;
  std::vector<int8_t> q;
  std::vector<int16_t> s16;
  std::vector<float> d;
};

inline void make_tiles(const Quantised& xq, Tiles& t) {
  const int64_t K = xq.K, blocks = K / 256, M = xq.M;
  t.q.resize(M * K); t.s16.resize(M * (K / 16)); t.d.resize(M * blocks);
  int64_t m0 = 0;
  while (m0 < M) {
    const int64_t left = M - m0;
    const int R = int(left >= TILE ? TILE : left >= 4 ? 4 : left);
    t.tiles.push_back({m0, R});
    m0 += R;
  }
  // a copy of M x K bytes: on the calling thread unless there are several MB of it
  at::parallel_for(0, int64_t(t.tiles.size()), std::max<int64_t>(1, (int64_t(4) << 20) / (TILE * K)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Tiles::One& one = t.tiles[i];
      for (int64_t b = 0; b < blocks; ++b)
        for (int r = 0; r < one.R; ++r) {
          const int64_t m = one.m0 + r;
          std::memcpy(&t.q[one.m0 * K + (b * one.R + r) * 256], &xq.q[m * K + b * 256], 256);
          std::memcpy(&t.s16[one.m0 * (K / 16) + (b * one.R + r) * 16], &xq.s16[m * (K / 16) + b * 16], 32);
          t.d[one.m0 * blocks + b * one.R + r] = xq.d[m * blocks + b];
        }
    }
  });
}

// Half h of a Q6_K block's codes (0 .. 63, one byte a weight): q[j] holds weights 32 j .. 32 j + 31 of the half.
QB_TARGET inline void q6k_codes(const uint8_t* blk, int h, __m256i* q) {
  const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
  const __m256i a = load(blk + 64 * h), b = load(blk + 64 * h + 32), c = load(blk + 128 + 32 * h);
  q[0] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_slli_epi16(_mm256_and_si256(c, low2), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 2), low2), 4));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), low2), 4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 6), low2), 4));
}

// Where R activation rows (from row r0) meet block b of a weight row: their codes, sums of 16 codes, and scales.
template <int KIND, int R>
struct RowsAt {
  const int8_t* x[R];
  const int16_t* s16[R];
  float dx[R];
  RowsAt(const Quantised& xq, int64_t r0, int64_t b) {
    constexpr int PER = KIND_WEIGHTS[KIND];
    const int64_t K = xq.K;
    for (int r = 0; r < R; ++r) {
      x[r] = xq.q.data() + (r0 + r) * K + b * PER;
      s16[r] = xq.s16.data() + (r0 + r) * (K / 16) + b * (PER / 16);
      dx[r] = xq.d[(r0 + r) * (K / PER) + b];
    }
  }
};

// The AVX2 kernels, and the same compiled for AVX-VNNI (qblocks_avx2.inc): same lanes, same bits.
namespace isa_avx2 {
#define QB_ISA __attribute__((target("avx2,fma,f16c")))
#define QB_AVXVNNI 0
#include "qblocks_avx2.inc"
#undef QB_ISA
#undef QB_AVXVNNI
}  // namespace isa_avx2

namespace isa_avxvnni {
#define QB_ISA __attribute__((target("avx2,fma,f16c,avxvnni")))
#define QB_AVXVNNI 1
#include "qblocks_avx2.inc"
#undef QB_ISA
#undef QB_AVXVNNI
}  // namespace isa_avxvnni

// ---- AVX512-VNNI: the same integer lanes, summed four products an instruction -----------------------------------
// A K-quant block's products with a row are exact integers, so computing them with vpdpbusd (u8 x s8, four products
// into an int32 lane) over 64 bytes at once gives the AVX2 path's int32 lanes exactly, once the two 256-bit halves
// are folded (lane i of the AVX2 sum holds bytes 4i .. 4i + 3 of both 32-byte halves a 64-byte step reads; here
// lane i holds the first half's and lane 8 + i the second's). The float steps after them are the AVX2 path's, so
// a row's result is the same bits on either path. Up to 8 activation rows share a block's decoding (32 registers).
#define QB_TARGET512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

QB_TARGET512 inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

QB_TARGET512 inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

template <int R>
QB_TARGET512 inline void dot_q4k_vnni(const uint8_t* blk, const int8_t* const* x, const int16_t* const* s16,
                                      const float* dx, __m256* acc) {
  uint32_t s[3]; std::memcpy(s, blk + 4, 12);
  const uint32_t sc_lo = s[0] & 0x3F3F3F3F, mn_lo = s[1] & 0x3F3F3F3F;
  const uint32_t sc_hi = (s[2] & 0x0F0F0F0F) | (((s[0] >> 6) & 0x03030303) << 4);
  const uint32_t mn_hi = ((s[2] >> 4) & 0x0F0F0F0F) | (((s[1] >> 6) & 0x03030303) << 4);
  const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_setr_epi32(int(sc_lo), int(sc_hi), 0, 0));  // scales 0-7
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512i sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p) {
    // group 2p's 32 codes (low nibbles), then group 2p + 1's (high nibbles): the order of x's 64 bytes
    const __m256i v = load(blk + 16 + 32 * p);
    const __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
    const __m512i scale = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                          2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1), sc32);
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, load64(x[r] + 64 * p));
      sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(dot, scale));
    }
  }
  const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_setr_epi32(int(mn_lo), int(mn_hi), 0, 0));
  const __m256i mins = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(mn16, 0x50), _mm256_setr_epi8(
      0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15));
  const float d = f16(blk), dmin = f16(blk + 2);
  for (int r = 0; r < R; ++r) {
    const __m256i side = _mm256_madd_epi16(mins, load(s16[r]));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold(sum[r])), _mm256_set1_ps(d * dx[r]), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(side), _mm256_set1_ps(dmin * dx[r]), acc[r]);
  }
}

template <int R>
QB_TARGET512 inline void dot_q6k_vnni(const uint8_t* blk, const int8_t* const* x, const int16_t* const* s16,
                                      const float* dx, __m256* acc) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  const __m512i sc32 = _mm512_cvtepi8_epi32(raw);  // the 16 groups' signed scales
  __m512i sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    q6k_codes(blk, h, q);
    for (int j = 0; j < 4; j += 2) {  // codes i and i + 1 (32 bytes each: two groups of 16) against x's 64 bytes
      const int i = 4 * h + j, g = 2 * i;
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q[j]), q[j + 1], 1);
      const __m512i scale = _mm512_permutexvar_epi32(
          _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2, g + 2, g + 3, g + 3, g + 3,
                            g + 3), sc32);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, load64(x[r] + 32 * i));
        sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(dot, scale));
      }
    }
  }
  const __m256i scales = _mm256_cvtepi8_epi16(raw);
  const float d = f16(blk + 208);
  for (int r = 0; r < R; ++r) {
    const __m256i side = _mm256_madd_epi16(scales, load(s16[r]));
    const __m256i total = _mm256_sub_epi32(fold(sum[r]), _mm256_slli_epi32(side, 5));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx[r]), acc[r]);
  }
}

template <int KIND, int R>
QB_TARGET512 inline void kquant_rows_vnni(const uint8_t* blk, const Quantised& xq, int64_t r0, int64_t b,
                                          __m256* acc) {
  const RowsAt<KIND, R> at(xq, r0, b);
  if constexpr (KIND == Q4K) dot_q4k_vnni<R>(blk, at.x, at.s16, at.dx, acc);
  else dot_q6k_vnni<R>(blk, at.x, at.s16, at.dx, acc);
}

template <int KIND>
QB_TARGET512 void rows_vnni(const uint8_t* w, int64_t row_bytes, const Quantised& xq, float* y, int64_t N,
                            int64_t n0, int64_t n1) {
  constexpr int PER = KIND_WEIGHTS[KIND], BYTES = KIND_BYTES[KIND];
  const int64_t blocks = xq.K / PER;
  __m256 acc[MCHUNK];
  for (int64_t m0 = 0; m0 < xq.M; m0 += MCHUNK) {
    const int64_t mc = std::min<int64_t>(MCHUNK, xq.M - m0);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int64_t m = 0; m < mc; ++m) acc[m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * BYTES;
        int64_t m = 0;
        for (; m + 8 <= mc; m += 8) kquant_rows_vnni<KIND, 8>(blk, xq, m0 + m, b, acc + m);
        if (mc - m >= 4) { kquant_rows_vnni<KIND, 4>(blk, xq, m0 + m, b, acc + m); m += 4; }
        switch (mc - m) {
          case 3: kquant_rows_vnni<KIND, 3>(blk, xq, m0 + m, b, acc + m); break;
          case 2: kquant_rows_vnni<KIND, 2>(blk, xq, m0 + m, b, acc + m); break;
          case 1: kquant_rows_vnni<KIND, 1>(blk, xq, m0 + m, b, acc + m); break;
          default: break;
        }
      }
      for (int64_t m = 0; m < mc; ++m) y[(m0 + m) * N + n] = hsum(acc[m]);
    }
  }
}

const auto has_avx2 = draftwise_simd::avx2_fma_f16c;

// AVX512-VNNI (with F/BW/VL), unless DRAFTWISE_AVX512=0 (read once).
bool has_vnni() {
  static const bool yes = [] {
    const char* off = std::getenv("DRAFTWISE_AVX512");
    return !(off && std::string(off) == "0") && has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return yes;
}

// AVX-VNNI (256-bit VEX vpdpbusd / vpdpwssd) beside AVX2, unless DRAFTWISE_AVXVNNI=0 (read once).
bool has_avxvnni() {
  static const bool yes = [] {
    const char* off = std::getenv("DRAFTWISE_AVXVNNI");
    return !(off && std::string(off) == "0") && has_avx2() && __builtin_cpu_supports("avxvnni");
  }();
  return yes;
}
#endif

}  // namespace

torch::Tensor qmm_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, bool portable, bool vnni) {
  TORCH_CHECK(kind >= 0 && kind < 4, "kind: 0 q4_k, 1 q6_k, 2 q5_0, 3 q8_0");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weights ", K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2, "blocks: [N, bytes] uint8");
  const int per = KIND_WEIGHTS[kind];
  TORCH_CHECK(K % per == 0, "K must be a multiple of ", per);
  TORCH_CHECK(w.size(1) == K / per * KIND_BYTES[kind], "blocks do not match K");
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Quantised xq;
  quantise(x.data_ptr<float>(), M, K, per, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Weight rows a thread takes at least: about 0.5M multiply-adds (~25 us), so only a tiny product runs on the
  // calling thread alone. On a quiet machine the pool's threads are still spinning from the last product and start
  // within microseconds; the 1.5B's 2.4M-multiply-add projections split in two. (On a machine whose other core is
  // busy, every parallel region waits a scheduler tick: pause background work while timing.) Which thread computes
  // a row never changes its bits.
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 19) / std::max<int64_t>(1, K * M));
#ifdef QB_X86
  if (!portable && vnni && (kind == Q4K || kind == Q6K) && has_vnni()) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      if (kind == Q4K) rows_vnni<Q4K>(wp, row_bytes, xq, yp, N, n0, n1);
      else rows_vnni<Q6K>(wp, row_bytes, xq, yp, N, n0, n1);
    });
    return y;
  }
  if (!portable && has_avx2()) {
    const bool vex = vnni && has_avxvnni();  // the same lanes, fewer instructions
    if (kind == Q4K || kind == Q6K) {
      Tiles tiles;
      make_tiles(xq, tiles);
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (kind == Q4K) (vex ? isa_avxvnni::rows_tiled<Q4K> : isa_avx2::rows_tiled<Q4K>)(wp, row_bytes, K, tiles, yp, N, n0, n1);
        else (vex ? isa_avxvnni::rows_tiled<Q6K> : isa_avx2::rows_tiled<Q6K>)(wp, row_bytes, K, tiles, yp, N, n0, n1);
      });
    } else {
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (kind == Q50) (vex ? isa_avxvnni::rows_avx2<Q50> : isa_avx2::rows_avx2<Q50>)(wp, row_bytes, xq, yp, N, n0, n1);
        else (vex ? isa_avxvnni::rows_avx2<Q80> : isa_avx2::rows_avx2<Q80>)(wp, row_bytes, xq, yp, N, n0, n1);
      });
    }
    return y;
  }
#endif
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_scalar(int(kind), wp, row_bytes, xq, yp, N, n0, n1); });
  return y;
}

// Whether qmm_blocks' AVX512-VNNI path runs here (Q4_K and Q6_K blocks).
bool blocks_vnni() {
#ifdef QB_X86
  return has_vnni();
#else
  return false;
#endif
}

// Whether qmm_blocks' AVX-VNNI (256-bit) path runs here: every block format where AVX512-VNNI does not take it.
bool blocks_avxvnni() {
#ifdef QB_X86
  return has_avxvnni();
#else
  return false;
#endif
}

// The weights the blocks hold, rounded to bfloat16 once (round to nearest even): [N, K]. A weight is computed in
// float32 as gguf's reference dequantiser does (Q4_K: (d * sc) * q - dmin * m; Q6_K: (d * sc) * (q - 32); Q5_0 and
// Q8_0: d * q), then rounded. For prompt feeds, whose products are bound by arithmetic, not by reading weights.
torch::Tensor dequantised_blocks(torch::Tensor w, int64_t kind, int64_t K) {
  TORCH_CHECK(kind >= 0 && kind < 4, "kind: 0 q4_k, 1 q6_k, 2 q5_0, 3 q8_0");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2, "blocks: [N, bytes] uint8");
  const int per = KIND_WEIGHTS[kind];
  TORCH_CHECK(K % per == 0 && w.size(1) == K / per * KIND_BYTES[kind], "blocks do not match K");
  const int64_t N = w.size(0), row_bytes = w.size(1), blocks = K / per;
  auto out = torch::empty({N, K}, w.options().dtype(torch::kBFloat16));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    uint8_t codes[256];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = wp + n * row_bytes + b * KIND_BYTES[kind];
        at::BFloat16* o = op + n * K + b * per;
        codes_of_block(int(kind), blk, codes);
        if (kind == Q4K) {
          uint8_t sc[8], mn[8];
          q4k_scales(blk + 4, sc, mn);
          const float d = half(blk), dmin = half(blk + 2);
          for (int j = 0; j < 8; ++j) {
            const float scale = d * float(sc[j]), low = dmin * float(mn[j]);
            for (int i = 0; i < 32; ++i) o[32 * j + i] = at::BFloat16(scale * float(codes[32 * j + i]) - low);
          }
        } else if (kind == Q6K) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          const float d = half(blk + 208);
          for (int g = 0; g < 16; ++g) {
            const float scale = d * float(sc[g]);
            for (int i = 0; i < 16; ++i) o[16 * g + i] = at::BFloat16(scale * float(int(codes[16 * g + i]) - 32));
          }
        } else {
          const float d = half(blk);
          for (int i = 0; i < 32; ++i) o[i] = at::BFloat16(d * float(int8_t(codes[i])));
        }
      }
  });
  return out;
}

// The activations as the block product quantises them (codes times scales), for checks: [M, K] float32.
torch::Tensor quantised_activations(torch::Tensor x, int64_t qblock) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(qblock == 32 || qblock == 256, "qblock: 32 or 256");
  TORCH_CHECK(x.size(1) % qblock == 0, "K must be a multiple of ", qblock);
  Quantised xq;
  quantise(x.data_ptr<float>(), x.size(0), x.size(1), qblock, xq);
  auto out = torch::empty_like(x);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = float(xq.q[i]) * xq.d[i / qblock];
  return out;
}

// ---- Q4_K rows packed sixteen to a vector (AVX512-VNNI) ---------------------------------------------------------
// The file's Q4_K rows, regrouped once at load: 16 weight rows side by side, one int32 lane each, so that a block's
// 6-bit scale multiplies the sum of a whole group of 32 weights (8 vpdpbusd) instead of every 4-byte lane of it, and
// each activation's 4 codes are broadcast from memory inside vpdpbusd. Per group of 16 rows and block of 256
// inputs, PACKED_Q4K bytes:
//   [0, 2048)     codes: chunk c (inputs 8c .. 8c + 7) at 64 c; lane l's 4 bytes hold row l's inputs 8c + j in
//                 their low nibbles and 8c + 4 + j in their high ones (j = 0 .. 3)
//   [2048, 2176)  the 8 groups' scales, 16 rows each: scale of group s, row l at 16 s + l
//   [2176, 2304)  the mins in pairs of groups: min of group 2p + t, row l at 32 p + 2 l + t
//   [2304, 2336)  d of the 16 rows (fp16);  [2336, 2368) dmin
// The result is the portable loop's (rows_scalar) bit for bit: the same exact integer sums a block, taken to float
// by the same steps in the same order, for every activation row whatever its batch-mates.
namespace {
constexpr int PACK_ROWS = 16;
constexpr int PACKED_Q4K = 2368;
constexpr int PACKED_Q6K = 3616;
constexpr int PACKED_Q80 = 544;
constexpr int PACKED_Q50 = 352;
constexpr int PACKED_BYTES[4] = {PACKED_Q4K, PACKED_Q6K, PACKED_Q50, PACKED_Q80};
constexpr int PACKED_PAIRS[4] = {4, 8, 1, 1};  // int32 activation terms a row and block

#ifdef QB_X86
// A product streams its groups in order; each block's cache lines are asked for 4 blocks (9.5 KB) ahead, which
// keeps a 17,920 x 1,536 product near the memory's rate at widths 1-4 here (Zen 4: 28 GB/s against 18 without it).
constexpr int64_t PF_AHEAD = 4 * PACKED_Q4K, PF6_AHEAD = 4 * PACKED_Q6K;
#define QP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), optimize("fp-contract=off")))

template <int R>
QP_TARGET void packed_q4k_tile(const uint8_t* group, int64_t blocks, const int8_t* const* x, const float* const* dx,
                               const int32_t* const* pairs, float* const* y) {
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* P = group + b * PACKED_Q4K;
    __m512i whole[R];
    for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(P + PF_AHEAD + 64 * (4 * s + c)), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(P + 64 * (4 * s + c));
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        const int64_t at = b * 256 + 32 * s + 8 * c;
        for (int r = 0; r < R; ++r) {
          int32_t a0, a1;
          std::memcpy(&a0, x[r] + at, 4);
          std::memcpy(&a1, x[r] + at + 4, 4);
          part[r] = _mm512_dpbusd_epi32(part[r], lo, _mm512_set1_epi32(a0));
          part[r] = _mm512_dpbusd_epi32(part[r], hi, _mm512_set1_epi32(a1));
        }
      }
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + 2048 + 16 * s)));
      for (int r = 0; r < R; ++r) whole[r] = _mm512_add_epi32(whole[r], _mm512_mullo_epi32(part[r], scale));
    }
    for (int i = 0; i < 5; ++i) _mm_prefetch(reinterpret_cast<const char*>(P + PF_AHEAD + 2048 + 64 * i), _MM_HINT_T0);
    __m512i mins[R];
    for (int r = 0; r < R; ++r) mins[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i m16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + 2176 + 32 * p)));
      for (int r = 0; r < R; ++r) mins[r] = _mm512_dpwssd_epi32(mins[r], m16, _mm512_set1_epi32(pairs[r][4 * b + p]));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + 2304)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + 2336)));
    for (int r = 0; r < R; ++r) {  // dx * (d * main - dmin * mins), each step rounded as the portable loop rounds it
      const __m512 t = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(whole[r])),
                                     _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mins[r])));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(dx[r][b]), t));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], acc[r]);
}

// Q6_K, packed the same way (PACKED_Q6K bytes a group of 16 rows and block of 256 inputs):
//   [0, 2048)     the codes' low 4 bits, laid out as Q4_K's codes are
//   [2048, 3072)  their high 2 bits, a 64-byte vector for each pair of chunks (2q, 2q + 1), that is, for the 16
//                 inputs of group q: lane l's byte j holds, from bit 0, the high bits of row l's inputs 16q + j,
//                 16q + 4 + j, 16q + 8 + j, 16q + 12 + j
//   [3072, 3328)  the 16 groups' signed scales, 16 rows each: scale of group g, row l at 16 g + l
//   [3328, 3584)  the scales again in pairs of groups, for the offsets: group 2p + t, row l at 32 p + 2 l + t
//   [3584, 3616)  d of the 16 rows (fp16)
template <int R>
QP_TARGET void packed_q6k_tile(const uint8_t* group, int64_t blocks, const int8_t* const* x, const float* const* dx,
                               const int32_t* const* pairs, float* const* y) {
  const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* P = group + b * PACKED_Q6K;
    __m512i whole[R];
    for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(P + PF6_AHEAD + 256 * g + 64 * i), _MM_HINT_T0);
      const __m512i H = _mm512_loadu_si512(P + 2048 + 64 * g);
      const __m512i v0 = _mm512_loadu_si512(P + 128 * g), v1 = _mm512_loadu_si512(P + 128 * g + 64);
      const __m512i w[4] = {
          _mm512_or_si512(_mm512_and_si512(v0, low4), _mm512_and_si512(_mm512_slli_epi16(H, 4), bits45)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4),
                          _mm512_and_si512(_mm512_slli_epi16(H, 2), bits45)),
          _mm512_or_si512(_mm512_and_si512(v1, low4), _mm512_and_si512(H, bits45)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi16(H, 2), bits45))};
      const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + 3072 + 16 * g)));
      const int64_t at = b * 256 + 16 * g;
      for (int r = 0; r < R; ++r) {
        __m512i part = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {
          int32_t a;
          std::memcpy(&a, x[r] + at + 4 * i, 4);
          part = _mm512_dpbusd_epi32(part, w[i], _mm512_set1_epi32(a));
        }
        whole[r] = _mm512_add_epi32(whole[r], _mm512_mullo_epi32(part, scale));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + 3584)));
    for (int r = 0; r < R; ++r) {
      __m512i side = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p)
        side = _mm512_dpwssd_epi32(side, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(P + 3328 + 32 * p))), _mm512_set1_epi32(pairs[r][8 * b + p]));
      const __m512i total = _mm512_sub_epi32(whole[r], _mm512_slli_epi32(side, 5));
      // (dx * d) * total, rounded as the portable loop rounds it
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dx[r][b]), d),
                                                   _mm512_cvtepi32_ps(total)));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], acc[r]);
}

// Q8_0 and Q5_0 (blocks of 32 inputs, signed codes), packed the same way, their codes made unsigned (Q8_0: + 128;
// Q5_0: the file's 5-bit code, value + 16) and the offset taken back with the activations' block sums:
//   Q8_0 (PACKED_Q80 bytes a group of 16 rows and block):  [0, 512) chunk c (inputs 4c .. 4c + 3) at 64 c, lane l's
//        4 bytes row l's codes;  [512, 544) d of the 16 rows (fp16)
//   Q5_0 (PACKED_Q50):  [0, 256) the codes' low 4 bits as Q4_K's are (chunk c: inputs 8c .. 8c + 7);  [256, 320)
//        their fifth bits: lane l's byte j holds row l's input 8c + j at bit 2c and 8c + 4 + j at bit 2c + 1;
//        [320, 352) d of the 16 rows (fp16)
template <int SHIFT>
QP_TARGET inline __m512i fifth_bit(__m512i h) {  // bit (4 - SHIFT) of every byte, moved to bit 4
  const __m512i bit4 = _mm512_set1_epi8(0x10);
  if constexpr (SHIFT > 0) return _mm512_and_si512(_mm512_slli_epi16(h, SHIFT), bit4);
  else if constexpr (SHIFT < 0) return _mm512_and_si512(_mm512_srli_epi16(h, -SHIFT), bit4);
  else return _mm512_and_si512(h, bit4);
}

template <int KIND, int R>
QP_TARGET void packed_small_tile(const uint8_t* group, int64_t blocks, const int8_t* const* x, const float* const* dx,
                                 const int32_t* const* offsets, float* const* y) {
  constexpr int BYTES = KIND == Q80 ? PACKED_Q80 : PACKED_Q50, DPOS = KIND == Q80 ? 512 : 320;
  constexpr int64_t AHEAD = KIND == Q80 ? 16 * PACKED_Q80 : 24 * PACKED_Q50;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* P = group + b * BYTES;
    for (int i = 0; i < (BYTES + 63) / 64; ++i) _mm_prefetch(reinterpret_cast<const char*>(P + AHEAD + 64 * i), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (KIND == Q80) {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(P + 64 * c);
    } else {
      const __m512i H = _mm512_loadu_si512(P + 256);
      const __m512i h[8] = {fifth_bit<4>(H), fifth_bit<3>(H), fifth_bit<2>(H), fifth_bit<1>(H),
                            fifth_bit<0>(H), fifth_bit<-1>(H), fifth_bit<-2>(H), fifth_bit<-3>(H)};
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(P + 64 * c);
        w[2 * c] = _mm512_or_si512(_mm512_and_si512(v, low4), h[2 * c]);
        w[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), h[2 * c + 1]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + DPOS)));
    for (int r = 0; r < R; ++r) {
      __m512i dot = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {  // Q8_0: inputs 4c ..; Q5_0: w[2c'] inputs 8c' .., w[2c' + 1] inputs 8c' + 4 ..
        int32_t a;
        std::memcpy(&a, x[r] + b * 32 + 4 * c, 4);
        dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(a));
      }
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offsets[r][b]));
      // (dx * d) * dot, rounded as the portable loop rounds it
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dx[r][b]), d), _mm512_cvtepi32_ps(dot)));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], acc[r]);
}

template <int KIND, int R>
QP_TARGET void packed_rows(const uint8_t* packed, int64_t blocks, const Quantised& xq, const std::vector<int32_t>& pairs,
                           float* out, int64_t N, int64_t m0, int64_t g) {
  constexpr int PAIRS = PACKED_PAIRS[KIND], BYTES = PACKED_BYTES[KIND];
  const int8_t* x[R];
  const float* dx[R];
  const int32_t* pr[R];
  float* y[R];
  for (int r = 0; r < R; ++r) {
    x[r] = xq.q.data() + (m0 + r) * xq.K;
    dx[r] = xq.d.data() + (m0 + r) * blocks;
    pr[r] = pairs.data() + (m0 + r) * blocks * PAIRS;
    y[r] = out + (m0 + r) * N + g * PACK_ROWS;
  }
  if constexpr (KIND == Q4K) packed_q4k_tile<R>(packed + g * blocks * BYTES, blocks, x, dx, pr, y);
  else if constexpr (KIND == Q6K) packed_q6k_tile<R>(packed + g * blocks * BYTES, blocks, x, dx, pr, y);
  else packed_small_tile<KIND, R>(packed + g * blocks * BYTES, blocks, x, dx, pr, y);
}

template <int KIND>
void packed_product(const uint8_t* wp, int64_t blocks, const Quantised& xq, const std::vector<int32_t>& pairs,
                    float* yp, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < xq.M; m0 += 8) {
      switch (std::min<int64_t>(8, xq.M - m0)) {
        case 8: packed_rows<KIND, 8>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 7: packed_rows<KIND, 7>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 6: packed_rows<KIND, 6>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 5: packed_rows<KIND, 5>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 4: packed_rows<KIND, 4>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 3: packed_rows<KIND, 3>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        case 2: packed_rows<KIND, 2>(wp, blocks, xq, pairs, yp, N, m0, g); break;
        default: packed_rows<KIND, 1>(wp, blocks, xq, pairs, yp, N, m0, g); break;
      }
    }
}
#endif

bool packed_runs() {
#ifdef QB_X86
  static const bool yes = [] {
    const char* off = std::getenv("DRAFTWISE_PACKED");
    return !(off && std::string(off) == "0") && has_vnni();
  }();
  return yes;
#else
  return false;
#endif
}

int packed_bytes(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind < 4, "packing takes kinds 0 q4_k, 1 q6_k, 2 q5_0, 3 q8_0, not kind ", kind);
  return PACKED_BYTES[kind];
}
}  // namespace

// Whether block rows (Q4_K, Q6_K, Q5_0, Q8_0) are packed sixteen to a vector here (AVX512-VNNI; off:
// DRAFTWISE_PACKED=0 or DRAFTWISE_AVX512=0).
bool blocks_packed() { return packed_runs(); }

// A file's rows of one block kind [N, K / per * bytes] regrouped for qmm_packed: [N / 16, K / per, packed bytes]
// uint8 (per: 256 inputs a Q4_K / Q6_K block, 32 a Q5_0 / Q8_0 one).
torch::Tensor pack_blocks(torch::Tensor w, int64_t kind, int64_t K) {
  const int bytes = packed_bytes(kind);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2, "blocks: [N, bytes] uint8");
  const int per = KIND_WEIGHTS[kind];
  TORCH_CHECK(K % per == 0 && w.size(1) == K / per * KIND_BYTES[kind], "blocks do not match K");
  TORCH_CHECK(w.size(0) % PACK_ROWS == 0, "packing takes rows in groups of ", PACK_ROWS, ", not ", w.size(0));
  const int64_t N = w.size(0), blocks = K / per, groups = N / PACK_ROWS, row_bytes = w.size(1);
  auto out = torch::zeros({groups, blocks, bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    uint8_t codes[256], sc[8], mn[8];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* P = dst + (g * blocks + b) * bytes;
        for (int l = 0; l < PACK_ROWS; ++l) {
          const uint8_t* blk = src + (g * PACK_ROWS + l) * row_bytes + b * KIND_BYTES[kind];
          codes_of_block(int(kind), blk, codes);
          if (kind == Q80) {
            for (int i = 0; i < 32; ++i) P[64 * (i / 4) + 4 * l + i % 4] = uint8_t(codes[i] ^ 0x80);
            std::memcpy(P + 512 + 2 * l, blk, 2);
            continue;
          }
          if (kind == Q50) {
            for (int i = 0; i < 32; ++i) codes[i] = uint8_t(int(int8_t(codes[i])) + 16);  // the file's 5-bit code
            for (int c = 0; c < 4; ++c)
              for (int j = 0; j < 4; ++j) {
                P[64 * c + 4 * l + j] = uint8_t((codes[8 * c + j] & 15) | ((codes[8 * c + 4 + j] & 15) << 4));
                P[256 + 4 * l + j] |= uint8_t(((codes[8 * c + j] >> 4) << (2 * c)) | ((codes[8 * c + 4 + j] >> 4) << (2 * c + 1)));
              }
            std::memcpy(P + 320 + 2 * l, blk, 2);
            continue;
          }
          for (int c = 0; c < 32; ++c)  // low 4 bits, 8 inputs a chunk (Q4_K and Q6_K)
            for (int j = 0; j < 4; ++j)
              P[64 * c + 4 * l + j] = uint8_t((codes[8 * c + j] & 15) | ((codes[8 * c + 4 + j] & 15) << 4));
          if (kind == Q4K) {
            q4k_scales(blk + 4, sc, mn);
            for (int s = 0; s < 8; ++s) P[2048 + 16 * s + l] = sc[s];
            for (int p = 0; p < 4; ++p)
              for (int t = 0; t < 2; ++t) P[2176 + 32 * p + 2 * l + t] = mn[2 * p + t];
            std::memcpy(P + 2304 + 2 * l, blk, 2);
            std::memcpy(P + 2336 + 2 * l, blk + 2, 2);
          } else {
            for (int q = 0; q < 16; ++q)
              for (int j = 0; j < 4; ++j) {
                uint8_t h = 0;
                for (int i = 0; i < 4; ++i) h |= uint8_t((codes[16 * q + 4 * i + j] >> 4) << (2 * i));
                P[2048 + 64 * q + 4 * l + j] = h;
              }
            for (int gq = 0; gq < 16; ++gq) P[3072 + 16 * gq + l] = blk[192 + gq];
            for (int p = 0; p < 8; ++p)
              for (int t = 0; t < 2; ++t) P[3328 + 32 * p + 2 * l + t] = blk[192 + 2 * p + t];
            std::memcpy(P + 3584 + 2 * l, blk + 208, 2);
          }
        }
      }
  });
  return out;
}

// x [M, K] float32 times packed rows (pack_blocks): [M, N], each row the portable loop's bits.
torch::Tensor qmm_packed(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t K) {
  const int bytes = packed_bytes(kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(2) == bytes, "packed: [N / 16, K / 256, ", bytes, "] uint8");
  const int qblock = KIND_WEIGHTS[kind];
  TORCH_CHECK(K % qblock == 0 && packed.size(1) == K / qblock, "packed blocks do not match K");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs, the weights ", K);
  TORCH_CHECK(packed_runs(), "packed rows need AVX512-VNNI (and DRAFTWISE_PACKED unset or 1)");
  const int64_t M = x.size(0), groups = packed.size(0), N = groups * PACK_ROWS, blocks = K / qblock;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef QB_X86
  Quantised xq;
  quantise(x.data_ptr<float>(), M, K, qblock, xq);
  // each row's block b as int16 pairs for vpdpwssd: Q4_K the sums of its 8 groups of 32 codes, two an int32;
  // Q6_K the sums of its 16 groups of 16
  // (Q5_0, Q8_0: the unsigned codes' offset times the block's sum of codes, 16 or 128 times)
  const int per = PACKED_PAIRS[kind];
  std::vector<int32_t> pairs(M * blocks * per);
  auto pair = [](int32_t lo, int32_t hi) {
    return int32_t(uint32_t(uint16_t(int16_t(lo))) | (uint32_t(uint16_t(int16_t(hi))) << 16));
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b)
      for (int p = 0; p < per; ++p) {
        if (kind == Q50 || kind == Q80) {
          const int16_t* s = xq.s16.data() + m * (K / 16) + b * 2;
          pairs[m * blocks + b] = (kind == Q50 ? 16 : 128) * (s[0] + s[1]);
          continue;
        }
        const int16_t* s = xq.s16.data() + m * (K / 16) + b * 16;
        pairs[(m * blocks + b) * per + p] = kind == Q4K ? pair(s[4 * p] + s[4 * p + 1], s[4 * p + 2] + s[4 * p + 3])
                                                        : pair(s[2 * p], s[2 * p + 1]);
      }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(1, K * M * PACK_ROWS));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    switch (kind) {
      case Q4K: packed_product<Q4K>(wp, blocks, xq, pairs, yp, N, g0, g1); break;
      case Q6K: packed_product<Q6K>(wp, blocks, xq, pairs, yp, N, g0, g1); break;
      case Q50: packed_product<Q50>(wp, blocks, xq, pairs, yp, N, g0, g1); break;
      default: packed_product<Q80>(wp, blocks, xq, pairs, yp, N, g0, g1); break;
    }
  });
#endif
  return y;
}

// The file's bytes of row l of a packed group's block (the inverse of pack_blocks, byte for byte): for row
// lookups and subsets once the packed copy is the only one kept.
namespace {
void unpack_block(int kind, const uint8_t* P, int l, uint8_t* blk) {
  uint8_t codes[256];
  const int inputs = KIND_WEIGHTS[kind];
  if (kind == Q80) {
    for (int i = 0; i < 32; ++i) blk[2 + i] = uint8_t(P[64 * (i / 4) + 4 * l + i % 4] ^ 0x80);
    std::memcpy(blk, P + 512 + 2 * l, 2);
    return;
  }
  for (int i = 0; i < inputs; ++i) {  // the low 4 bits, 8 inputs a chunk
    const int c = i / 8, j = i % 8;
    const uint8_t byte = P[64 * c + 4 * l + j % 4];
    codes[i] = j < 4 ? (byte & 15) : (byte >> 4);
  }
  if (kind == Q50) {
    for (int i = 0; i < 32; ++i) {
      const int c = i / 8, j = i % 8;
      codes[i] |= uint8_t(((P[256 + 4 * l + j % 4] >> (2 * c + (j < 4 ? 0 : 1))) & 1) << 4);
    }
    uint32_t high = 0;
    for (int i = 0; i < 16; ++i) {
      blk[6 + i] = uint8_t((codes[i] & 15) | ((codes[i + 16] & 15) << 4));
      high |= uint32_t(codes[i] >> 4) << i;
      high |= uint32_t(codes[i + 16] >> 4) << (i + 16);
    }
    std::memcpy(blk + 2, &high, 4);
    std::memcpy(blk, P + 320 + 2 * l, 2);
    return;
  }
  if (kind == Q4K) {
    uint8_t sc[8], mn[8];
    for (int s = 0; s < 8; ++s) sc[s] = P[2048 + 16 * s + l];
    for (int p = 0; p < 4; ++p)
      for (int t = 0; t < 2; ++t) mn[2 * p + t] = P[2176 + 32 * p + 2 * l + t];
    uint8_t* s = blk + 4;
    for (int j = 0; j < 4; ++j) {
      s[j] = uint8_t((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      s[j + 4] = uint8_t((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
      s[j + 8] = uint8_t((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 32; ++i) blk[16 + 32 * p + i] = uint8_t(codes[64 * p + i] | (codes[64 * p + 32 + i] << 4));
    std::memcpy(blk, P + 2304 + 2 * l, 2);
    std::memcpy(blk + 2, P + 2336 + 2 * l, 2);
    return;
  }
  // Q6_K: the high 2 bits of inputs 16q + 4i + j at bits 2i of byte j of group q's vector
  for (int i = 0; i < 256; ++i) {
    const int q = i / 16, r = i % 16;
    codes[i] |= uint8_t(((P[2048 + 64 * q + 4 * l + r % 4] >> (2 * (r / 4))) & 3) << 4);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 32; ++i) {
      const uint8_t* o = codes + 128 * h;
      blk[64 * h + i] = uint8_t((o[i] & 15) | ((o[64 + i] & 15) << 4));
      blk[64 * h + 32 + i] = uint8_t((o[32 + i] & 15) | ((o[96 + i] & 15) << 4));
      blk[128 + 32 * h + i] = uint8_t((o[i] >> 4) | ((o[32 + i] >> 4) << 2) | ((o[64 + i] >> 4) << 4) | ((o[96 + i] >> 4) << 6));
    }
  for (int g = 0; g < 16; ++g) blk[192 + g] = P[3072 + 16 * g + l];
  std::memcpy(blk + 208, P + 3584 + 2 * l, 2);
}
}  // namespace

// Rows `index` of packed rows (pack_blocks) as the file's blocks: [len(index), K / per * bytes] uint8.
torch::Tensor unpack_blocks(torch::Tensor packed, int64_t kind, int64_t K, torch::Tensor index) {
  const int bytes = packed_bytes(kind);
  const int per = KIND_WEIGHTS[kind];
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(2) == bytes && K % per == 0 && packed.size(1) == K / per, "packed rows do not match K");
  TORCH_CHECK(index.scalar_type() == torch::kLong && index.dim() == 1, "index: [n] int64");
  auto idx = index.contiguous();
  const int64_t n = idx.size(0), blocks = K / per, rows = packed.size(0) * PACK_ROWS, row_bytes = blocks * KIND_BYTES[kind];
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row ", ip[i], " is not one of ", rows);
  auto out = torch::empty({n, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = ip[i] / PACK_ROWS;
      const int l = int(ip[i] % PACK_ROWS);
      for (int64_t b = 0; b < blocks; ++b)
        unpack_block(int(kind), src + (g * blocks + b) * bytes, l, dst + i * row_bytes + b * KIND_BYTES[kind]);
    }
  });
  return out;
}
