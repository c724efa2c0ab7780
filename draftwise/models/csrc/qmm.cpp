// draftwise's product of float activations with weights kept in a GGUF file's codes.
//
// y[m, n] = sum_k x[m, k] * w[n, k], where w[n, k] = code * scale[n, k / group] (+ zero[n, k / group]):
// - bits 4: codes packed as ggml's 32-weight blocks, byte i holding weight i (low nibble) and i + 16 (high),
//   codes unsigned 0..15 (Q4_0, Q4_1, Q4_K: the offset and the mins are folded into `zero`);
// - bits 8: one signed byte a weight, the offset already taken off (Q5_0, Q6_K, Q8_0), no zero.
// The group is 32 or 16 weights (Q6_K). Each output row's sum is taken in the same order whatever the number of
// activation rows M (8-lane partial sums over the row's 32-weight blocks, then a fixed horizontal sum), so a row's
// result never depends on how many rows share the product. The weights are decoded once per tile of 4 output rows
// and 16 activation rows, and multiplied into every activation row of the tile.
#include <torch/extension.h>
#include "simd.h"
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QMM_X86 1
#endif

namespace {

constexpr int BLOCK = 32;
constexpr int ROWS = 4;     // output rows per tile
constexpr int MCHUNK = 16;  // activation rows per pass over a tile

struct Args {
  const float* x; int64_t M, K;
  const uint8_t* codes; int64_t row_bytes; int bits;
  const float* scales; const float* zeros; int64_t groups; int group;
  float* y; int64_t N;
};

// ---- portable reference: the same decode, scalar sums in block order -------------------------------------------
inline void decode_block_scalar(const Args& a, int64_t n, int64_t b, float* w) {
  const float* sc = a.scales + n * a.groups;
  const float* zr = a.zeros ? a.zeros + n * a.groups : nullptr;
  if (a.bits == 4) {
    const uint8_t* q = a.codes + n * a.row_bytes + b * 16;
    for (int i = 0; i < 16; ++i) { w[i] = float(q[i] & 15); w[i + 16] = float(q[i] >> 4); }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(a.codes + n * a.row_bytes + b * BLOCK);
    for (int i = 0; i < BLOCK; ++i) w[i] = float(q[i]);
  }
  for (int i = 0; i < BLOCK; ++i) {
    int64_t g = (b * BLOCK + i) / a.group;
    w[i] = zr ? w[i] * sc[g] + zr[g] : w[i] * sc[g];
  }
}

void tile_scalar(const Args& a, int64_t n0, int64_t n1) {
  float w[BLOCK];
  const int64_t blocks = a.K / BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < a.M; ++m) {
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const float* xr = a.x + m * a.K;
      for (int64_t b = 0; b < blocks; ++b) {
        decode_block_scalar(a, n, b, w);
        for (int i = 0; i < BLOCK; ++i) lanes[i % 8] += w[i] * xr[b * BLOCK + i];
      }
      a.y[m * a.N + n] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    }
  }
}

#ifdef QMM_X86
// One 32-weight block of output row n, decoded into 4 vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31).
template <int BITS, bool ZERO, int GROUP>
__attribute__((target("avx2,fma"), always_inline)) inline void decode_avx2(const uint8_t* row_codes,
    const float* sc, const float* zr, int64_t b, __m256 w[4]) {
  __m256i q[4];
  if (BITS == 4) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_codes + b * 16));
    const __m128i low = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    q[0] = _mm256_cvtepu8_epi32(lo); q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi); q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
  } else {
    const uint8_t* p = row_codes + b * BLOCK;
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t g = GROUP == 32 ? b : 2 * b + (j >> 1);
    __m256 f = _mm256_cvtepi32_ps(q[j]);
    w[j] = ZERO ? _mm256_fmadd_ps(f, _mm256_set1_ps(sc[g]), _mm256_set1_ps(zr[g])) : _mm256_mul_ps(f, _mm256_set1_ps(sc[g]));
  }
}

using draftwise_simd::hsum;

template <int BITS, bool ZERO, int GROUP>
__attribute__((target("avx2,fma"))) void tile_avx2(const Args& a, int64_t t0, int64_t t1) {
  const int64_t blocks = a.K / BLOCK;
  alignas(32) __m256 acc[MCHUNK][ROWS];
  __m256 w[ROWS][4];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * ROWS;
    const uint8_t* rc[ROWS]; const float* sc[ROWS]; const float* zr[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      rc[r] = a.codes + (n0 + r) * a.row_bytes;
      sc[r] = a.scales + (n0 + r) * a.groups;
      zr[r] = ZERO ? a.zeros + (n0 + r) * a.groups : nullptr;
    }
    if (a.M == 1) {  // decoding: the accumulators stay in registers
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xr = a.x + b * BLOCK;
        __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8);
        __m256 x2 = _mm256_loadu_ps(xr + 16), x3 = _mm256_loadu_ps(xr + 24);
        __m256 v[4];
        decode_avx2<BITS, ZERO, GROUP>(rc[0], sc[0], zr[0], b, v);
        s0 = _mm256_fmadd_ps(v[3], x3, _mm256_fmadd_ps(v[2], x2, _mm256_fmadd_ps(v[1], x1, _mm256_fmadd_ps(v[0], x0, s0))));
        decode_avx2<BITS, ZERO, GROUP>(rc[1], sc[1], zr[1], b, v);
        s1 = _mm256_fmadd_ps(v[3], x3, _mm256_fmadd_ps(v[2], x2, _mm256_fmadd_ps(v[1], x1, _mm256_fmadd_ps(v[0], x0, s1))));
        decode_avx2<BITS, ZERO, GROUP>(rc[2], sc[2], zr[2], b, v);
        s2 = _mm256_fmadd_ps(v[3], x3, _mm256_fmadd_ps(v[2], x2, _mm256_fmadd_ps(v[1], x1, _mm256_fmadd_ps(v[0], x0, s2))));
        decode_avx2<BITS, ZERO, GROUP>(rc[3], sc[3], zr[3], b, v);
        s3 = _mm256_fmadd_ps(v[3], x3, _mm256_fmadd_ps(v[2], x2, _mm256_fmadd_ps(v[1], x1, _mm256_fmadd_ps(v[0], x0, s3))));
      }
      a.y[n0] = hsum(s0); a.y[n0 + 1] = hsum(s1); a.y[n0 + 2] = hsum(s2); a.y[n0 + 3] = hsum(s3);
      continue;
    }
    for (int64_t m0 = 0; m0 < a.M; m0 += MCHUNK) {
      const int64_t mc = std::min<int64_t>(MCHUNK, a.M - m0);
      for (int64_t m = 0; m < mc; ++m)
        for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        for (int r = 0; r < ROWS; ++r) decode_avx2<BITS, ZERO, GROUP>(rc[r], sc[r], zr[r], b, w[r]);
        for (int64_t m = 0; m < mc; ++m) {
          const float* xr = a.x + (m0 + m) * a.K + b * BLOCK;
          __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8);
          __m256 x2 = _mm256_loadu_ps(xr + 16), x3 = _mm256_loadu_ps(xr + 24);
          for (int r = 0; r < ROWS; ++r)  // the same order as the decoding path: 0, 1, 2, 3
            acc[m][r] = _mm256_fmadd_ps(w[r][3], x3, _mm256_fmadd_ps(w[r][2], x2,
                        _mm256_fmadd_ps(w[r][1], x1, _mm256_fmadd_ps(w[r][0], x0, acc[m][r]))));
        }
      }
      for (int64_t m = 0; m < mc; ++m)
        for (int r = 0; r < ROWS; ++r) a.y[(m0 + m) * a.N + n0 + r] = hsum(acc[m][r]);
    }
  }
}

void run_avx2(const Args& a, int64_t t0, int64_t t1) {
  const bool zero = a.zeros != nullptr;
  if (a.bits == 4 && zero && a.group == 32) return tile_avx2<4, true, 32>(a, t0, t1);
  if (a.bits == 4 && !zero && a.group == 32) return tile_avx2<4, false, 32>(a, t0, t1);
  if (a.bits == 8 && !zero && a.group == 32) return tile_avx2<8, false, 32>(a, t0, t1);
  if (a.bits == 8 && !zero && a.group == 16) return tile_avx2<8, false, 16>(a, t0, t1);
  if (a.bits == 8 && zero && a.group == 32) return tile_avx2<8, true, 32>(a, t0, t1);
  if (a.bits == 8 && zero && a.group == 16) return tile_avx2<8, true, 16>(a, t0, t1);
  if (a.bits == 4 && zero) return tile_avx2<4, true, 16>(a, t0, t1);
  return tile_avx2<4, false, 16>(a, t0, t1);
}

const auto has_avx2 = draftwise_simd::avx2_fma;
#endif

}  // namespace

torch::Tensor qmm(torch::Tensor x, torch::Tensor codes, int64_t bits, torch::Tensor scales,
                  c10::optional<torch::Tensor> zeros, int64_t group, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2, "codes: [N, bytes] uint8");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % BLOCK == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == (bits == 4 ? K / 2 : K), "codes do not match K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales: [N, K / group] float32");
  const float* zp = nullptr;
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->scalar_type() == torch::kFloat32 && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "zeros: like scales");
    zp = zeros->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  Args a{x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), codes.size(1), int(bits),
         scales.data_ptr<float>(), zp, K / group, int(group), y.data_ptr<float>(), N};
  if (M == 0) return y;
#ifdef QMM_X86
  if (!portable && has_avx2() && N % ROWS == 0) {
    // tiles a thread takes at least: about 0.5M multiply-adds, so only a tiny product stays on the calling thread
    const int64_t grain = std::max<int64_t>(8, (int64_t(1) << 19) / std::max<int64_t>(1, K * M * ROWS));
    at::parallel_for(0, N / ROWS, grain, [&](int64_t t0, int64_t t1) { run_avx2(a, t0, t1); });
    return y;
  }
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { tile_scalar(a, n0, n1); });
  return y;
}

bool accelerated() {
#ifdef QMM_X86
  return has_avx2();
#else
  return false;
#endif
}

torch::Tensor qmm_blocks(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t K, bool portable,
                         bool vnni);  // qblocks.cpp
bool blocks_vnni();  // qblocks.cpp
bool blocks_avxvnni();  // qblocks.cpp
bool blocks_packed();  // qblocks.cpp
torch::Tensor pack_blocks(torch::Tensor w, int64_t kind, int64_t K);  // qblocks.cpp
torch::Tensor qmm_packed(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t K);  // qblocks.cpp
torch::Tensor unpack_blocks(torch::Tensor packed, int64_t kind, int64_t K, torch::Tensor index);  // qblocks.cpp
torch::Tensor quantised_activations(torch::Tensor x, int64_t qblock);
torch::Tensor dequantised_blocks(torch::Tensor w, int64_t kind, int64_t K);  // qblocks.cpp
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> visible,
                     std::vector<int64_t> counts, int64_t kv, double scale, bool portable, bool avx512,
                     c10::optional<torch::Tensor> pages);  // attention.cpp
bool attention_avx512();  // attention.cpp
torch::Tensor fmm(torch::Tensor x, torch::Tensor w, bool portable);  // floats.cpp
torch::Tensor bmm16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool bf16_out);  // floats.cpp
bool bf16_native();  // floats.cpp
torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps, bool portable);  // floats.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmm", &qmm, "float activations x weights in GGUF codes");
  m.def("qmm_blocks", &qmm_blocks, "activations (quantised to int8 per block) x weights in a GGUF file's own blocks",
        py::arg("x"), py::arg("w"), py::arg("kind"), py::arg("K"), py::arg("portable"), py::arg("vnni") = true);
  m.def("blocks_vnni", &blocks_vnni, "whether qmm_blocks' AVX512-VNNI path runs here (off: DRAFTWISE_AVX512=0)");
  m.def("blocks_avxvnni", &blocks_avxvnni, "whether qmm_blocks' AVX-VNNI path runs here (off: DRAFTWISE_AVXVNNI=0)");
  m.def("blocks_packed", &blocks_packed, "whether block rows are packed 16 to a vector here (AVX512-VNNI; off: DRAFTWISE_PACKED=0)");
  m.def("pack_blocks", &pack_blocks, "a GGUF file's rows of one block kind (0 q4_k, 1 q6_k, 2 q5_0, 3 q8_0) regrouped 16 to a vector for qmm_packed");
  m.def("qmm_packed", &qmm_packed, "activations x packed block rows: the portable block loop's bits");
  m.def("unpack_blocks", &unpack_blocks, "rows of packed block rows as the file's blocks, byte for byte");
  m.def("dequantised_blocks", &dequantised_blocks, "the weights a GGUF file's blocks hold, rounded to bf16");
  m.def("quantised_activations", &quantised_activations, "the activations as qmm_blocks quantises them");
  m.def("attend", &attend, "each query over its visible keys in order, whatever the batch (attention.cpp)",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("visible"), py::arg("counts"), py::arg("kv"),
        py::arg("scale"), py::arg("portable"), py::arg("avx512") = true, py::arg("pages") = py::none());
  m.def("attention_avx512", &attention_avx512, "whether attend's AVX-512 path runs here (off: DRAFTWISE_AVX512=0)");
  m.def("fmm", &fmm, "float32 activations x float weights, each row's sums in one order whatever M (floats.cpp)");
  m.def("bmm16", &bmm16, "bf16 activations x bf16 weights (AVX512-BF16), each row's sums in one order whatever M",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("bf16_out") = false);
  m.def("rmsnorm", &rmsnorm, "RMS norm of each row, float32 inside, in one call (floats.cpp)");
  m.def("bf16_native", &bf16_native, "whether bmm16 runs here (AVX512-BF16)");
  m.def("accelerated", &accelerated, "whether the AVX2 path runs here");
}
