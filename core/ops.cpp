// The decoder's small ops fused, for the CPU: what torch runs as five to seven ops each (an
// RMSNorm, a residual add and the next RMSNorm, rotary embedding, SiLU times the up projection) in
// one pass over the rows. In a decode step every op costs a few microseconds of dispatch whatever
// its size, and a small model's step runs hundreds of them.
//
// Each op computes what core/model.py's torch code computes, rounding where it rounds: float32
// math, with a bf16 result rounded back to bf16 wherever torch's bf16 ops round (so bf16 models see
// the same numbers up to the order of the sums).
//
// Built on first use by core/native.py; registered as torch.ops.pagechat.* so traced steps record
// them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kGrainElems = 1 << 16;  // below this a thread split costs more than it saves

using pagechat::load8;
using pagechat::round8;
using pagechat::store8;
using pagechat::sum8;

template <class T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// torch's bf16 ops compute in float and round each result to bf16; float32 ops round to float.
template <class T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 2, op,
              ": a contiguous CPU tensor [..., H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bf16");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  TORCH_CHECK(weight.numel() == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              op, ": a weight [H] in x's dtype");
}

// Calls f with a null pointer of x's element type: float or bf16, the types the ops check for (the
// vector loads have no double form).
template <class F>
void with_type(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) return f(static_cast<float*>(nullptr));
  f(static_cast<at::BFloat16*>(nullptr));
}

// Calls f with a null pointer of a KV cache's element type: float32, float16 or bf16 (the ops
// check for those).
template <class F>
void with_cache_type(at::ScalarType cache, F&& f) {
  if (cache == at::kFloat) return f(static_cast<float*>(nullptr));
  if (cache == at::kHalf) return f(static_cast<at::Half*>(nullptr));
  f(static_cast<at::BFloat16*>(nullptr));
}

template <class F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(width, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) body(r);
                   });
}

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, as RMSNorm.forward: float32
// math; in bf16 the normalised row is rounded to bf16 before the weight multiplies it.
template <class T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t h, T* y) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) squares = _mm256_fmadd_ps(load8(x + i), load8(x + i), squares);
  float ss = sum8(squares);
  for (; i < h; ++i) ss += f32(x[i]) * f32(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (i = 0; i + 8 <= h; i += 8) {
    const __m256 normed = round8<T>(_mm256_mul_ps(load8(x + i), _mm256_set1_ps(r)));
    store8(y + i, _mm256_mul_ps(load8(w + i), normed));
  }
  for (; i < h; ++i) y[i] = static_cast<T>(f32(w[i]) * round_to<T>(f32(x[i]) * r));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(weight, x, "rms_norm");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  with_type(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) {
      rms_norm_row(xp + r * h, wp, static_cast<float>(eps), h, yp + r * h);
    });
  });
  return y;
}

// (rms_norm(x + residual), x + residual): the residual add between two sublayers and the norm
// of the next, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.is_contiguous(),
              "add_rms_norm: a residual shaped as x");
  check_weight(weight, x, "add_rms_norm");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  with_type(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *yp = y.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) {
      const int64_t at = r * h;
      int64_t i = 0;
      for (; i + 8 <= h; i += 8) {
        store8(sp + at + i, _mm256_add_ps(load8(xp + at + i), load8(rp + at + i)));
      }
      for (; i < h; ++i) sp[at + i] = static_cast<scalar_t>(f32(xp[at + i]) + f32(rp[at + i]));
      rms_norm_row(sp + r * h, wp, static_cast<float>(eps), h, yp + r * h);
    });
  });
  return {y, sum};
}

// One task's buffers in prefill_attention (below), for attention_tiles.h: rows are its query heads
// times its queries, padded to a multiple of 16.
struct Block {
  int64_t rows, d, n;  // n: the keys of the current chunk
  const float* qt;     // [d][rows]: the queries, scaled
  const float* kf;     // [n][d]: the chunk's keys
  const float* vf;     // [n][d]: the chunk's values
  float* st;           // [n][rows]: scores, then their exponentials
  float* ot;           // [d][rows]: the values' sums, unnormalised
  float* top;          // [rows]: each row's largest score so far (-inf before any)
  float* total;        // [rows]: each row's sum of exponentials below it
  const float* pos;    // [rows]: each row's position
};

using pagechat::Vec8;
using pagechat::Vec16;

namespace avx2 {
using V = Vec8;
#include "attention_tiles.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
using V = Vec16;
#include "attention_tiles.h"
}  // namespace avx512
#pragma GCC pop_options

using avx2::vexp;

// silu(gate) * up for gate_up [..., 2I] = (gate, up): MLP's activation, as torch rounds it. The
// exponentials 8 at a time into a row of floats (torch's vectorised exp: a scalar one per element
// cost more than torch's two ops), then the roundings and the product element by element.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t i2 = gate_up.size(-1), inter = i2 / 2, rows = gate_up.numel() / i2;
  TORCH_CHECK(i2 % 2 == 0, "silu_mul: gate and up of one size");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor y = at::empty(shape, gate_up.options());
  // float32 or bf16 (check_rows): the vector loads have no double form
  auto run = [&](const auto* gp) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(gp)>>;
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, i2, [&](int64_t r) {
      const scalar_t* g = gp + r * i2;
      std::vector<float> silu(inter);
      int64_t i = 0;
      for (; i + 8 <= inter; i += 8) {
        const __m256 v = load8(g + i);
        const __m256 e = vexp(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(&silu[i], _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
      }
      for (; i < inter; ++i) silu[i] = f32(g[i]) / (1.0f + std::exp(-f32(g[i])));
      scalar_t* y = yp + r * inter;
      for (i = 0; i + 8 <= inter; i += 8) {
        const __m256 rounded = round8<scalar_t>(_mm256_loadu_ps(&silu[i]));
        store8(y + i, _mm256_mul_ps(rounded, load8(g + inter + i)));
      }
      for (; i < inter; ++i) {
        y[i] = static_cast<scalar_t>(round_to<scalar_t>(silu[i]) * f32(g[inter + i]));
      }
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    run(gate_up.data_ptr<float>());
  } else {
    run(gate_up.data_ptr<at::BFloat16>());
  }
  return y;
}

// One head's rotary embedding: y = x * cos + (x rolled by D/2) * sin, with core/model.py's cos and
// signed sin rows [D], where the roll brings x's other half to each position; each product
// rounded to T, as torch's ops round.
template <class T>
void rope_row(const T* x, const T* c, const T* s, int64_t d, T* y) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {  // 8 of each half at a time
    const __m256 lo = load8(x + i), hi = load8(x + half + i);
    const auto rotate = [&](__m256 v, __m256 other, int64_t at) {
      return _mm256_add_ps(round8<T>(_mm256_mul_ps(v, load8(c + at))),
                           round8<T>(_mm256_mul_ps(other, load8(s + at))));
    };
    store8(y + i, rotate(lo, hi, i));
    store8(y + half + i, rotate(hi, lo, half + i));
  }
  for (; i < half; ++i) {
    for (const int64_t at : {i, half + i}) {
      const float a = round_to<T>(f32(x[at]) * f32(c[at]));
      const float b = round_to<T>(f32(x[(at + half) % d]) * f32(s[at]));
      y[at] = static_cast<T>(a + b);
    }
  }
}

// rope's checks of cos and sin: [T, 1, D] rows in x's dtype.
void check_rope_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t t, int64_t d, const char* op) {
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.numel() == t * d && sin.numel() == t * d && cos.is_contiguous() &&
                  sin.is_contiguous(),
              op, ": cos and sin [T, 1, D] in x's dtype");
}

// Rotary embedding of x [T, heads, D] with core/model.py's tables cos and signed sin [T, 1, D]
// (rope_row). x may be a slice of the fused qkv projection's rows (any row and head strides); the
// result is dense.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope: a CPU x [T, heads, D] with D even and D's elements adjacent");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rope: float32 or bf16");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  check_rope_tables(x, cos, sin, t, d, "rope");
  at::Tensor y = at::empty({t, heads, d}, x.options());
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  with_type(x, [&](auto* type) {
    using scalar_t = std::remove_pointer_t<decltype(type)>;
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(t * heads, d, [&](int64_t row) {
      const int64_t r = row / heads;
      rope_row(xp + r * row_stride + (row % heads) * head_stride, cp + r * d, sp + r * d, d,
               yp + row * d);
    });
  });
  return y;
}

// One row's largest value and the index of its first occurrence: strictly greater replaces, so
// each lane keeps its first maximum, and ties between lanes go to the lower index. A NaN anywhere
// makes the value NaN.
void row_max_one(const float* x, int64_t n, float* value, int64_t* index) {
  float best = -INFINITY;
  int64_t at = 0;
  bool nan = false;
  int64_t i = 0;
  if (n >= 8) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = lane;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
      top = _mm256_blendv_ps(top, v, gt);
      where = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(lane), gt));
      lane = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
    }
    alignas(32) float tops[8];
    alignas(32) int32_t wheres[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(wheres), where);
    best = tops[0], at = wheres[0];
    for (int l = 1; l < 8; ++l) {
      if (tops[l] > best || (tops[l] == best && wheres[l] < at)) best = tops[l], at = wheres[l];
    }
    nan = _mm256_movemask_ps(unordered) != 0;
  }
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    if (x[i] > best) best = x[i], at = i;
  }
  *value = nan ? NAN : best;
  *index = at;
}

// Scores of H query heads (qf: [H, d], scaled) against one key row: each 8 of the key's values
// widened once for all H heads.
template <int H, class C>
inline void score_row(const float* qf, int64_t d, const C* kr, float* out, int64_t stride) {
  __m256 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    const __m256 kv = load8(kr + j);
    for (int h = 0; h < H; ++h)
      acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + h * d + j), kv, acc[h]);
  }
  for (int h = 0; h < H; ++h) out[h * stride] = sum8(acc[h]);
}

// The context is read through the gather slots, so a head's key (or value) rows lie kv_heads rows
// apart within a block and blocks anywhere in the pool: each key row's lines, and its value row's,
// are asked for kAhead rows before the key is read (the hardware prefetcher does not follow the
// slots), into L2: asked into L1 (T0), the requests filled L1's few miss buffers and the op ran as
// slowly as reading without them (SmolLM2's shape from memory, 2,000 keys: 165-179 us a layer
// against 113-121 into L2 with the values asked for beside the keys).
constexpr int64_t kAhead = 16;
template <class C>
inline void prefetch_row(const C* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = d * static_cast<int64_t>(sizeof(C));
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Scores of G query heads (qf: [G, d], scaled) against 4 key rows kr[u] read in the cache's dtype:
// per chunk of 8, each key widened once for the G heads (G x 4 sums and a key: 13 of the 16
// registers at G = 3), and each sum's 8 lanes added in one tree, ((l0 + l1) + (l2 + l3)) + ((l4 +
// l5) + (l6 + l7)), 4 sums at once (a row's sum on its own took as many operations as its products
// at d = 64). The keys used to be widened into a float buffer first, 8 for all heads' sums: perf
// put most of the op's own samples on that loop's loads and stores (docs/benchmarks.md, part 18).
template <int G, class C>
inline void score_4_keys(const float* qf, int64_t d, const C* const* kr, float* out,
                         int64_t stride) {
  __m256 acc[G][4];
  for (int h = 0; h < G; ++h)
    for (int u = 0; u < 4; ++u) acc[h][u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    for (int u = 0; u < 4; ++u) {
      const __m256 k = load8(kr[u] + j);
      for (int h = 0; h < G; ++h) {
        acc[h][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + h * d + j), k, acc[h][u]);
      }
    }
  }
  for (int h = 0; h < G; ++h) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]),
                                    _mm256_hadd_ps(acc[h][2], acc[h][3]));
    _mm_storeu_ps(out + h * stride,
                  _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
  }
}

// acc[h][j0 .. j0 + 8 NV) = sum over the context of weight[h][t] * value row t, for H heads: the
// H x NV sums stay in registers over the whole context, each 8 values widened once.
template <int H, int NV, class C>
inline void weigh_values(const float* weight, int64_t n, const C* vc, const int64_t* rows,
                         int64_t row_stride, int64_t j0, float* acc, int64_t d) {
  __m256 a[H][NV];
  for (int h = 0; h < H; ++h)
    for (int u = 0; u < NV; ++u) a[h][u] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const C* vr = vc + rows[t] * row_stride + j0;
    // the H weights held and one chunk of 8 values at a time: H x NV + H + 1 registers, where
    // holding the NV chunks instead spilled a sum at every row (H = 3, NV = 4: 17 of 16)
    __m256 w[H];
    for (int h = 0; h < H; ++h) w[h] = _mm256_set1_ps(weight[h * n + t]);
    for (int u = 0; u < NV; ++u) {
      const __m256 vv = load8(vr + 8 * u);
      for (int h = 0; h < H; ++h) a[h][u] = _mm256_fmadd_ps(w[h], vv, a[h][u]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + h * d + j0 + 8 * u, a[h][u]);
}

// One query head group's attention over `n` context rows (the gather slots `rows`): per head, the
// largest score, the sum of the exponentials below it, and the values weighed by them, unnormalised
// (acc [group, d]), so that pieces of one context can be merged.
template <class T, class C>
void attend_piece(const T* qrow, int64_t q_head_stride, float scale, const C* kc, const C* vc,
                  int64_t kv_heads, int64_t g, int64_t group, int64_t d, const int64_t* rows,
                  int64_t n, std::vector<float>& scores, float* qf, float* acc, float* top,
                  float* total) {
  for (int64_t h = 0; h < group; ++h) {
    const T* qs = qrow + (g * group + h) * q_head_stride;
    for (int64_t j = 0; j < d; ++j) qf[h * d + j] = f32(qs[j]) * scale;
  }
  constexpr int64_t kScoreHeads = 8;
  scores.resize(group * n);
  int64_t done = 0;  // keys scored
  for (; done + 4 <= n; done += 4) {
    const C* kr[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t ahead = done + u + kAhead;
      if (ahead < n) {
        prefetch_row(kc + (rows[ahead] * kv_heads + g) * d, d);
        prefetch_row(vc + (rows[ahead] * kv_heads + g) * d, d);
      }
      kr[u] = kc + (rows[done + u] * kv_heads + g) * d;
    }
    for (int64_t h0 = 0; h0 < group; h0 += 3) {
      pagechat::with_count<3>(std::min<int64_t>(group - h0, 3), [&](auto heads) {
        score_4_keys<heads()>(&qf[h0 * d], d, kr, &scores[h0 * n + done], n);
      });
    }
  }
  for (int64_t h0 = 0; h0 < group; h0 += kScoreHeads) {  // the rest: up to 8 heads a row
    pagechat::with_count<kScoreHeads>(std::min(group - h0, kScoreHeads), [&](auto heads) {
      for (int64_t t = done; t < n; ++t) {
        const C* kr = kc + (rows[t] * kv_heads + g) * d;
        score_row<heads()>(&qf[h0 * d], d, kr, &scores[h0 * n + t], n);
      }
    });
  }
  for (int64_t h = 0; h < group; ++h) {  // the exponentials 8 at a time, as silu_mul's
    float* sc = &scores[h * n];
    int64_t at;  // the first index of the largest: unused here
    row_max_one(sc, n, &top[h], &at);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = vexp(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(top[h])));
      _mm256_storeu_ps(sc + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[h] = sum8(sum);
    for (; t < n; ++t) total[h] += (sc[t] = std::exp(sc[t] - top[h]));
  }
  // up to 4 heads by 32 values (12 registers of sums), fewer values for the last ones
  const int64_t row_stride = kv_heads * d;
  const C* vg = vc + g * d;
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    pagechat::with_count<4>(std::min<int64_t>(group - h0, 4), [&](auto heads) {
      constexpr int H = heads(), NV = H == 4 ? 2 : 4;  // registers: see weigh_values
      const float* w = &scores[h0 * n];
      int64_t j0 = 0;
      for (; j0 + 8 * NV <= d; j0 += 8 * NV) {
        weigh_values<H, NV>(w, n, vg, rows, row_stride, j0, &acc[h0 * d], d);
      }
      for (; j0 < d; j0 += 8) weigh_values<H, 1>(w, n, vg, rows, row_stride, j0, &acc[h0 * d], d);
    });
  }
}

// A context of this many keys or more is attended in pieces of at least kPieceKeys, up to
// kMaxPieces, merged after (flash-decoding), where the batch's kv heads are fewer than 4 tasks a
// thread: one sequence's few kv heads are otherwise as many tasks, and two threads over a model's
// 3 kv heads wait on the one that has two. SmolLM2's shape,
// bf16, the KV from memory: 2,000 keys 186-200 us a layer whole, 157-171 in pieces; 4,000 keys
// 371-475 against 280-315. Shorter contexts stay whole: at 64-400 keys the pieces' fork and merge
// cost what they save.
constexpr int64_t kPieceKeys = 256, kSplitKeys = 512, kMaxPieces = 8;

// A decode attention call's operands as pointers: the rows' queries [B, H, D] and their new keys
// and values [B, KV, D], each with its row and head strides (a head's D elements adjacent), the
// layer's K and V caches [slots, KV, D], and the output [B, H, D], dense.
template <class T, class C>
struct DecodeRows {
  const T *q, *k, *v;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t b, heads, kv_heads, d;
  C *kc, *vc;
  T* out;
};

// Rows [i0, i1) of k and v [B, KV, D] (each with its row and head strides, a head's D elements
// adjacent) into the caches [slots, KV, D] at slots[i], in the cache's dtype, 8 values at a time.
template <class T, class C>
void write_kv_rows(const T* k, const T* v, int64_t k_row, int64_t k_head, int64_t v_row,
                   int64_t v_head, int64_t kv_heads, int64_t d, const int64_t* slots, C* kc,
                   C* vc, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      C* kd = kc + (slots[i] * kv_heads + g) * d;
      C* vd = vc + (slots[i] * kv_heads + g) * d;
      const T* ks = k + i * k_row + g * k_head;
      const T* vs = v + i * v_row + g * v_head;
      for (int64_t j = 0; j < d; j += 8) {
        store8(kd + j, load8(ks + j));
        store8(vd + j, load8(vs + j));
      }
    }
  }
}

// The attention of sequences' new tokens, per_seq a sequence (a decode step: one; a draft's
// verification or a short prompt: several): write each token's K and V into the paged cache, then
// attend its query to its context up to its own position (causal, with no mask), read in place
// through the gather slots, without copying the context out as the torch path must (index_select
// of every position, then scaled_dot_product_attention). Row i is sequence i / per_seq's, whose
// slots are gather[i / per_seq * row_len ...]. Each kv head's keys and values are read once for
// the query heads that share them (GQA). Softmax in float32, as scaled_dot_product_attention does.
template <class T, class C>
void decode_attention_impl(const DecodeRows<T, C>& r, const int64_t* slots, const int64_t* gather,
                           int64_t row_len, int64_t per_seq, const int64_t* q_pos,
                           int64_t window) {
  const int64_t b = r.b, heads = r.heads, d = r.d, kv_heads = r.kv_heads;
  const int64_t group = heads / kv_heads;
  C *kc = r.kc, *vc = r.vc;
  write_kv_rows(r.k, r.v, r.k_row, r.k_head, r.v_row, r.v_head, kv_heads, d, slots, kc, vc, 0, b);
  // Per sequence its pieces, and where its parts start: part (i, g, p) holds kv head g's piece p.
  // A whole context is one task per kv head; a context in pieces is one task per piece, over
  // every kv head (at 4,000 keys, from memory: 280-315 us a layer, against 303-337 with a task
  // per head and piece).
  struct Task {
    int64_t i, g0, g1, p;
  };
  std::vector<int64_t> pieces(b), first(b + 1, 0), keys(b), start(b);
  std::vector<Task> tasks;
  // pieces only where the heads make too few tasks for the threads, and no more than they need;
  // not for rows of several a sequence, so that each row's sums do not depend on how many
  // sequences share the call (a step graph's one call, the eager step's one a sequence)
  const int64_t threads = at::get_num_threads();
  const bool few = per_seq == 1 && b * kv_heads < 4 * threads;
  const int64_t most = std::min(kMaxPieces, (4 * threads + b - 1) / b);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t ctx = q_pos[i] + 1;
    start[i] = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    keys[i] = ctx - start[i];
    pieces[i] = keys[i] < kSplitKeys || !few ? 1 : std::min(most, keys[i] / kPieceKeys);
    first[i + 1] = first[i] + kv_heads * pieces[i];
  }
  for (int64_t r = 0; r < b; ++r) {
    // rows from both ends in turn: the threads take the tasks in contiguous runs, and the rows'
    // contexts differ (a 128-token prompt's rows in one call: 270 us a layer against 370)
    const int64_t i = r % 2 == 0 ? r / 2 : b - 1 - r / 2;
    if (pieces[i] == 1) {
      for (int64_t g = 0; g < kv_heads; ++g) tasks.push_back({i, g, g + 1, 0});
    } else {
      for (int64_t p = 0; p < pieces[i]; ++p) tasks.push_back({i, 0, kv_heads, p});
    }
  }
  const int64_t stride = group * (d + 2);  // a part: the values [group, d], maxima, sums
  std::vector<float> parts(first[b] * stride);
  const auto part = [&](int64_t i, int64_t g, int64_t p) {
    return &parts[(first[i] + g * pieces[i] + p) * stride];
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(group * d), scores;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const int64_t i = task.i, n = keys[i], m = pieces[i];
      const int64_t from = n * task.p / m, to = n * (task.p + 1) / m;
      for (int64_t g = task.g0; g < task.g1; ++g) {
        float* out = part(i, g, task.p);
        attend_piece(r.q + i * r.q_row, r.q_head, scale, kc, vc, kv_heads, g, group, d,
                     gather + i / per_seq * row_len + start[i] + from, to - from, scores,
                     qf.data(), out, out + group * d, out + group * (d + 1));
      }
    }
  });
  T* op = r.out;
  std::vector<float> o(d);
  for (int64_t i = 0; i < b; ++i) {  // each head's pieces merged at their largest score
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t h = 0; h < group; ++h) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < pieces[i]; ++p) top = std::max(top, part(i, g, p)[group * d + h]);
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t p = 0; p < pieces[i]; ++p) {  // one piece: a weight of exactly 1
          const float* pp = part(i, g, p);
          const float w = std::exp(pp[group * d + h] - top);
          total += w * pp[group * (d + 1) + h];
          for (int64_t j = 0; j < d; ++j) o[j] += w * pp[h * d + j];
        }
        T* dst = op + (i * heads + g * group + h) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(o[j] / total);
      }
    }
  }
}

// Whether every slot in [from, to) lies within a pool of `pool` slots: a bad index is an error, not
// a write or read past the caches.
inline bool in_pool(const int64_t* from, const int64_t* to, int64_t pool) {
  return std::all_of(from, to, [&](int64_t slot) { return slot >= 0 && slot < pool; });
}

// The caches [slots, KV, D] of the rows k [B, KV, D]: contiguous, alike in dtype and shape.
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                  const char* op) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2),
              op, ": caches [slots, KV, D]");
}

// The indices of a decode attention call of B rows, checked: slot_mapping [B] (where each row's K
// and V go), gather [S * ctx] (each sequence's context slots, row after row) and q_pos [S, n]
// (each row's position, within its sequence's ctx slots); every slot a row writes or reads within
// the caches' `pool` slots, so that a bad index is an error, not a write past the pool (a compare
// a key, against the ~100 operations the attention spends on each).
struct DecodeIndex {
  at::Tensor slots, gather, q_pos;
  int64_t ctx, per_seq;

  DecodeIndex(int64_t b, const at::Tensor& slot_mapping, const at::Tensor& gather_,
              const at::Tensor& q_pos_, int64_t pool, const char* op) {
    TORCH_CHECK(q_pos_.dim() == 2 && q_pos_.numel() == b && b > 0 && slot_mapping.numel() == b &&
                    gather_.numel() % q_pos_.size(0) == 0 &&
                    slot_mapping.scalar_type() == at::kLong && gather_.scalar_type() == at::kLong &&
                    q_pos_.scalar_type() == at::kLong,
                op, ": int64 slot_mapping [B], q_pos [S, n], gather [S * ctx]");
    slots = slot_mapping.contiguous(), gather = gather_.contiguous(), q_pos = q_pos_.contiguous();
    ctx = gather.numel() / q_pos.size(0), per_seq = q_pos.size(1);
    const int64_t* pos = q_pos.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(pos, pos + b, [&](int64_t p) { return p >= 0 && p < ctx; }), op,
                ": a position outside its sequence's ", ctx, " context slots");
    const int64_t *sp = slots.data_ptr<int64_t>(), *gp = gather.data_ptr<int64_t>();
    bool inside = in_pool(sp, sp + b, pool);
    for (int64_t i = 0; inside && i < b; i += per_seq) {  // each sequence's slots, once
      const int64_t last = *std::max_element(pos + i, pos + i + per_seq);  // its rows' furthest
      const int64_t* row = gp + i / per_seq * ctx;
      inside = in_pool(row, row + last + 1, pool);
    }
    TORCH_CHECK(inside, op, ": a slot outside the caches' ", pool);
  }

  template <class T, class C>
  void attend(const DecodeRows<T, C>& r, int64_t window) const {
    decode_attention_impl(r, slots.data_ptr<int64_t>(), gather.data_ptr<int64_t>(), ctx, per_seq,
                          q_pos.data_ptr<int64_t>(), window);
  }
};

void check_cache(at::ScalarType cache, const char* op) {
  TORCH_CHECK(cache == at::kFloat || cache == at::kHalf || cache == at::kBFloat16, op,
              ": a float32, float16 or bf16 cache");
}

// A prompt's new K and V, k and v [T, KV, D] (strided rows, a head's D elements adjacent), written
// into the caches [slots, KV, D] at slot_mapping [T] in the cache's dtype: torch's cast then
// index_copy_ took ~4.5 ms of a 128-token prefill of the 135M shape (30 layers, float16 cache).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.size(2) % 8 == 0,
              "write_kv: k and v [T, KV, D], D a multiple of 8");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "write_kv: float32 or bf16 k and v");
  check_caches(k_cache, v_cache, k, "write_kv");
  check_cache(k_cache.scalar_type(), "write_kv");
  const int64_t t = k.size(0), pool = k_cache.size(0);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == t &&
                  slot_mapping.scalar_type() == at::kLong,
              "write_kv: int64 slot_mapping [T]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  TORCH_CHECK(in_pool(sp, sp + t, pool), "write_kv: a slot outside the caches' ", pool);
  with_type(k, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    with_cache_type(k_cache.scalar_type(), [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      const int64_t grain = std::max<int64_t>(1, kGrainElems / (2 * k.size(1) * k.size(2)));
      at::parallel_for(0, t, grain, [&](int64_t i0, int64_t i1) {
        write_kv_rows(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), k.stride(1), v.stride(0),
                      v.stride(1), k.size(1), k.size(2), sp, k_cache.data_ptr<C>(),
                      v_cache.data_ptr<C>(), i0, i1);
      });
    });
  });
}

// q [B, H, D], k and v [B, KV, D] (B = S * n: S sequences' n new tokens each, sequence after
// sequence; rows may be strided views of the qkv projection), caches [slots, KV, D], slot_mapping,
// gather and q_pos as DecodeIndex's, window (0: none) -> [B, H, D] in q's dtype. A decode step's n
// is 1; a draft's verification's a few (core/attention.py's IN_PLACE_ROWS).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& gather, const at::Tensor& q_pos, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1 && q.size(2) % 8 == 0 &&
                  k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "decode_attention: q [B, H, D], k and v [B, KV, D], D a multiple of 8");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: float32 or bf16 q, k, v");
  check_caches(k_cache, v_cache, k, "decode_attention");
  const int64_t b = q.size(0);
  const DecodeIndex index(b, slot_mapping, gather, q_pos, k_cache.size(0), "decode_attention");
  check_cache(k_cache.scalar_type(), "decode_attention");
  at::Tensor out = at::empty({b, q.size(1), q.size(2)}, q.options());
  with_type(q, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    with_cache_type(k_cache.scalar_type(), [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      index.attend(DecodeRows<T, C>{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), q.stride(0),
                                    q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                                    v.stride(1), b, q.size(1), k.size(1), q.size(2),
                                    k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                                    out.data_ptr<T>()},
                   window);
    });
  });
  return out;
}

// A decode step's attention from its fused qkv projection, in one op: the rows' q and k rotated
// (rope_row), the new K and V written, the context attended (decode_attention's), with no tensor
// made but the output: its splits, views, rope and the caches' two halves as tensors made per call
// cost a third of the op at a short context (SmolLM2's shape, 160 keys: 33.6 -> 22.3 us a layer).
// qkv [B, (H + 2 KV) * D] with its rows' elements adjacent, cos and sin as rope's, kv [2, slots,
// KV, D] (the layer's K and V caches), the rest as decode_attention's -> [B, H * D].
at::Tensor qkv_decode_attention(const at::Tensor& qkv, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor kv,
                                const at::Tensor& slot_mapping, const at::Tensor& gather,
                                const at::Tensor& q_pos, int64_t window, int64_t heads) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous() && kv.size(3) % 8 == 0,
              "qkv_decode_attention: kv [2, slots, KV, D], D a multiple of 8");
  const int64_t b = qkv.size(0), kv_heads = kv.size(2), d = kv.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && heads % kv_heads == 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv_decode_attention: qkv [B, (heads + 2 KV) * D]");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qkv_decode_attention: float32 or bf16 qkv");
  check_rope_tables(qkv, cos, sin, b, d, "qkv_decode_attention");
  const DecodeIndex index(b, slot_mapping, gather, q_pos, kv.size(1), "qkv_decode_attention");
  check_cache(kv.scalar_type(), "qkv_decode_attention");
  at::Tensor out = at::empty({b, heads * d}, qkv.options());
  const int64_t rotated = heads + kv_heads, row = qkv.stride(0);
  with_type(qkv, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T *x = qkv.data_ptr<T>(), *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
    std::vector<T> qk(b * rotated * d);  // q's heads, then k's, rotated: [B, H + KV, D]
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t h = 0; h < rotated; ++h) {
        rope_row(x + i * row + h * d, c + i * d, s + i * d, d, &qk[(i * rotated + h) * d]);
      }
    }
    with_cache_type(kv.scalar_type(), [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      C* kc = kv.data_ptr<C>();
      index.attend(DecodeRows<T, C>{qk.data(), qk.data() + heads * d, x + rotated * d,
                                    rotated * d, d, rotated * d, d, row, d, b, heads, kv_heads, d,
                                    kc, kc + kv.stride(0), out.data_ptr<T>()},
                   window);
    });
  });
  return out;
}

// Prefill attention: one sequence's queries, many of them, against its context in the paged cache,
// causal by position (and within a sliding window), with no mask made and the context read in
// place through its slots. SDPA's flash kernel, which the torch path runs after copying the
// context out, took a fifth of a 512-token prefill of the 135M shape and a third of a
// 2,000-token one, at 80-140 GFLOP/s where the GEMMs ran at ~240 (Xeon AVX512, float32).
//
// A task is one kv head and `per` consecutive queries of each query head sharing it (GQA: the
// keys are packed once for all of them), kTaskRows rows in all. It walks the context up to its
// last query's position in chunks of kChunkKeys keys (attention_tiles.h: scores, an online
// softmax, the values), so that the scores stay in L2 at any length. The chunks are the same on
// every CPU, and so are the sums: AVX2 and AVX512 give the same bits, and any number of threads.
constexpr int64_t kChunkKeys = 256, kTaskRows = 96;
// 32 MB: the keys and values of ~21,000 tokens of SmolLM2 (3 kv heads of 64)
constexpr int64_t kKeptFloats = int64_t(1) << 23;

struct PrefillTask {
  int64_t g, q0, q1;  // kv head, queries [q0, q1)
};

// A task's queries, one row per (query head of kv head g, query), as qt [d][rows] scaled, and
// their positions; the padded rows take the last one's position and zero queries.
template <class T>
void gather_queries(const at::Tensor& q, const PrefillTask& t, int64_t group, int64_t start,
                    float scale, int64_t rows, float* qt, float* pos) {
  const int64_t d = q.size(2), nq = t.q1 - t.q0;
  const T* qp = q.data_ptr<T>();
  std::fill(qt, qt + d * rows, 0.0f);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      const T* src = qp + (t.q0 + i) * q.stride(0) + (t.g * group + h) * q.stride(1);
      for (int64_t e = 0; e < d; ++e) qt[e * rows + h * nq + i] = f32(src[e]) * scale;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    pos[r] = static_cast<float>(start + (r < group * nq ? t.q0 + r % nq : t.q1 - 1));
  }
}

// One chunk of attention_tiles.h, on the CPU's widest vectors.
using Chunk = void (*)(const Block&, float, bool, float);

// The context's keys and values as floats, by kv head: kf [kv_heads][ctx][d] and vf the same,
// once for every task (gathered by each task, the copies took 11% of the op at 2,000 tokens).
template <class C>
void gather_context(const C* kc, const C* vc, const int64_t* slots, int64_t ctx,
                    int64_t kv_heads, int64_t d, float* kf, float* vf) {
  at::parallel_for(0, ctx, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t from = (slots[j] * kv_heads + g) * d, to = (g * ctx + j) * d;
        for (int64_t e = 0; e < d; e += 8) {
          store8(kf + to + e, load8(kc + from + e));
          store8(vf + to + e, load8(vc + from + e));
        }
      }
    }
  });
}

// Task t's rows against the context (kf, vf: gather_context's), into out.
template <class T>
void prefill_task(const at::Tensor& q, const float* kf, const float* vf, int64_t ctx,
                  int64_t kv_heads, int64_t start, int64_t window, const PrefillTask& t,
                  Chunk chunk, std::vector<float>& buf, at::Tensor& out) {
  const int64_t d = q.size(2), group = q.size(1) / kv_heads, nq = t.q1 - t.q0;
  const int64_t rows = (group * nq + 15) / 16 * 16;
  buf.resize((2 * d + kChunkKeys + 3) * rows);
  Block b{rows, d, 0};
  float* at = buf.data();
  const auto take = [&](int64_t size) { return std::exchange(at, at + size); };
  float* qt = take(d * rows);
  float* pos = take(rows);
  b.qt = qt, b.pos = pos, b.ot = take(d * rows), b.st = take(kChunkKeys * rows);
  b.top = take(rows), b.total = take(rows);
  gather_queries<T>(q, t, group, start, 1.0f / std::sqrt(static_cast<float>(d)), rows, qt, pos);
  std::fill(b.ot, b.ot + d * rows, 0.0f);
  std::fill(b.top, b.top + rows, -INFINITY);
  std::fill(b.total, b.total + rows, 0.0f);
  const int64_t first = start + t.q0, last = start + t.q1 - 1;  // the rows' positions
  for (int64_t c0 = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0; c0 <= last;
       c0 += kChunkKeys) {
    b.n = std::min(kChunkKeys, last + 1 - c0);
    b.kf = kf + (t.g * ctx + c0) * d, b.vf = vf + (t.g * ctx + c0) * d;
    const bool masked = c0 + b.n - 1 > first || (window > 0 && last - c0 >= window);
    chunk(b, static_cast<float>(c0), masked, static_cast<float>(window));
  }
  T* op = out.data_ptr<T>();
  for (int64_t r = 0; r < group * nq; ++r) {
    T* dst = op + ((t.q0 + r % nq) * q.size(1) + t.g * group + r / nq) * d;
    const float norm = 1.0f / b.total[r];
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(b.ot[e * rows + r] * norm);
  }
}

// q [count, H, D] (rows may be strided), caches [slots, KV, D], slots [start + count] (the
// sequence's context, position by position; its last count are the queries'), window (0: none)
// -> [count, H, D] in q's dtype. The tasks, the longest contexts first, go to whichever thread is
// free.
template <class T, class C>
void prefill_attention_impl(const at::Tensor& q, const C* kc, const C* vc, int64_t kv_heads,
                            const int64_t* slots, int64_t start, int64_t window,
                            at::Tensor& out) {
  const int64_t count = q.size(0), group = q.size(1) / kv_heads;
  const int64_t per = std::min(count, std::max<int64_t>(1, kTaskRows / group));
  std::vector<PrefillTask> tasks;
  for (int64_t q1 = count; q1 > 0; q1 -= per) {
    for (int64_t g = 0; g < kv_heads; ++g) tasks.push_back({g, std::max<int64_t>(0, q1 - per), q1});
  }
  const Chunk chunk = pagechat::avx512_here() ? avx512::attend_chunk : avx2::attend_chunk;
  const int64_t ctx = start + count, d = q.size(2);
  // the context as floats: in a buffer this thread keeps, up to kKeptFloats (a fresh one faulted
  // its pages in anew on every call), else in one of its own
  thread_local std::vector<float> kept;
  std::vector<float> own;
  const int64_t size = 2 * kv_heads * ctx * d;
  std::vector<float>& context = size <= kKeptFloats ? kept : own;
  context.resize(size);
  float *kf = context.data(), *vf = kf + kv_heads * ctx * d;
  gather_context(kc, vc, slots, ctx, kv_heads, d, kf, vf);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      prefill_task<T>(q, kf, vf, ctx, kv_heads, start, window, tasks[t], chunk, buf, out);
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slots, int64_t start,
                             int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.size(0) > 0 && q.size(2) % 8 == 0 &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prefill_attention: q [count, H, D] in float32 or bf16, D a multiple of 8");
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == cache &&
                  k_cache.size(2) == q.size(2) && k_cache.size(1) > 0 &&
                  q.size(1) % k_cache.size(1) == 0 &&
                  (cache == at::kFloat || cache == at::kHalf || cache == at::kBFloat16),
              "prefill_attention: float32, float16 or bf16 caches [slots, KV, D], KV dividing H");
  TORCH_CHECK(start >= 0 && window >= 0 && slots.dim() == 1 &&
                  slots.numel() == start + q.size(0) && slots.scalar_type() == at::kLong,
              "prefill_attention: int64 slots [start + count]");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t pool = k_cache.size(0);
  TORCH_CHECK(in_pool(sp, sp + sl.numel(), pool), "prefill_attention: a slot outside the caches' ",
              pool);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  with_type(q, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const auto attend = [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      prefill_attention_impl<T, C>(q, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                                   k_cache.size(1), sp, start, window, out);
    };
    with_cache_type(cache, attend);
  });
  return out;
}

// x float32 [N, V] -> (each row's largest value [N, 1], its first index [N] int64) in one pass:
// torch's max(dim) took 60-80 us over 49,152 logits (amax 7-9), and the sampler ran both.
std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "row_max: float32 [N, V] on the CPU, V > 0");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), v = xc.size(1);
  at::Tensor values = at::empty({n, 1}, xc.options());
  at::Tensor indices = at::empty({n}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  for_rows(n, v, [&](int64_t r) { row_max_one(xp + r * v, v, vp + r, ip + r); });
  return {values, indices};
}

// The sampler's rows of v logits as tasks: a row a task, or where the rows are fewer than the
// threads (a decode step of few sequences) and wide, each row cut into a part a thread.
// run(body) calls body(task, row, from, to) for every task, task = row * parts + part.
struct RowParts {
  int64_t n, v, parts, chunk;
  RowParts(int64_t n, int64_t v) : n(n), v(v) {
    const int64_t threads = at::get_num_threads();
    parts = n < threads && v >= 1024 * threads ? threads : 1;
    chunk = (v + parts - 1) / parts;
  }
  // part p's ids [from, to)
  std::pair<int64_t, int64_t> span(int64_t p) const {
    const int64_t from = std::min(v, p * chunk);
    return {from, std::min(v, from + chunk)};
  }
  template <class F>
  void run(const F& body) const {
    at::parallel_for(0, n * parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto [from, to] = span(t % parts);
        body(t, t / parts, from, to);
      }
    });
  }
};

// A row's (value, index) pairs best first: the larger value, then the lower index.
struct Ranked {
  float value;
  int64_t index;
  bool operator<(const Ranked& o) const {
    return value > o.value || (value == o.value && index < o.index);
  }
};

// The k best of x[from, to) into `best` (sorted; fewer where NaNs are: one is never taken), read
// 8 at a time against the k-th best so far: nearly every group of 8 is passed over in one compare.
void top_of(const float* x, int64_t from, int64_t to, int64_t k, std::vector<Ranked>& best) {
  best.clear();
  const auto take = [&](int64_t i) {
    const Ranked r{x[i], i};
    if (static_cast<int64_t>(best.size()) == k) {
      if (!(r < best.back())) return;
      best.pop_back();
    } else if (std::isnan(r.value)) {
      return;
    }
    best.insert(std::upper_bound(best.begin(), best.end(), r), r);
  };
  int64_t i = from;
  for (; i < to && static_cast<int64_t>(best.size()) < k; ++i) take(i);
  for (; i + 8 <= to; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(best.back().value), _CMP_GT_OQ))) {
      for (int u = 0; u < 8; ++u) take(i + u);
    }
  }
  for (; i < to; ++i) take(i);
}

// The sum over x[from, to) of e^((x - top) / t).
float exp_sum(const float* x, int64_t from, int64_t to, float top, float t) {
  __m256 sum = _mm256_setzero_ps();
  int64_t i = from;
  const __m256 m = _mm256_set1_ps(top), tv = _mm256_set1_ps(t);
  for (; i + 8 <= to; i += 8) {
    sum = _mm256_add_ps(sum, vexp(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), tv)));
  }
  float total = sum8(sum);
  for (; i < to; ++i) total += std::exp((x[i] - top) / t);
  return total;
}

// The sampling panel's candidates of each row of x [N, V] (float32 logits): the ids of its k
// largest (the larger value first, then the lower id) and then `chosen`'s, [N, k + 1], and their
// probabilities under softmax(x / temps) [N, k + 1], as e^((x - max) / t) over its sum (a
// temperature so small that x / t overflows gives the maxima equal shares, as the sampler's
// limit does). torch's topk and a softmax of the whole row took 85 and 35-92 us over 49,152 ids.
// Fewer rows than threads are cut into a part a thread, whose best k are merged.
std::tuple<at::Tensor, at::Tensor> candidates(const at::Tensor& x, const at::Tensor& temps,
                                              const at::Tensor& chosen, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  k >= 1 && k <= x.size(1),
              "candidates: float32 [N, V] on the CPU and 1 <= k <= V");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(temps.numel() == n && chosen.numel() == n, "candidates: a temperature and id a row");
  const at::Tensor xc = x.contiguous(), tc = temps.to(at::kFloat).contiguous();
  const at::Tensor cc = chosen.to(at::kLong).contiguous();
  const float* xp = xc.data_ptr<float>();
  const RowParts rows(n, v);
  const int64_t parts = rows.parts;
  std::vector<std::vector<Ranked>> tops(n * parts);
  rows.run([&](int64_t t, int64_t r, int64_t from, int64_t to) {
    top_of(xp + r * v, from, to, k, tops[t]);
  });
  std::vector<std::vector<Ranked>> best(n);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t p = 0; p < parts; ++p) {
      best[r].insert(best[r].end(), tops[r * parts + p].begin(), tops[r * parts + p].end());
    }
    std::sort(best[r].begin(), best[r].end());
    TORCH_CHECK(static_cast<int64_t>(best[r].size()) >= k, "candidates: NaN logits in row ", r);
    best[r].resize(k);
  }
  const float* tp = tc.data_ptr<float>();
  std::vector<float> sums(n * parts);
  rows.run([&](int64_t t, int64_t r, int64_t from, int64_t to) {
    sums[t] = exp_sum(xp + r * v, from, to, best[r][0].value, tp[r]);
  });
  at::Tensor ids = at::empty({n, k + 1}, cc.options());
  at::Tensor probs = at::empty({n, k + 1}, xc.options());
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  const int64_t* cp = cc.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    float total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) total += sums[r * parts + p];
    const float top = best[r][0].value;
    for (int64_t j = 0; j <= k; ++j) {
      const int64_t id = j < k ? best[r][j].index : cp[r];
      ip[r * (k + 1) + j] = id;
      pp[r * (k + 1) + j] = std::exp((xp[r * v + id] - top) / tp[r]) / total;
    }
  }
  return {ids, probs};
}

// The first id of a row's weights w (in rows' parts, whose sums are given) whose cumulative weight
// exceeds target: whole parts skipped, then 8 weights at a time; where target rounds up to the
// total, the last id that weighs anything.
int64_t inverse_cdf(const float* w, const RowParts& rows, const double* part_sums, double target) {
  const int64_t v = rows.v;
  double cum = 0.0;
  for (int64_t p = 0; p < rows.parts; ++p) {
    const auto [from, to] = rows.span(p);
    if (cum + part_sums[p] <= target) {
      cum += part_sums[p];
      continue;
    }
    int64_t i = from;
    for (double next; i + 8 <= to && (next = cum + sum8(_mm256_loadu_ps(w + i))) <= target;
         i += 8) {
      cum = next;
    }
    for (; i < to; ++i) {
      if ((cum += w[i]) > target) return i;
    }
  }
  int64_t last = v - 1;
  while (last > 0 && w[last] == 0.0f) --last;
  return last;
}

// w[i] = e^(x[i] - top) for i in [from, to), a cut id's (-inf) exactly 0 (vexp floors at
// 2^-126), and their sum in double; each(e) sees every 8 of the weights (the tail's one at a time,
// in lane 0 of zeros).
template <class F>
double weigh(const float* x, float* w, int64_t from, int64_t to, float top, F&& each) {
  const __m256 m = _mm256_set1_ps(top), none = _mm256_set1_ps(-INFINITY);
  double total = 0.0;
  int64_t i = from;
  for (; i + 8 <= to; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 e =
        _mm256_andnot_ps(_mm256_cmp_ps(xv, none, _CMP_EQ_OQ), vexp(_mm256_sub_ps(xv, m)));
    _mm256_storeu_ps(w + i, e);
    total += sum8(e);
    each(e);
  }
  for (; i < to; ++i) {
    total += (w[i] = std::exp(x[i] - top));
    each(_mm256_setr_ps(w[i], 0, 0, 0, 0, 0, 0, 0));
  }
  return total;
}

// One token per row of x [N, V] (processed logits, -inf where cut) drawn from softmax(x) by the
// inverse CDF at u [N] (uniform in [0, 1), float64): the first id whose cumulative e^(x - max)
// exceeds u times their sum, or the last id of nonzero weight where u times the sum rounds up to
// it. The sampler's torch path (a softmax, then a float64 cumsum and two searches) took 110-170 us
// over 49,152 ids; here the weights are worked out once into a buffer, summed 8 at a time a part a
// thread, and only the part holding the target is walked.
at::Tensor softmax_draw(const at::Tensor& x, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "softmax_draw: float32 [N, V] on the CPU, V > 0");
  TORCH_CHECK(u.numel() == x.size(0), "softmax_draw: a uniform a row");
  const at::Tensor xc = x.contiguous(), uc = u.to(at::kDouble).contiguous();
  const int64_t n = xc.size(0), v = xc.size(1);
  const RowParts rows(n, v);
  const int64_t parts = rows.parts;
  const float* xp = xc.data_ptr<float>();
  std::vector<float> top(n * parts);
  // the weights, left unset until written (a zeroed vector cost its own pass)
  const std::unique_ptr<float[]> w(new float[n * v]);
  const auto wr_of = [&](int64_t r) { return w.get() + r * v; };
  std::vector<double> sums(n * parts);
  rows.run([&](int64_t t, int64_t r, int64_t from, int64_t to) {
    int64_t at;
    row_max_one(xp + r * v + from, to - from, &top[t], &at);
  });
  std::vector<float> best(n, -INFINITY);
  for (int64_t t = 0; t < n * parts; ++t) best[t / parts] = std::max(best[t / parts], top[t]);
  rows.run([&](int64_t t, int64_t r, int64_t from, int64_t to) {
    sums[t] = weigh(xp + r * v, wr_of(r), from, to, best[r], [](__m256) {});
  });
  at::Tensor tokens = at::empty({n}, xc.options().dtype(at::kLong));
  int64_t* tp = tokens.data_ptr<int64_t>();
  const double* up = uc.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double total = 0.0;
      for (int64_t p = 0; p < parts; ++p) total += sums[r * parts + p];
      tp[r] = inverse_cdf(wr_of(r), rows, &sums[r * parts], up[r] * total);
    }
  });
  return tokens;
}

// Weights under these (relative to a row's largest, 2^-4 to 2^-24) are summed in top_p_cut's
// pass, so that it can pick the largest under which all tokens together may go.
constexpr int kTopPLevels = 6;
inline float top_p_level(int l) { return std::ldexp(1.0f, -4 * (l + 1)); }

// One row of top_p_cut (below): its removed mask, or false where the row is undecided. w: v
// floats of scratch.
bool top_p_row(const float* x, int64_t v, double thr, double margin, float* w, bool* removed) {
  if (!(thr > 0)) {  // top-p 1 is off
    std::fill(removed, removed + v, false);
    return true;
  }
  float top;
  int64_t at;
  row_max_one(x, v, &top, &at);
  if (!std::isfinite(top)) return false;
  // the weights e^(x - top) (a cut token's 0), their total, and per level the weight under it
  __m256 levels[kTopPLevels], under[kTopPLevels];
  for (int l = 0; l < kTopPLevels; ++l) {
    levels[l] = _mm256_set1_ps(top_p_level(l));
    under[l] = _mm256_setzero_ps();
  }
  const double total = weigh(x, w, 0, v, top, [&](__m256 e) {
    for (int l = 0; l < kTopPLevels; ++l) {
      under[l] = _mm256_add_ps(under[l],
                               _mm256_and_ps(_mm256_cmp_ps(e, levels[l], _CMP_LT_OQ), e));
    }
  });
  double below[kTopPLevels];
  for (int l = 0; l < kTopPLevels; ++l) below[l] = sum8(under[l]);
  // Every token under c weighs at most `below` with all less likely ones, so the mass ranked above
  // it is at least total - below: with below <= thr * total / 2 that is past the limit by half
  // the threshold, far from any rounding. Where no level qualifies (or the threshold is within
  // twice the margin), c = 0: every token not cut is sorted.
  float c = 0.0f;
  for (int l = 0; l < kTopPLevels && thr > 2 * margin; ++l) {
    if (below[l] <= thr * total / 2) {
      c = top_p_level(l);
      break;
    }
  }
  // the tokens at or above c (not cut), 8 weights passed over at a time
  std::vector<Ranked> ranked;
  const auto take = [&](int64_t j) {
    if (w[j] >= c && w[j] > 0.0f) ranked.push_back({x[j], j});
  };
  const __m256 least = _mm256_set1_ps(std::max(c, FLT_MIN));
  int64_t j = 0;
  for (; j + 8 <= v; j += 8) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + j), least, _CMP_GE_OQ))) {
      for (int u = 0; u < 8; ++u) take(j + u);
    }
  }
  for (; j < v; ++j) take(j);
  std::sort(ranked.begin(), ranked.end());
  // keep the token ranked j while the mass ranked above it is under the limit (rank 0 always)
  const double limit = total * (1.0 - thr);
  const int64_t count = static_cast<int64_t>(ranked.size());
  double above = 0.0, above_last = 0.0;
  int64_t kept = 0;
  for (; kept < count && (kept == 0 || above < limit); ++kept) {
    above_last = above;
    above += w[ranked[kept].index];
  }
  // the last kept token (unless it is the top one, kept whatever the sums) and the first
  // removed: within the margin of the limit, or tied, transformers' rounding or sort decides
  const double near = margin * total;
  if (kept > 1 && std::abs(above_last - limit) < near) return false;
  if (kept < count &&
      (std::abs(above - limit) < near || ranked[kept].value == ranked[kept - 1].value)) {
    return false;
  }
  std::fill(removed, removed + v, true);
  for (int64_t r = 0; r < kept; ++r) removed[ranked[r].index] = false;
  return true;
}

// Which tokens top-p removes from each row of x [N, V] (tempered logits, -inf where an earlier
// filter cut), as transformers' TopPLogitsWarper decides: a token goes when the probability of it
// and of every less likely token is <= thresholds[r] (1 - top_p; 0: the row is off); the most
// likely stays. transformers sorts the whole row (4-5 ms for 49,152 logits; the sampler's torch
// path, a shortlist of the 256 likeliest, 0.6-1 ms a row); here one pass works out the weights and
// finds a level under which every token goes, and only the tokens above it are sorted: tens to
// hundreds after a trained model's logits. -> (removed [N, V] bool, undecided [N] bool): a row
// whose cut lies within `margin` (of the whole probability) of the limit, or between two equal
// logits, is left undecided, its mask unset: transformers' float32 sums or its sort's order of
// ties decide it.
std::tuple<at::Tensor, at::Tensor> top_p_cut(const at::Tensor& x, const at::Tensor& thresholds,
                                             double margin) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "top_p_cut: float32 [N, V] on the CPU, V > 0");
  TORCH_CHECK(thresholds.numel() == x.size(0), "top_p_cut: a threshold a row");
  const at::Tensor xc = x.contiguous(), tc = thresholds.to(at::kDouble).contiguous();
  const int64_t n = xc.size(0), v = xc.size(1);
  at::Tensor removed = at::empty({n, v}, xc.options().dtype(at::kBool));
  at::Tensor undecided = at::empty({n}, xc.options().dtype(at::kBool));
  const float* xp = xc.data_ptr<float>();
  const double* tp = tc.data_ptr<double>();
  bool* rp = removed.data_ptr<bool>();
  bool* up = undecided.data_ptr<bool>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    const std::unique_ptr<float[]> w(new float[v]);
    for (int64_t r = r0; r < r1; ++r) {
      up[r] = !top_p_row(xp + r * v, v, tp[r], margin, w.get(), rp + r * v);
    }
  });
  return {removed, undecided};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagechat, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
  m.def("softmax_draw(Tensor x, Tensor u) -> Tensor");
  m.def("candidates(Tensor x, Tensor temps, Tensor chosen, int k) -> (Tensor, Tensor)");
  m.def("top_p_cut(Tensor x, Tensor thresholds, float margin) -> (Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor gather, Tensor q_pos, int window) -> Tensor");
  m.def(
      "qkv_decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv, "
      "Tensor slot_mapping, Tensor gather, Tensor q_pos, int window, int heads) -> Tensor");
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
      "-> ()");
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, int start, "
      "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagechat, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("row_max", &row_max);
  m.impl("softmax_draw", &softmax_draw);
  m.impl("candidates", &candidates);
  m.impl("top_p_cut", &top_p_cut);
  m.impl("decode_attention", &decode_attention);
  m.impl("qkv_decode_attention", &qkv_decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("prefill_attention", &prefill_attention);
}
