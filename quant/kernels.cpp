// pagechat's CPU matmul kernel for decode: int8 weights times activations quantised per block.
//
// Decode multiplies a few rows of activations by every weight, so its time is the weight bytes
// read from memory; torch's _weight_int8pack_mm converts each int8 weight to float before its
// multiply and reads them at about half the speed the memory allows on an AVX2 host. As ggml's
// Q8_0 dot product does, each block of 32 activations is quantised once per call, with one float
// scale, and the products are summed as integers; the block's sum is scaled in float and the
// weight row's own scale multiplies the row's total once.
// The activations are quantised to int16, not to int8 as in Q8_0: _mm256_madd_epi16 then does 16
// products and pair sums per instruction after a sign extension of the weights, as fast here as
// the int8 maddubs trick (measured: within 10% either way at 1, 4 and 16 rows), and the matmul's
// error from the activations' rounding is ~2e-5 of the result instead of ~5e-3 (torch's bf16
// activations: ~3e-3).
//
// Compiled on first use by quant/kernels.py with -mavx2 -mfma (no -march=native, so that a cached
// build runs on any AVX2 host); registered as torch.ops.pagechat.* so that traced steps record it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRowsPerPass = 4;  // activation rows that share one load of a weight block
constexpr int64_t kPanel = 4;  // weight rows that every activation row goes through in turn
constexpr int64_t kPrefetchRows = 16;  // measured at K = 576 and 3072 (32 and 64: less gain)

// The largest |value| of 8 floats, in every lane.
inline float max_abs8(__m256 v) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(abs), _mm256_extractf128_ps(abs, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One activation row -> int16 values (round to nearest) and one scale per block of 32:
// x ~= q * scale, scale = max|x| / 32767. A NaN or inf in a block makes its scale non-finite, and
// so the outputs (inf: q = 0 times scale inf is NaN): the engine's check for broken logits sees it.
void quantize_row(const float* x, int64_t k, int16_t* q, float* scales) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    __m256 nan = _mm256_setzero_ps();  // max_ps drops NaNs, so they are looked for apart
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    const float amax = max_abs8(m);
    scales[b] = _mm256_movemask_ps(nan) ? NAN : amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i32[i] = _mm256_cvtps_epi32(r);
    }
    // packs works within 128-bit lanes ([0-3, 8-11 | 4-7, 12-15]): the permute restores the order
    const __m256i a16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
    const __m256i b16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2], i32[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), a16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock + 16), b16);
  }
}

struct QuantRows {
  std::vector<int16_t> q;
  std::vector<float> scales;
};

// out[m][j] for R activation rows from m0 and W weight rows from j0: each weight block is loaded
// once for the R rows and each activation block once for the W weight rows; W rows read at once
// are W streams from memory, which keeps more loads in flight than one row at a time.
template <int R, int W>
inline void tile(const QuantRows& xq, int64_t m0, int64_t k, const int8_t* w,
                 const float* w_scales, int64_t j0, float* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i wlo[W], whi[W];
    for (int c = 0; c < W; ++c) {
      const int8_t* p = w + (j0 + c) * k + b * kBlock;
      wlo[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      whi[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t off = (m0 + r) * k + b * kBlock;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.q[off]));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.q[off + 16]));
      const __m256 d = _mm256_set1_ps(xq.scales[(m0 + r) * blocks + b]);
      for (int c = 0; c < W; ++c) {
        // |sum| <= 4 * 127 * 32767 < 2^24: exact in int32 and in its float conversion
        const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(wlo[c], xlo),
                                             _mm256_madd_epi16(whi[c], xhi));
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), d, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) out[(m0 + r) * n + j0 + c] = sum8(acc[r][c]) * w_scales[j0 + c];
}

// R activation rows from m0 times weight rows [n0, n1), W rows at a time and the rest one by one.
template <int R, int W>
void rows_times_weights(const QuantRows& xq, int64_t m0, int64_t k, const int8_t* w,
                        const float* w_scales, int64_t n0, int64_t n1, float* out, int64_t n) {
  int64_t j = n0;
  for (; j + W <= n1; j += W) {
    // one core streams weights from memory only as fast as it has lines in flight: asking for the
    // rows kPrefetchRows ahead now gave 25% more GB/s on a 106 MB matrix (the hardware prefetcher
    // alone: 7.0 GB/s on one core here, with this: 8.8)
    if (j + kPrefetchRows + W <= n) {
      const char* ahead = reinterpret_cast<const char*>(w + (j + kPrefetchRows) * k);
      for (int64_t off = 0; off < W * k; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    tile<R, W>(xq, m0, k, w, w_scales, j, out, n);
  }
  for (; j < n1; ++j) tile<R, 1>(xq, m0, k, w, w_scales, j, out, n);
}

// y [M, N] float32 = x [M, K] (float32 or bf16) @ (weight int8 [N, K] * scales [N])^T.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "int8_linear: x [M, K] and an int8 weight [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_linear: CPU tensors only");
  TORCH_CHECK(weight.size(1) == k && k % kBlock == 0 && scales.numel() == n,
              "int8_linear: weight [N, K] with K a multiple of 32, scales [N]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  QuantRows xq{std::vector<int16_t>(m * k), std::vector<float>(m * (k / kBlock))};
  for (int64_t i = 0; i < m; ++i) {
    quantize_row(xf.data_ptr<float>() + i * k, k, &xq.q[i * k], &xq.scales[i * (k / kBlock)]);
  }
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int8_t* w = wc.data_ptr<int8_t>();
  const float* ws = sf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // 64 rows of 576 bytes or more per task: the split costs far less than the rows take to read
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    // a panel of weight rows stays in L1 while every activation row goes through it, so the
    // weights are read from memory once however many rows x has
    for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
      const int64_t p1 = std::min(p0 + kPanel, n1);
      int64_t m0 = 0;
      for (; m0 + kMaxRowsPerPass <= m; m0 += kMaxRowsPerPass) {
        rows_times_weights<kMaxRowsPerPass, 2>(xq, m0, k, w, ws, p0, p1, o, n);
      }
      switch (m - m0) {  // the fewer activation rows, the more weight rows per tile
        case 3: rows_times_weights<3, 2>(xq, m0, k, w, ws, p0, p1, o, n); break;
        case 2: rows_times_weights<2, 4>(xq, m0, k, w, ws, p0, p1, o, n); break;
        case 1: rows_times_weights<1, 4>(xq, m0, k, w, ws, p0, p1, o, n); break;
        default: break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagechat, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagechat, CPU, m) { m.impl("int8_linear", &int8_linear); }
