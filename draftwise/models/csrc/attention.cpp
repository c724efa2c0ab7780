// draftwise's attention for decoding and verification feeds: every query is computed over the keys it may see, one
// after another in cache order, by arithmetic that depends on nothing but that query and those keys. A token's
// attention output is therefore the same bits whether the forward carries it alone, beside 15 other tokens of its
// row (a verification, a token tree), or beside 31 other rows: PyTorch's scaled_dot_product_attention picks its
// blocking and its reduction order from the shapes of the whole call, which moves the last bits of a row's result
// with its batch-mates (found by swapping it alone for a per-query reference: every other operation of the
// forward already gave equal bits).
//
// For one query head h (kv head h / G) and its visible keys j_1 < j_2 < ... < j_L:
//   s_l = (q . k_{j_l}) * scale       8-lane products over the head dimension, two accumulators, one fixed hsum
//   p_l = exp(s_l - max_l s_l)        one vectorised exp, lanes assigned by l (the key's rank among the visible)
//   o   = (sum_l p_l v_{j_l}) / sum_l p_l    both sums in l order
// A task is one kv head and one query token, or (AVX2, a wide feed) a tile of up to 8 query tokens of a row: the G
// query heads that share the kv head, and the tile's queries, read each key once.
#include <torch/extension.h>
#include "simd.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AT_X86 1
#endif

namespace {

constexpr int TILE = 8;  // the most queries a task takes (the AVX2 path's tile)

struct Task {
  const float *q, *keys, *values;  // q: [G, D] of this token; keys, values: [C, D] of this row and kv head
  const bool* visible;             // [KV] or null (every key 0 .. kv - 1)
  int64_t kv, G, D;
  float scale;
  float* out;                      // [G, D]
};

// The visible keys' indices, in order.
void visible_keys(const Task& t, std::vector<int32_t>& index) {
  index.clear();
  for (int64_t j = 0; j < t.kv; ++j)
    if (t.visible == nullptr || t.visible[j]) index.push_back(int32_t(j));
}

void task_scalar(const Task& t, std::vector<int32_t>& index, std::vector<float>& scores) {
  visible_keys(t, index);
  const int64_t L = int64_t(index.size()), D = t.D;
  scores.resize(t.G * (L + 8));
  for (int64_t g = 0; g < t.G; ++g) {
    float* s = scores.data() + g * (L + 8);
    const float* q = t.q + g * D;
    float top = -INFINITY;
    for (int64_t l = 0; l < L; ++l) {
      const float* k = t.keys + int64_t(index[l]) * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
      s[l] = dot * t.scale;
      top = std::max(top, s[l]);
    }
    float total = 0.f;
    for (int64_t l = 0; l < L; ++l) { s[l] = std::exp(s[l] - top); total += s[l]; }
    float* o = t.out + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t l = 0; l < L; ++l) {
      const float* v = t.values + int64_t(index[l]) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += s[l] * v[d];
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

AT_TARGET inline float dot(const float* a, const float* b, int64_t D) {  // D a multiple of 8
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  if (d < D) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  return hsum(_mm256_add_ps(s0, s1));
}

// Up to TILE queries of one row and kv head, each computed exactly as it would be alone: its visible keys in
// order, its own scores, maximum, exponentials (lanes by the key's rank among its visible keys), total and output
// sums in that order. Only the loops are interchanged: each key (and value) is loaded once for every query of the
// tile that sees it, so a prompt chunk reads the cache once per tile rather than once per query.
struct Tile {
  Task query[TILE];
  int n;
};

AT_TARGET void tile_avx2(const Tile& tile, std::vector<int32_t>* index, std::vector<float>* scores,
                         std::vector<float>& totals) {
  const Task& t0 = tile.query[0];
  const int64_t D = t0.D, G = t0.G;
  int64_t L[TILE], stride[TILE], cursor[TILE], last = -1;
  for (int i = 0; i < tile.n; ++i) {
    visible_keys(tile.query[i], index[i]);
    L[i] = int64_t(index[i].size());
    stride[i] = (L[i] + 7) / 8 * 8;
    scores[i].resize(G * stride[i] + 8);
    cursor[i] = 0;
    if (L[i]) last = std::max(last, int64_t(index[i][L[i] - 1]));
  }
  for (int64_t j = 0; j <= last; ++j) {  // each key read once for every query (and the G heads) that see it
    const float* k = t0.keys + j * D;
    for (int i = 0; i < tile.n; ++i) {
      if (cursor[i] >= L[i] || index[i][cursor[i]] != j) continue;
      const Task& t = tile.query[i];
      for (int64_t g = 0; g < G; ++g) scores[i][g * stride[i] + cursor[i]] = dot(t.q + g * D, k, D) * t.scale;
      ++cursor[i];
    }
  }
  totals.resize(TILE * G);
  for (int i = 0; i < tile.n; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores[i].data() + g * stride[i];
      float top = -INFINITY;
      for (int64_t l = 0; l < L[i]; ++l) top = std::max(top, s[l]);
      for (int64_t l = L[i]; l < stride[i]; ++l) s[l] = top;  // tail lanes: computed, never summed
      const __m256 m = _mm256_set1_ps(top);
      for (int64_t l = 0; l < stride[i]; l += 8)
        _mm256_storeu_ps(s + l, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + l), m)));
      float total = 0.f;
      for (int64_t l = 0; l < L[i]; ++l) total += s[l];
      totals[i * G + g] = total;
      std::memset(tile.query[i].out + g * D, 0, sizeof(float) * D);
    }
    cursor[i] = 0;
  }
  // the values, a block of keys at a time (the block stays in L1 while every query of the tile reads it); a
  // query's output lanes stay in registers over the block: each lane's multiply-adds are the same, in key order
  constexpr int64_t BLOCK = 64;
  for (int64_t j0 = 0; j0 <= last; j0 += BLOCK) {
    const int64_t j1 = j0 + BLOCK;
    for (int i = 0; i < tile.n; ++i) {
      const int64_t c0 = cursor[i];
      int64_t c1 = c0;
      while (c1 < L[i] && index[i][c1] < j1) ++c1;
      cursor[i] = c1;
      if (c1 == c0) continue;
      const int32_t* keys_of = index[i].data();
      for (int64_t g = 0; g < G; ++g) {
        const float* p = scores[i].data() + g * stride[i];
        float* o = tile.query[i].out + g * D;
        for (int64_t d = 0; d < D; d += 32) {
          const int lanes = int(std::min<int64_t>(4, (D - d) / 8));
          __m256 acc[4];
          for (int r = 0; r < lanes; ++r) acc[r] = _mm256_loadu_ps(o + d + 8 * r);
          for (int64_t c = c0; c < c1; ++c) {
            const __m256 w = _mm256_set1_ps(p[c]);
            const float* v = t0.values + int64_t(keys_of[c]) * D + d;
            for (int r = 0; r < lanes; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * r), acc[r]);
          }
          for (int r = 0; r < lanes; ++r) _mm256_storeu_ps(o + d + 8 * r, acc[r]);
        }
      }
    }
  }
  for (int i = 0; i < tile.n; ++i) {
    if (L[i] == 0) continue;
    for (int64_t g = 0; g < G; ++g) {
      const __m256 total = _mm256_set1_ps(totals[i * G + g]);
      float* o = tile.query[i].out + g * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(o + d), total));
    }
  }
}

const auto has_avx2 = draftwise_simd::avx2_fma;
#endif

}  // namespace

// q: [R, W, H, D]; keys, values: [R, KVH, C, D] (the forward's cache rows); visible: [R, W, KV] bool or None (every
// key 0 .. kv - 1); counts: real queries a row (the rest are padding, left zero). Returns [R, W, H, D].
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> visible,
                     std::vector<int64_t> counts, int64_t kv, double scale, bool portable) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [R, W, H, D] float32");
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == torch::kFloat32 && keys.is_contiguous() &&
              values.sizes() == keys.sizes() && values.scalar_type() == torch::kFloat32 && values.is_contiguous(),
              "keys, values: [R, KVH, C, D] float32, contiguous");
  const int64_t R = q.size(0), W = q.size(1), H = q.size(2), D = q.size(3), KVH = keys.size(1), C = keys.size(2);
  TORCH_CHECK(keys.size(0) == R && keys.size(3) == D && KVH > 0 && H % KVH == 0, "q and keys do not match");
  TORCH_CHECK(int64_t(counts.size()) == R, "one count a row");
  TORCH_CHECK(kv >= 0 && kv <= C, "kv past the cache");
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
  const float* qp = q.data_ptr<float>();
  const float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef AT_X86
  const bool fast = !portable && has_avx2() && D % 8 == 0;
#else
  const bool fast = false;
#endif
  // queries a task takes: a tile of a wide feed (a prompt chunk), or of any feed over a long context, shares its
  // key loads; narrow feeds over short contexts (decoding, verification) keep one query a task, for more tasks to
  // share out. Each query's bits are the same either way.
#ifdef AT_X86
  const int64_t per = fast && W > 1 && (W >= 2 * TILE || kv >= 1024) ? TILE : 1;
#else
  const int64_t per = 1;
#endif
  const int64_t spans = (W + per - 1) / per;
  at::parallel_for(0, R * spans * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> index[TILE];
    std::vector<float> scores[TILE], totals;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (spans * KVH), span = (t / KVH) % spans, g = t % KVH;
      const int64_t w0 = span * per, w1 = std::min(std::min(W, w0 + per), counts[r]);
      auto task = [&](int64_t w) {
        return Task{qp + ((r * W + w) * H + g * G) * D, kp + (r * KVH + g) * C * D, vp + (r * KVH + g) * C * D,
                    mask ? mask + (r * W + w) * mask_kv : nullptr, kv, G, D, float(scale),
                    op + ((r * W + w) * H + g * G) * D};
      };
      if (w0 >= w1) continue;
#ifdef AT_X86
      if (fast) {
        Tile tile;
        tile.n = int(w1 - w0);
        for (int64_t w = w0; w < w1; ++w) tile.query[w - w0] = task(w);
        tile_avx2(tile, index, scores, totals);
        continue;
      }
#endif
      for (int64_t w = w0; w < w1; ++w) task_scalar(task(w), index[0], scores[0]);
    }
  });
  return out;
}
