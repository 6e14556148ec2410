// pagechat's CPU matmul kernels for decode: a few activation rows times every weight of a layer.
//
// Decode multiplies a few rows of activations by every weight, so its time is the weight bytes
// read from memory; torch's CPU kernels for int8 / int4 weights convert each weight to float
// before the multiply and read them at a fraction of the speed the memory allows on an AVX2 host.
// As ggml's Q8_0 / Q4_1 dot products do, each block of 32 activations is quantised once per call,
// with one float scale, and the products are summed as integers; the block's sum is scaled in
// float. The activations are quantised to int16, not to int8 as in ggml: _mm256_madd_epi16 then
// does 16 products and pair sums per instruction after widening the weights, as fast here as the
// int8 maddubs trick (measured: within 10% either way at 1, 4 and 16 rows), and the matmul's error
// from the activations' rounding is ~2e-5 of the result instead of ~5e-3 (torch's bf16
// activations: ~3e-3). Float weights (fp32, bf16) are multiplied with float activations as they
// are: the same tiling, so the same bandwidth.
//
// Weight formats:
//   int8:  int8 [N, K], float32 scales [N, G]: one per output row (G = 1, w = q * scale), or one
//          per group of K/G inputs (GGUF's Q8_0: groups of 32).
//   int4:  asymmetric groups of g inputs, in panels of 16 rows on every CPU (Panels, below, and
//          Int4PanelsAvx2): scales and "offsets" per row and group, the offsets of one of two
//          kinds:
//            uint8 zeros:   w = (q - zero) * scale   (AWQ; GGUF's Q4_0, zero 8), or
//            mins:          w = q * scale + min      (GGUF's Q4_1 and Q4_K).
//          Both are the formats' own numbers, exactly (AWQ's and ggml's fp16 scales; Q4_K's
//          6-bit scale times its fp16 super-block scale is exact in float32): the weights
//          dequantise to what the checkpoint or the GGUF file says, bit for bit.
//          AWQ at g = 32: 19 bytes per 32 weights (ggml's Q4_0: 18, Q4_1: 20), 16.75 at g = 128.
//   float: fp32 or bf16 [N, K].
// On a CPU with AVX512-VNNI, int8 weights go in panels of 16 rows instead (Panels).
// Activations are float32, bf16 or fp16 [M, K], and the output [M, N] comes in the same
// dtype: a cast on each side of a decode step's ~120 small matmuls cost more than their arithmetic.
//
// Compiled on first use by core/native.py with -mavx2 -mfma -mf16c (no -march=native, so that a
// cached build runs on any AVX2 host; the panels' code alone is compiled for AVX512 and runs only
// where the CPU has it); registered as torch.ops.pagechat.* so that traced steps
// record it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "simd.h"

namespace {

namespace gemm = pagechat::gemm;

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRowsPerPass = 4;    // activation rows that share one load of a weight block
constexpr int kStreams = 4;               // weight rows read at once, each from its own part of N
// and panels (below): 2, each 4.6-18 KB a panel at the 135M shape, read faster than 4 from memory
// on the EPYC Zen 4 (a q4_0 decode step 4.6-4.7 ms against 5.0-5.6, int8 6.2 against 7.2-7.3)
constexpr int kPanelStreams = 2;
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead in its row each stream asks for lines
// and in its panels, into L2 as well: once int4's arithmetic no longer bound it (Panels), 4 KB
// into L2 read a decode step's weights from memory at one row 1.06-1.16x (int4) and 1.2x (int8)
// as fast as 2 KB into L1 did (docs/benchmarks.md)
constexpr int64_t kPanelPrefetchBytes = 4096;

// Asks for the cache line kPrefetchBytes ahead of byte `off` of a weight row, once per line. Into
// L2 (T1), not L1: the line is needed only after several hundred more bytes of every stream, and
// past the row's end it is the next row of the same stream, which the tiles read next.
inline void prefetch_ahead(const char* row, int64_t off) {
  if ((off & 63) == 0) _mm_prefetch(row + off + kPrefetchBytes, _MM_HINT_T1);
}

// Asks for the lines of a panel's block of `bytes` kPanelPrefetchBytes ahead, into L2: the panels'
// own blocks follow one another, so ahead is the same stream.
inline void prefetch_panel_block(const uint8_t* block, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l + kPanelPrefetchBytes, _MM_HINT_T1);
}

// The largest |value| of 8 floats, in every lane.
inline float max_abs8(__m256 v) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(abs), _mm256_extractf128_ps(abs, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

using pagechat::sum8;

// Calls f with x's data as float, bf16 or fp16 (the activation types the kernels take as they are,
// so that the layers need no cast before or after them).
template <class F>
void with_rows(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return f(x.data_ptr<float>());
    case at::kBFloat16:
      return f(x.data_ptr<at::BFloat16>());
    case at::kHalf:
      return f(x.data_ptr<at::Half>());
    default:
      TORCH_CHECK(false, "pagechat kernels: float32, bf16 or fp16 activations, not ", x.dtype());
  }
}

// The output [M, N], in the activations' dtype: each tile writes its sums as they are finished.
struct Out {
  explicit Out(const at::Tensor& t) : p(t.data_ptr()), type(t.scalar_type()), n(t.size(1)) {}
  void set(int64_t m, int64_t j, float v) const {
    const int64_t i = m * n + j;
    if (type == at::kFloat) {
      static_cast<float*>(p)[i] = v;
    } else if (type == at::kBFloat16) {
      static_cast<at::BFloat16*>(p)[i] = v;
    } else {
      static_cast<at::Half*>(p)[i] = v;
    }
  }
  void* p;
  at::ScalarType type;
  int64_t n;
};

// One activation row -> int16 values (round to nearest) and one scale per block of 32:
// x ~= q * scale, scale = max|x| / 32767. A NaN or inf in a block makes its scale non-finite, and
// so the outputs (inf: q = 0 times scale inf is NaN): the engine's check for broken logits sees it.
template <class T>
void quantize_row(const T* x, int64_t k, int16_t* q, float* scales) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    __m256 nan = _mm256_setzero_ps();  // max_ps drops NaNs, so they are looked for apart
    for (int i = 0; i < 4; ++i) {
      v[i] = pagechat::load8(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    const float amax = max_abs8(m);
    scales[b] = _mm256_movemask_ps(nan) ? NAN : amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r =
          _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i32[i] = _mm256_cvtps_epi32(r);
    }
    // packs works within 128-bit lanes ([0-3, 8-11 | 4-7, 12-15]): the permute restores the order
    const __m256i a16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
    const __m256i b16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2], i32[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), a16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock + 16), b16);
  }
}

// x [M, K] quantised per block of 32, row after row.
struct QuantRows {
  explicit QuantRows(const at::Tensor& x)
      : k(x.size(1)), q(x.size(0) * k), scales(x.size(0) * (k / kBlock)) {
    with_rows(x, [&](const auto* xp) {
      for (int64_t i = 0; i < x.size(0); ++i) {
        quantize_row(xp + i * k, k, &q[i * k], &scales[i * (k / kBlock)]);
      }
    });
  }
  const int64_t k;
  std::vector<int16_t> q;
  std::vector<float> scales;
};

// int8 rows with one scale each (Grouped false: the scale is applied once, to the row's sum), or
// a scale per group of inputs (Grouped: applied to each group's sum, as int4's are).
template <bool Grouped>
struct Int8Weights {
  // 16 ymm registers: 4 x 2 sums, the blocks unpacked
  static constexpr int kPassWidth = 2, kRowsPerPass = kMaxRowsPerPass;
  static constexpr bool kGroupScales = Grouped;
  static constexpr int64_t kBlockBytes = kBlock;
  const QuantRows& x;
  const int8_t* w;
  const float* scales;  // [N, groups]
  int64_t k, blocks_per_group, groups;
  const char* row(int64_t j) const { return reinterpret_cast<const char*>(w + j * k); }
  void unpack(int64_t j, int64_t b, __m256i& lo, __m256i& hi) const {
    const int8_t* p = w + j * k + b * kBlock;
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  const float* group_scale(int64_t j, int64_t g) const { return scales + j * groups + g; }
  float finish(int64_t, int64_t j, float sum) const { return Grouped ? sum : sum * scales[j]; }
  template <int R, int W>
  void tile(int64_t m0, int64_t j0, int64_t step, const Out& out) const;
};

// Each activation row's groups of `group` inputs summed as quantised (sum over its blocks of
// scale * the block's int16 values summed): [M, K/group], what a group's zero is multiplied by.
std::vector<float> group_sums(const QuantRows& xq, int64_t group) {
  const int64_t k = xq.k, blocks = k / kBlock, groups = k / group, rows = xq.q.size() / k;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t t = 0;
      for (int64_t i = 0; i < kBlock; ++i) t += xq.q[r * k + b * kBlock + i];
      sums[r * groups + b / (group / kBlock)] += t * xq.scales[r * blocks + b];
    }
  }
  return sums;
}

// out[m][j] for R activation rows from m0 and the W weight rows j0, j0 + step, ...: each weight
// block is loaded once for the R rows and each activation block once for the W weight rows.
template <class Wt, int R, int W>
inline void int_tile(const Wt& wt, int64_t m0, int64_t j0, int64_t step, const Out& out) {
  const QuantRows& xq = wt.x;
  const int64_t k = xq.k, blocks = k / kBlock;
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = _mm256_setzero_ps();
  // a new group's scales when its first block comes, counted down rather than divided out (a
  // 64-bit division per block and weight row was a third of the int4 kernel's time at group 32),
  // in one loop over the blocks, so that the rows' addresses are worked out once per tile
  __m256 ws[W];
  int64_t g = 0, left = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (Wt::kGroupScales) {
      if (left == 0) {
        for (int c = 0; c < W; ++c) ws[c] = _mm256_broadcast_ss(wt.group_scale(j0 + c * step, g));
        ++g;
        left = wt.blocks_per_group;
      }
      --left;
    }
    __m256i wlo[W], whi[W];
    for (int c = 0; c < W; ++c) {
      const int64_t j = j0 + c * step;
      prefetch_ahead(wt.row(j), b * Wt::kBlockBytes);
      wt.unpack(j, b, wlo[c], whi[c]);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t off = (m0 + r) * k + b * kBlock;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.q[off]));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.q[off + 16]));
      const __m256 d = _mm256_set1_ps(xq.scales[(m0 + r) * blocks + b]);
      for (int c = 0; c < W; ++c) {
        // |sum| <= 4 * 128 * 32767 < 2^24 (int4: 4 * 15 * 32767): exact in int32 and in float
        const __m256 s = _mm256_cvtepi32_ps(
            _mm256_add_epi32(_mm256_madd_epi16(wlo[c], xlo), _mm256_madd_epi16(whi[c], xhi)));
        if constexpr (Wt::kGroupScales) {
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), ws[c], acc[r][c]);
        } else {
          acc[r][c] = _mm256_fmadd_ps(s, d, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c)
      out.set(m0 + r, j0 + c * step, wt.finish(m0 + r, j0 + c * step, sum8(acc[r][c])));
}

template <bool Grouped>
template <int R, int W>
void Int8Weights<Grouped>::tile(int64_t m0, int64_t j0, int64_t step, const Out& out) const {
  int_tile<Int8Weights, R, W>(*this, m0, j0, step, out);
}

// Activations [M, K] as floats split for bf16 weights loaded 2H at a time: per 2H inputs, the H
// at even places, then the H at odd ones; a tail of fewer than 2H as it is.
template <int H>
std::vector<float> split_pairs(const at::Tensor& xt) {
  const int64_t rows = xt.size(0), k = xt.size(1);
  std::vector<float> x(xt.numel());
  with_rows(xt, [&](const auto* src) {
    for (int64_t r = 0; r < rows; ++r) {
      int64_t i = 0;
      for (; i + 2 * H <= k; i += 2 * H) {
        for (int e = 0; e < H; ++e) {
          x[r * k + i + e] = src[r * k + i + 2 * e];
          x[r * k + i + H + e] = src[r * k + i + 2 * e + 1];
        }
      }
      for (; i < k; ++i) x[r * k + i] = src[r * k + i];
    }
  });
  return x;
}

// float_linear's tiles (float_rows.h), once per width: AVX512's where avx512_here().
namespace avx2 {
using V = pagechat::Vec8;
#include "float_rows.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
using V = pagechat::Vec16;
#include "float_rows.h"
}  // namespace avx512
#pragma GCC pop_options

// R activation rows from m0 times the kStreams weight rows j, j + step, ...: in tiles of W of
// those rows (the more activation rows, the fewer weight rows per tile: registers).
template <int R, int W, class Wt>
void rows_times_streams(const Wt& wt, int64_t m0, int64_t j, int64_t step, const Out& out) {
  for (int c = 0; c < kStreams; c += W) wt.template tile<R, W>(m0, j + c * step, step, out);
}

// out [M, N] = every activation row times every weight row, split over threads by weight rows.
// Each thread reads its rows as kStreams sequential streams at once, each over its own part of
// them (rows j, j + step, j + 2 step, ... together, then j + 1, ...): one core keeps only as many
// lines in flight as the hardware prefetcher follows streams, and a tile of adjacent rows is one
// stream to it (the 0.5B shape's layers, bf16, one row, 2 threads: 18 GB/s with adjacent rows,
// 24-27 with four streams, a plain read 28-30).
// Wt::kRowsPerPass: the activation rows that share a tile's weight loads; Wt::kPassWidth: the
// weight rows such a tile takes, and one of 3 rows or more (registers; 1 or 2 take kStreams).
template <class Wt>
at::Tensor run(const Wt& wt, const at::Tensor& x, int64_t n) {
  constexpr int RP = Wt::kRowsPerPass;
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const Out o(out);
  // 64 rows of 576 bytes or more per task: the split costs far less than the rows take to read
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    const int64_t step = (n1 - n0) / kStreams;
    // the kStreams weight rows of a tile stay in L1 while every activation row goes through
    // them, so the weights are read from memory once however many rows x has
    for (int64_t j = n0; j < n0 + step; ++j) {
      int64_t m0 = 0;
      for (; m0 + RP <= m; m0 += RP) rows_times_streams<RP, Wt::kPassWidth>(wt, m0, j, step, o);
      if (m0 < m) {
        pagechat::with_count<RP - 1>(m - m0, [&](auto r) {
          constexpr int R = decltype(r)::value;
          rows_times_streams<R, R <= 2 ? kStreams : Wt::kPassWidth>(wt, m0, j, step, o);
        });
      }
    }
    for (int64_t j = n0 + kStreams * step; j < n1; ++j) {
      for (int64_t m0 = 0; m0 < m; ++m0) wt.template tile<1, 1>(m0, j, 0, o);
    }
  });
  return out;
}

// bf16 rows times bf16 activations on a CPU with AVX512-BF16 (bf16_dot_here()): vdpbf16ps
// multiplies 32 weights by 32 activations and adds the pairs' products into 16 float sums, in one
// instruction, where float_rows.h's AVX2 tile splits each operand and spends two FMAs per 16
// products; several rows of a batched decode were bound by that arithmetic (8 rows of the 135M
// shape's layers: 0.49 ms with it, 0.35 ms for torch's oneDNN bf16 GEMM). The products of bf16
// values are exact in float32, as in float_rows.h; the sums are float32, added pairwise. A tail of
// 8, 16 or 24 inputs is read masked. Registers: 32 zmm, so tiles of 4 activation rows by 4 weight
// rows.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
struct Bf16DotWeights {
  static constexpr int kPassWidth = 4, kRowsPerPass = kMaxRowsPerPass;
  const uint16_t* x;  // bf16 activations [M, K]
  const uint16_t* w;  // bf16 weights [N, K]
  int64_t k;
  // 32 inputs from i into the sums: loads masked to `keep` only in a row's tail (masked loads in
  // every step ran at a third of the speed)
  template <int R, int W, bool Tail>
  __attribute__((always_inline)) inline void add32(__m512 (&acc)[R][W], int64_t m0, int64_t j0,
                                                   int64_t step, int64_t i, __mmask32 keep) const {
    auto load = [&](const uint16_t* p) {
      return reinterpret_cast<__m512bh>(Tail ? _mm512_maskz_loadu_epi16(keep, p)
                                             : _mm512_loadu_si512(p));
    };
    __m512bh wv[W];
    for (int c = 0; c < W; ++c) {
      const uint16_t* wr = w + (j0 + c * step) * k;
      prefetch_ahead(reinterpret_cast<const char*>(wr), i * 2);
      wv[c] = load(wr + i);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load(x + (m0 + r) * k + i);
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  template <int R, int W>
  void tile(int64_t m0, int64_t j0, int64_t step, const Out& out) const {
    __m512 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) add32<R, W, false>(acc, m0, j0, step, i, 0);
    if (i < k) add32<R, W, true>(acc, m0, j0, step, i, (__mmask32(1) << (k - i)) - 1);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) out.set(m0 + r, j0 + c * step, _mm512_reduce_add_ps(acc[r][c]));
  }
};
#pragma GCC pop_options

// int4 and int8 in panels of 16 rows, for CPUs with AVX512-VNNI (panels_here(); int4 elsewhere:
// Int4PanelsAvx2, below). A horizontal tile (above) spends four float operations per block of 32
// weights and activation row on the block's scales, as many as on its products: int4 in rows was
// bound by its arithmetic at one row (about 24 of 30 GB/s) and more so at several. A panel turns
// that around: its 16 rows lie side by side in the lanes, each lane one row's sum, so each block's
// scales cost those operations once per 16 rows. Layouts (made by quant/kernels.py's int4_pack and
// int8_pack), per panel of rows 16p .. 16p + 15 and block of 32 inputs:
//   int4: 256 bytes, four parts t of 64: byte 4r + e of part t holds q[row 16p + r][input 4t + e]
//         in its low nibble and q[16p + r][16 + 4t + e] in its high one. One load, a mask and a
//         shift give 16 rows by 4 inputs twice, row r's in 32-bit lane r, as vpdpbusd takes
//         them: 64 products of unsigned and signed bytes, summed in fours, per instruction. The
//         activations are int16, so each is split into its bytes, x = 256 hi + lo (hi signed, lo
//         unsigned), and a block's sum is 256 times the weights by hi (the nibbles as the unsigned
//         operand) plus the weights by lo (lo unsigned, the nibbles, below 16, as signed): the
//         same integers as one int16 product, exactly. On the EPYC Zen 4, one row and two panels
//         of 16 rows in cache: 52 GB/s of int4 weights a core, against 22 with vpdpwssd on pairs
//         picked out of 16-bit words by vpmultishiftqb, as panels were before.
//   int8: 512 bytes; per input pair (2i, 2i + 1), 32 bytes, byte 2r + e = q[row 16p + r][input
//         2i + e], widened to int16 in one instruction; vpdpwssd does the 16 rows' 32 products and
//         their pair sums, times the activation pair broadcast.
// Scales [N/16, K/g, 16] (a group's 16 values are one load), fp16 or float32: fp16 where the format's
// own are (AWQ, Q4_0, Q4_1, Q8_0), so int4 at g = 32 is 19 bytes per 32 weights, Q8_0 34
// as in the file; float32 for Q4_K (a 6-bit scale times an fp16 one) and int8's row scales (G = 1,
// so [N]). int4's offsets in the same layout: uint8 zeros, or mins in the scales' dtype.
// What a panel kernel reads besides its weights (int4: the activations' bytes, their groups' sums),
// built outside the AVX512 code below so that an AVX2 CPU can build it too.
struct PanelWeights {
  // int4 has zeros or mins (in the scales' dtype), int8 neither; int8's row scales are one group
  // of K
  PanelWeights(const QuantRows& xq, const uint8_t* w, const void* scales, bool half,
               const uint8_t* zeros, const void* mins, int64_t group)
      : x(xq),
        w(w),
        scales(scales),
        half(half),
        zeros(zeros),
        mins(mins),
        blocks(xq.k / kBlock),
        blocks_per_group(group / kBlock),
        groups(xq.k / group),
        xsums(zeros || mins ? group_sums(xq, group) : std::vector<float>()) {
    if (zeros || mins) {
      const size_t n = xq.q.size();
      hi.resize(n);
      lo.resize(n);
      // through local pointers: the byte stores may alias the vectors' own fields, which GCC
      // then reloaded every element in a scalar loop (~1 us of a 576-input call)
      const int16_t* q = xq.q.data();
      int8_t* h = hi.data();
      uint8_t* l = lo.data();
      for (size_t i = 0; i < n; ++i) {
        h[i] = static_cast<int8_t>(q[i] >> 8);  // arithmetic: x = 256 hi + lo, lo >= 0
        l[i] = static_cast<uint8_t>(q[i] & 0xFF);
      }
    }
  }
  const QuantRows& x;
  const uint8_t* w;
  const void* scales;
  const bool half;  // scales and mins in fp16, else float32
  const uint8_t* zeros;
  const void* mins;
  const int64_t blocks, blocks_per_group, groups;
  std::vector<float> xsums;
  std::vector<int8_t> hi;  // int4: the activations' bytes (see above)
  std::vector<uint8_t> lo;
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

template <int Bits>
struct Panels : PanelWeights {
  static constexpr int64_t kRows = 16, kBlockBytes = kRows * kBlock * Bits / 8;
  // activation rows that share one unpacking of the weights: the more, the fewer operations per
  // product; 3 registers per row and panel (int4: 4, its sums over hi and lo apart)
  static constexpr int64_t kRowsPerPass = Bits == 4 ? 4 : 8;
  using PanelWeights::PanelWeights;

  // sums[r][c] = block b of panel wp[c] times activation row m0 + r, lane j row j's: int32 and
  // exact (|a lane| <= 32 * 127 * 32767 < 2^31; int4: 32 * 15 * 32767 < 2^24, exact in float too)
  template <int R, int W>
  __attribute__((always_inline)) inline void block_sums(__m512i (&sums)[R][W],
                                                        const uint8_t* const (&wp)[W], int64_t b,
                                                        int64_t m0) const {
    const int64_t at = m0 * x.k + b * kBlock;
    if constexpr (Bits == 4) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      __m512i sh[R][W], sl[R][W];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < W; ++c) sh[r][c] = sl[r][c] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        __m512i v[W][2];
        for (int c = 0; c < W; ++c) {
          const __m512i l = _mm512_loadu_si512(wp[c] + b * kBlockBytes + 64 * t);
          v[c][0] = _mm512_and_si512(l, low4);
          v[c][1] = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
        }
        for (int e = 0; e < 2; ++e) {
          for (int r = 0; r < R; ++r) {
            int32_t h, l;
            std::memcpy(&h, &hi[at + r * x.k + 16 * e + 4 * t], sizeof h);
            std::memcpy(&l, &lo[at + r * x.k + 16 * e + 4 * t], sizeof l);
            const __m512i xh = _mm512_set1_epi32(h), xl = _mm512_set1_epi32(l);
            for (int c = 0; c < W; ++c) {
              sh[r][c] = _mm512_dpbusd_epi32(sh[r][c], v[c][e], xh);
              sl[r][c] = _mm512_dpbusd_epi32(sl[r][c], xl, v[c][e]);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < W; ++c) {
          sums[r][c] = _mm512_add_epi32(_mm512_slli_epi32(sh[r][c], 8), sl[r][c]);
        }
    } else {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < W; ++c) sums[r][c] = _mm512_setzero_si512();
      for (int i = 0; i < kBlock / 2; ++i) {
        __m512i v[W];
        for (int c = 0; c < W; ++c) {
          v[c] = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[c] + b * kBlockBytes) + i));
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, &x.q[at + r * x.k + 2 * i], sizeof pair);
          const __m512i xp = _mm512_set1_epi32(pair);
          for (int c = 0; c < W; ++c) sums[r][c] = _mm512_dpwssd_epi32(sums[r][c], v[c], xp);
        }
      }
    }
  }

  // the 16 outputs of each of the W panels p0, p0 + step, ... for R activation rows from m0
  template <int R, int W>
  void tile(int64_t m0, int64_t p0, int64_t step, const Out& out) const {
    const uint8_t* wp[W];
    for (int c = 0; c < W; ++c) wp[c] = w + (p0 + c * step) * blocks * kBlockBytes;
    __m512 acc[R][W], grp[R][W];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) acc[r][c] = grp[r][c] = _mm512_setzero_ps();
    int64_t g = 0, left = blocks_per_group;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int c = 0; c < W; ++c) prefetch_panel_block(wp[c] + b * kBlockBytes, kBlockBytes);
      __m512i sums[R][W];
      block_sums<R, W>(sums, wp, b, m0);
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(x.scales[(m0 + r) * blocks + b]);
        for (int c = 0; c < W; ++c) {
          grp[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), d, grp[r][c]);
        }
      }
      if (--left == 0) {  // the group's scales and its offsets' share, once per 16 rows
        for (int c = 0; c < W; ++c) {
          const int64_t at = ((p0 + c * step) * groups + g) * kRows;
          const __m512 ws = pagechat::Vec16::load(scales, half, at);
          if (zeros) {
            const __m512 zf = pagechat::Vec16::load_bytes(zeros + at);
            for (int r = 0; r < R; ++r) {
              const __m512 xs = _mm512_set1_ps(xsums[(m0 + r) * groups + g]);
              grp[r][c] = _mm512_fnmadd_ps(zf, xs, grp[r][c]);
            }
          }
          for (int r = 0; r < R; ++r) {
            acc[r][c] = _mm512_fmadd_ps(grp[r][c], ws, acc[r][c]);
            grp[r][c] = _mm512_setzero_ps();
          }
          if (mins) {
            const __m512 mf = pagechat::Vec16::load(mins, half, at);
            for (int r = 0; r < R; ++r) {
              acc[r][c] = _mm512_fmadd_ps(mf, _mm512_set1_ps(xsums[(m0 + r) * groups + g]),
                                          acc[r][c]);
            }
          }
        }
        ++g;
        left = blocks_per_group;
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < W; ++c) {
        alignas(64) float o[kRows];
        _mm512_store_ps(o, acc[r][c]);
        for (int j = 0; j < kRows; ++j) out.set(m0 + r, (p0 + c * step) * kRows + j, o[j]);
      }
    }
  }
};

// 16 floats to dst as T: float32 as they are, bf16 rounded to nearest even as torch rounds (the
// values are finite).
template <class T>
inline void store16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
  }
}

// Row j of int8 panels as K values of T (float32 or bf16), for prefill: per block, the row's 16
// pairs gathered from the block's 512 bytes (the dwords at 4-byte boundaries, so that no read
// passes the block's end; an odd row's pair is the high half), narrowed to 32 bytes and widened to
// T; times the group's scale where scales are given (exact in float32: an int8 times an fp16),
// else the values as they are (exact in both).
template <class T>
void unpanel_row(const int8_t* w, int64_t j, int64_t k, const void* scales, bool half,
                 int64_t groups, T* dst) {
  const int64_t blocks = k / kBlock, blocks_per_group = blocks / groups;
  const int64_t p = j / Panels<8>::kRows, r = j % Panels<8>::kRows;
  alignas(64) int32_t at[16];
  for (int i = 0; i < 16; ++i) at[i] = 32 * i + 4 * (r / 2);
  const __m512i offsets = _mm512_load_si512(at);
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + (p * blocks + b) * Panels<8>::kBlockBytes;
    __m512i pairs = _mm512_i32gather_epi32(offsets, wb, 1);
    if (r % 2) pairs = _mm512_srli_epi32(pairs, 16);
    const __m256i q = _mm512_cvtepi32_epi16(pairs);  // the row's 32 int8 values, in order
    const int64_t g = b / blocks_per_group, at_g = (p * groups + g) * Panels<8>::kRows + r;
    const __m512 scale = _mm512_set1_ps(
        !scales ? 1.0f
        : half  ? static_cast<float>(static_cast<const at::Half*>(scales)[at_g])
                : static_cast<const float*>(scales)[at_g]);
    for (int h = 0; h < 2; ++h) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q)));
      if (scales) v = _mm512_mul_ps(v, scale);
      store16(dst + b * kBlock + 16 * h, v);
    }
  }
}

// int8 panels back to rows [16 * panels, K] of T, every row at once (int8_unpanel).
template <class T>
void unpanel_rows(const int8_t* w, int64_t panels, int64_t k, const void* scales, bool half,
                  int64_t groups, T* out) {
  at::parallel_for(0, panels * Panels<8>::kRows, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) unpanel_row(w, j, k, scales, half, groups, out + j * k);
  });
}

#pragma GCC pop_options

// int4 panels on AVX2 (a CPU without AVX512-VNNI): the same layout and the same integer sums as
// Panels<4>, a panel as two halves of 8 rows (each part's first 32 bytes hold rows 0-7, the last
// 32 rows 8-15). Without vpdpbusd, vpmaddubsw multiplies the nibbles by the activations' bytes and
// adds pairs into 16-bit lanes, where a block's products are summed before one vpmaddwd widens
// them: the 8 products by hi (|each| <= 2 * 15 * 128) fit 16 bits, those by lo (<= 2 * 255 * 15)
// in two sums of 4. The row layout's tile these replaced widened every block to 16 bits (the
// shuffle port) and spent four float operations on its scales per row, where a panel shares both
// among 8 rows: the 135M shape's layers 1.20-1.27x as fast at 1-16 rows, a decode step 1.19-1.35x
// (Xeon, AVX2 emulated; docs/benchmarks.md). The loops are unrolled by hand-set pragmas: GCC kept
// the accumulators of loops it left rolled in memory (one row 6% slower).
struct Int4PanelsAvx2 : PanelWeights {
  static constexpr int64_t kRows = 16, kBlockBytes = Panels<4>::kBlockBytes;
  // 16 ymm registers: 3 sums a row and half, 2 accumulators a row and panel
  static constexpr int64_t kRowsPerPass = 2;
  using PanelWeights::PanelWeights;

  // 4 bytes in every dword: vbroadcastss from memory, a load alone (set1_epi32 of an int went
  // through a general register and two shuffle-port uops)
  static __m256i broadcast4(const void* p) {
    return _mm256_castps_si256(_mm256_broadcast_ss(static_cast<const float*>(p)));
  }

  // half h of block b of panel wp times activation rows m0 .. m0 + R - 1: exact int32 sums,
  // lane i row 8h + i's
  template <int R>
  __attribute__((always_inline)) inline void block_sums(__m256i (&sums)[R], const uint8_t* wp,
                                                        int64_t b, int h,
                                                        const int8_t* const (&xh)[R],
                                                        const uint8_t* const (&xl)[R]) const {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i sh[R], sl[R][2];
    for (int r = 0; r < R; ++r) sh[r] = sl[r][0] = sl[r][1] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int t = 0; t < 4; ++t) {
      const __m256i l = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wp + b * kBlockBytes + 64 * t + 32 * h));
      const __m256i v[2] = {_mm256_and_si256(l, low4),
                            _mm256_and_si256(_mm256_srli_epi16(l, 4), low4)};
      #pragma GCC unroll 8
      for (int e = 0; e < 2; ++e) {
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int64_t at = b * kBlock + 16 * e + 4 * t;
          const __m256i bh = broadcast4(xh[r] + at), bl = broadcast4(xl[r] + at);
          sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(v[e], bh));
          sl[r][t / 2] = _mm256_add_epi16(sl[r][t / 2], _mm256_maddubs_epi16(bl, v[e]));
        }
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sums[r] = _mm256_add_epi32(
          _mm256_madd_epi16(sh[r], _mm256_set1_epi16(256)),
          _mm256_add_epi32(_mm256_madd_epi16(sl[r][0], ones), _mm256_madd_epi16(sl[r][1], ones)));
    }
  }

  // the 16 outputs of each of the W panels p0, p0 + step, ... for R activation rows from m0
  template <int R, int W>
  void tile(int64_t m0, int64_t p0, int64_t step, const Out& out) const {
    const uint8_t* wp[W];
    for (int c = 0; c < W; ++c) wp[c] = w + (p0 + c * step) * blocks * kBlockBytes;
    __m256 acc[R][W][2];
    const int8_t* xh[R];
    const uint8_t* xl[R];
    const float* xs[R];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < W; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
      xh[r] = hi.data() + (m0 + r) * x.k;
      xl[r] = lo.data() + (m0 + r) * x.k;
      xs[r] = x.scales.data() + (m0 + r) * blocks;
    }
    // half h of panel c's scales or offsets of group g: loaded where they are used, as registers
    // kept across a block's sums would be spilled
    auto at = [&](int c, int h, int64_t g) {
      return ((p0 + c * step) * groups + g) * kRows + 8 * h;
    };
    int64_t g = 0, left = blocks_per_group;
    for (int64_t b = 0; b < blocks; ++b) {
      #pragma GCC unroll 8
      for (int c = 0; c < W; ++c) prefetch_panel_block(wp[c] + b * kBlockBytes, kBlockBytes);
      #pragma GCC unroll 8
      for (int c = 0; c < W; ++c) {
        #pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) {
          __m256i sums[R];
          block_sums<R>(sums, wp[c], b, h, xh, xl);
          const __m256 ws = pagechat::Vec8::load(scales, half, at(c, h, g));
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 d = _mm256_set1_ps(xs[r][b]);
            acc[r][c][h] =
                _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), d), ws, acc[r][c][h]);
          }
        }
      }
      if (--left == 0) {  // the group's offsets' share, once per 8 rows
        #pragma GCC unroll 8
        for (int c = 0; c < W; ++c) {
          #pragma GCC unroll 8
          for (int h = 0; h < 2; ++h) {
            const int64_t i = at(c, h, g);
            const __m256 off =
                zeros ? _mm256_mul_ps(pagechat::Vec8::load_bytes(zeros + i),
                                      pagechat::Vec8::load(scales, half, i))
                      : pagechat::Vec8::load(mins, half, i);
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256 xs = _mm256_set1_ps(xsums[(m0 + r) * groups + g]);
              acc[r][c][h] = zeros ? _mm256_fnmadd_ps(off, xs, acc[r][c][h])
                                   : _mm256_fmadd_ps(off, xs, acc[r][c][h]);
            }
          }
        }
        ++g;
        left = blocks_per_group;
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 8
      for (int c = 0; c < W; ++c) {
        alignas(32) float o[kRows];
        _mm256_store_ps(o, acc[r][c][0]);
        _mm256_store_ps(o + 8, acc[r][c][1]);
        for (int j = 0; j < kRows; ++j) out.set(m0 + r, (p0 + c * step) * kRows + j, o[j]);
      }
    }
  }
};

// Block b of row r of an int4 panel (wb: the block's 256 bytes) as 32 values of T: the row's
// dword of each part (inputs 4t .. 4t + 3 low, 16 + 4t .. high) gathered, so that the 16 bytes'
// low nibbles are inputs 0-15 and their high ones 16-31; then (q - zero) * scale, or q * scale +
// min (mins: q * scale is exact, so these are the formats' own float32 results, fused or not).
template <class T>
inline void unpanel_int4_block(const uint8_t* wb, int r, float scale, float zero, float min,
                               bool mins, T* dst) {
  const __m128i q = _mm_i32gather_epi32(reinterpret_cast<const int*>(wb + 4 * r),
                                        _mm_setr_epi32(0, 64, 128, 192), 1);
  for (int h = 0; h < 2; ++h) {
    const __m128i nibbles = _mm_and_si128(h ? _mm_srli_epi16(q, 4) : q, _mm_set1_epi8(0x0F));
    for (int i = 0; i < 2; ++i) {
      const __m256 v =
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i ? _mm_srli_si128(nibbles, 8) : nibbles));
      const __m256 s = _mm256_set1_ps(scale);
      pagechat::store8(dst + 16 * h + 8 * i,
                       mins ? _mm256_fmadd_ps(v, s, _mm256_set1_ps(min))
                            : _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(zero)), s));
    }
  }
}

// R activation rows from m0 times the kPanelStreams panels p, p + step, ...: W panels at a time,
// the fewer the more rows (registers: see kRowsPerPass)
template <int R, class Wt>
void panels_times_rows(const Wt& wt, int64_t m0, int64_t p, int64_t step, const Out& out) {
  constexpr int W = R <= Wt::kRowsPerPass / 2 ? 2 : 1;
  for (int c = 0; c < kPanelStreams; c += W) wt.template tile<R, W>(m0, p + c * step, step, out);
}

// out [M, 16 * panels]: every activation row times every panel, split over threads by panels and
// read as kPanelStreams streams per thread, as run() reads rows.
template <class Wt>
at::Tensor run_panels(const Wt& wt, const at::Tensor& x, int64_t panels) {
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, panels * Wt::kRows}, x.options());
  const Out o(out);
  constexpr int64_t kPass = Wt::kRowsPerPass;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    const int64_t step = (p1 - p0) / kPanelStreams;
    for (int64_t p = p0; p < p0 + step; ++p) {
      for (int64_t m0 = 0; m0 < m; m0 += kPass) {
        pagechat::with_count<kPass>(std::min(m - m0, kPass), [&](auto rows) {
          panels_times_rows<rows()>(wt, m0, p, step, o);
        });
      }
    }
    for (int64_t p = p0 + kPanelStreams * step; p < p1; ++p) {
      for (int64_t m0 = 0; m0 < m; ++m0) wt.template tile<1, 1>(m0, p, 0, o);
    }
  });
  return out;
}

// Whether this CPU runs the AVX512-VNNI panels (AVX512F, BW, VL and VNNI), unless
// PAGECHAT_KERNELS=avx2 asks for the AVX2 code alone (as core/native.py's avx2_only reads it).
bool panels_here() {
  static const bool here = [] {
    return !pagechat::avx2_forced() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return here;
}

// Whether this CPU runs Bf16DotWeights (AVX512F, BW and BF16).
bool bf16_dot_here() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// panels: int4's packed weight, 3-d in panels (Int4Args checks its shape)
void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op,
                bool panels = false) {
  TORCH_CHECK(x.dim() == 2 && (weight.dim() == 2 || (panels && weight.dim() == 3)), op,
              ": x [M, K] and a 2-d weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
}

// The number of scale groups of a weight with n rows and k inputs whose scales are `scales`
// (numel n * G, k / G a multiple of 32: G = 1 is a scale per row).
int64_t scale_groups(const at::Tensor& scales, int64_t n, int64_t k, const char* op) {
  const int64_t g = n > 0 ? scales.numel() / n : 1;
  TORCH_CHECK(g >= 1 && scales.numel() == n * g && k % g == 0 && (k / g) % kBlock == 0, op,
              ": scales, one per row or per group of a multiple of 32 inputs");
  return g;
}

// int8_linear's weight in either layout and its scales, checked for K inputs: what int8_linear
// and int8_gemm take. Panels read fp16 scales as they are (Q8_0's), every other dtype as float32.
struct Int8Args {
  Int8Args(const at::Tensor& weight, const at::Tensor& scales, int64_t k, const char* op)
      : panels(weight.dim() == 3),
        half(panels && scales.scalar_type() == at::kHalf),
        k(k),
        n(weight.size(0) * (panels ? Panels<8>::kRows : 1)),
        wc(weight.contiguous()) {
    TORCH_CHECK(weight.scalar_type() == at::kChar, op, ": an int8 weight [N, K]");
    TORCH_CHECK(k % kBlock == 0 && (panels ? weight.size(1) * kBlock == k &&
                                                 weight.size(2) == Panels<8>::kBlockBytes
                                           : weight.size(1) == k),
                op, ": weight [N, K] (in panels [N/16, K/32, 512]) with K a multiple of 32");
    groups = scale_groups(scales, n, k, op);
    TORCH_CHECK(!panels || panels_here(), op, ": panels need a CPU with AVX512-VNNI");
    sc = half ? scales.contiguous() : scales.to(at::kFloat).contiguous();
  }
  const bool panels, half;
  const int64_t k, n;
  int64_t groups;
  const at::Tensor wc;
  at::Tensor sc;
};

// y [M, N] = x [M, K] @ (weight int8 [N, K] * scales)^T, scales [N] or [N, G] (groups of K/G).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  check_rows(x, weight, "int8_linear", true);
  const Int8Args a(weight, scales, x.size(1), "int8_linear");
  const at::Tensor xc = x.contiguous();
  const QuantRows xq(xc);
  const int8_t* w = a.wc.data_ptr<int8_t>();
  if (a.panels) {
    return run_panels(Panels<8>(xq, reinterpret_cast<const uint8_t*>(w), a.sc.data_ptr(), a.half,
                                nullptr, nullptr, a.k / a.groups),
                      xc, a.wc.size(0));
  }
  const float* sp = a.sc.data_ptr<float>();
  if (a.groups == 1) return run(Int8Weights<false>{xq, w, sp, a.k, 1, 1}, xc, a.n);
  return run(Int8Weights<true>{xq, w, sp, a.k, a.k / a.groups / kBlock, a.groups}, xc, a.n);
}

// x as the prefill GEMM takes it: float32 rows, contiguous.
at::Tensor gemm_rows(const at::Tensor& x, const at::Tensor& weight, const char* op,
                     bool panels = false) {
  check_rows(x, weight, op, panels);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 activations, not ", x.dtype());
  return x.contiguous();
}

// y [M, N] = x [M, K] @ weight^T for a float32 or bf16 weight [N, K]: prefill's many rows on
// gemm.h's GEMM, the weight read as it is stored.
at::Tensor float_gemm(const at::Tensor& x, const at::Tensor& weight) {
  const at::Tensor xc = gemm_rows(x, weight, "float_gemm");
  TORCH_CHECK(weight.size(1) == x.size(1), "float_gemm: x [M, K] and weight [N, K]");
  const at::Tensor wc = weight.contiguous();
  const int64_t k = wc.size(1), n = wc.size(0);
  if (wc.scalar_type() == at::kBFloat16) {
    return gemm::gemm_here(xc, n, gemm::FloatSource<at::BFloat16>{wc.data_ptr<at::BFloat16>(), k});
  }
  TORCH_CHECK(wc.scalar_type() == at::kFloat, "float_gemm: a float32 or bf16 weight, not ",
              wc.dtype());
  return gemm::gemm_here(xc, n, gemm::FloatSource<float>{wc.data_ptr<float>(), k});
}

// Row j of int8 rows [N, K] times its scales (G a row, float32) as K floats.
void int8_row(const int8_t* q, int64_t j, int64_t k, const float* scales, int64_t groups,
              float* dst) {
  const int64_t per_group = k / groups;
  for (int64_t i = 0; i < k; i += 8) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * k + i));
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(w, _mm256_set1_ps(scales[j * groups + i / per_group])));
  }
}

// int8_linear's weight in panels as rows [N, K] of dtype (float32 or bf16), for prefill's GEMM:
// the values times their scales where scales are given ([N] or [N, G] in the panels' layout),
// else the values as they are.
at::Tensor int8_unpanel(const at::Tensor& weight, at::ScalarType dtype,
                        const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kChar &&
                  weight.size(2) == Panels<8>::kBlockBytes && weight.device().is_cpu(),
              "int8_unpanel: an int8 weight in panels [N/16, K/32, 512]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_unpanel: float32 or bf16 rows");
  TORCH_CHECK(panels_here(), "int8_unpanel: panels need a CPU with AVX512-VNNI");
  const at::Tensor wc = weight.contiguous();
  const int64_t panels = wc.size(0), k = wc.size(1) * kBlock, n = panels * Panels<8>::kRows;
  const int64_t groups = scales ? scale_groups(*scales, n, k, "int8_unpanel") : 1;
  const bool half = scales && scales->scalar_type() == at::kHalf;
  const at::Tensor sc = !scales ? at::Tensor()
                        : half  ? scales->contiguous()
                                : scales->to(at::kFloat).contiguous();
  const void* sp = scales ? sc.data_ptr() : nullptr;
  at::Tensor out = at::empty({n, k}, wc.options().dtype(dtype));
  if (dtype == at::kFloat) {
    unpanel_rows(wc.data_ptr<int8_t>(), panels, k, sp, half, groups, out.data_ptr<float>());
  } else {
    unpanel_rows(wc.data_ptr<int8_t>(), panels, k, sp, half, groups, out.data_ptr<at::BFloat16>());
  }
  return out;
}

// int4 weights as int4_linear and int4_dequantize take them: in panels of 16 rows (packed [N/16,
// K/32, 256], scales fp16 or float32 [N/16, K/g, 16]; see Panels); offsets in the scales' layout,
// uint8 zeros or mins in the scales' dtype, told apart by their dtype. n counts the rows, 16 per
// panel.
struct Int4Args {
  Int4Args(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
           int64_t group, const char* op)
      : half(scales.scalar_type() == at::kHalf),
        mins(offsets.scalar_type() != at::kByte),
        n(packed.dim() == 3 ? packed.size(0) * Panels<4>::kRows : 0),
        k(packed.dim() == 3 ? packed.size(1) * kBlock : 0),
        group(group),
        pc(packed.contiguous()),
        sc(scales.contiguous()),
        oc(offsets.contiguous()) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                    packed.size(2) == Panels<4>::kBlockBytes,
                op, ": packed uint8 in panels [N/16, K/32, 256]");
    TORCH_CHECK(group > 0 && group % kBlock == 0 && k % group == 0, op,
                ": a group size that is a multiple of 32 and divides K");
    TORCH_CHECK((scales.scalar_type() == at::kFloat || half) &&
                    (!mins || offsets.scalar_type() == scales.scalar_type()) &&
                    scales.numel() == n * (k / group) && offsets.numel() == n * (k / group),
                op,
                ": float32 or fp16 scales and uint8 zeros or mins in the scales' dtype, a value "
                "per row and group");
  }
  const bool half, mins;
  const int64_t n, k, group;
  const at::Tensor pc, sc, oc;
  const uint8_t* zeros() const { return mins ? nullptr : oc.data_ptr<uint8_t>(); }
  const void* min_values() const { return mins ? oc.data_ptr() : nullptr; }
  // the float value i of scales or mins
  float value(const at::Tensor& t, int64_t i) const {
    return half ? static_cast<float>(t.const_data_ptr<at::Half>()[i]) : t.const_data_ptr<float>()[i];
  }
};

// y [M, N] = x [M, K] @ W^T, W[j, i] = (q[j, i] - zeros[j, i / g]) * scales[j, i / g], or
// q[j, i] * scales[j, i / g] + mins[j, i / g].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group) {
  check_rows(x, packed, "int4_linear", true);
  const Int4Args a(packed, scales, offsets, group, "int4_linear");
  TORCH_CHECK(a.k == x.size(1), "int4_linear: x [M, K] and weights of K inputs");
  const at::Tensor xc = x.contiguous();
  const QuantRows xq(xc);
  const uint8_t* w = a.pc.data_ptr<uint8_t>();
  if (panels_here()) {
    return run_panels(
        Panels<4>(xq, w, a.sc.data_ptr(), a.half, a.zeros(), a.min_values(), group), xc,
        a.pc.size(0));
  }
  return run_panels(
      Int4PanelsAvx2(xq, w, a.sc.data_ptr(), a.half, a.zeros(), a.min_values(), group), xc,
      a.pc.size(0));
}

// Row j of int4_linear's weights as K values of T (row j is lane j % 16 of panel j / 16; see
// Panels).
template <class T>
void dequantize_row(const Int4Args& a, int64_t j, T* dst) {
  const int64_t k = a.k, groups = k / a.group, blocks = k / kBlock;
  const uint8_t* w = a.pc.data_ptr<uint8_t>();
  const uint8_t* zp = a.zeros();
  const int64_t p = j / Panels<4>::kRows, lane = j % Panels<4>::kRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at_g = (p * groups + b * kBlock / a.group) * Panels<4>::kRows + lane;
    unpanel_int4_block(w + (p * blocks + b) * Panels<4>::kBlockBytes, static_cast<int>(lane),
                       a.value(a.sc, at_g), a.mins ? 0.0f : zp[at_g],
                       a.mins ? a.value(a.oc, at_g) : 0.0f, a.mins, dst + b * kBlock);
  }
}

// int4_dequantize's rows ids [T] into out [T, K].
template <class T>
void dequantize_rows(const Int4Args& a, const int64_t* id, int64_t count, T* out) {
  at::parallel_for(0, count, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) dequantize_row(a, id[t], out + t * a.k);
  });
}

// int4_linear's weights as float32 or bf16 (dtype; float32 if none): the rows given (int64 [T]),
// else all [N, K]; for prefill's many rows (a GEMM, torch's part; bf16 where its GEMM is, written
// once: a fresh tensor's first touch costs more than the arithmetic) and a tied embedding's
// lookups.
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t group,
                           const std::optional<at::Tensor>& rows,
                           std::optional<at::ScalarType> dtype) {
  const Int4Args a(packed, scales, offsets, group, "int4_dequantize");
  const at::ScalarType type = dtype.value_or(at::kFloat);
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "int4_dequantize: float32 or bf16");
  at::Tensor ids = rows ? rows->to(at::kLong).contiguous() : at::arange(a.n, at::kLong);
  TORCH_CHECK(ids.dim() == 1 && (ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 &&
                                                      ids.max().item<int64_t>() < a.n)),
              "int4_dequantize: row ids [T] within the weight's ", a.n, " rows");
  at::Tensor out = at::empty({ids.numel(), a.k}, scales.options().dtype(type));
  if (type == at::kFloat) {
    dequantize_rows(a, ids.data_ptr<int64_t>(), ids.numel(), out.data_ptr<float>());
  } else {
    dequantize_rows(a, ids.data_ptr<int64_t>(), ids.numel(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

// int4 panels unpacked for the prefill GEMM (int4_panel.h), once per width.
namespace avx2 {
#include "int4_panel.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace avx512 {
#include "int4_panel.h"
}  // namespace avx512

// int8 panel p packed for the prefill GEMM (dst[kk * ld + r] = row r's value kk times its scale,
// as int8_unpanel gives it): pair i of a block (32 bytes) holds inputs 2i and 2i + 1 of every row,
// row r's in bytes 2r and 2r + 1, so one widening load and a shift give one input of every row.
void int8_panel_avx512(const Int8Args& a, int64_t p, float* dst, int64_t ld) {
  const int64_t blocks = a.k / kBlock, per_group = blocks / a.groups;
  const int8_t* w = a.wc.data_ptr<int8_t>() + p * blocks * Panels<8>::kBlockBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = pagechat::Vec16::load(a.sc.const_data_ptr(), a.half,
                                               (p * a.groups + b / per_group) * Panels<8>::kRows);
    for (int i = 0; i < kBlock / 2; ++i) {
      const __m512i pairs = _mm512_cvtepi16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + b * Panels<8>::kBlockBytes + 32 * i)));
      const __m512i even = _mm512_srai_epi32(_mm512_slli_epi32(pairs, 24), 24);
      const __m512i odd = _mm512_srai_epi32(pairs, 8);
      float* at = dst + (b * kBlock + 2 * i) * ld;
      _mm512_storeu_ps(at, _mm512_mul_ps(_mm512_cvtepi32_ps(even), scale));
      _mm512_storeu_ps(at + ld, _mm512_mul_ps(_mm512_cvtepi32_ps(odd), scale));
    }
  }
}

#pragma GCC pop_options

// A prefill GEMM panel of NR rows (from row j0, `rows` of them) made of 16-row panels side by
// side: pack_one(panel, dst) packs each that holds rows, zeros fill past the last.
template <int64_t NR, class F>
void pack_panels(int64_t j0, int64_t rows, int64_t k, float* bp, F&& pack_one) {
  for (int64_t s = 0; s < NR / Panels<8>::kRows; ++s) {
    float* dst = bp + s * Panels<8>::kRows;
    if (s * Panels<8>::kRows < rows) {
      pack_one(j0 / Panels<8>::kRows + s, dst);
    } else {
      for (int64_t kk = 0; kk < k; ++kk) std::fill_n(dst + kk * NR, Panels<8>::kRows, 0.0f);
    }
  }
}

// int8_linear's weights in panels as the prefill GEMM reads them. Panels exist only where AVX512
// runs.
struct Int8PanelSource {
  const Int8Args& a;
  template <class Isa>
  void pack(int64_t j0, int64_t rows, float* bp) const {
    pack_panels<Isa::NR>(j0, rows, a.k, bp,
                         [this](int64_t p, float* dst) { int8_panel_avx512(a, p, dst, Isa::NR); });
  }
  const char* address(int64_t j) const {
    return reinterpret_cast<const char*>(a.wc.data_ptr<int8_t>()) + j * a.k;
  }
  int64_t bytes(int64_t rows) const { return rows * a.k; }
};

// y [M, N] = x [M, K] @ (weight * scales)^T for int8_linear's weights on the prefill GEMM: panels
// packed as they are stored; rows dequantised (exact in float32) into a thread's scratch first.
// In panels N counts the padded rows.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const at::Tensor xc = gemm_rows(x, weight, "int8_gemm", true);
  const Int8Args a(weight, scales, x.size(1), "int8_gemm");
  if (a.panels) return gemm::gemm_on<gemm::Avx512>(xc, a.n, Int8PanelSource{a});
  const int8_t* w = a.wc.data_ptr<int8_t>();
  const auto rows = [&a, w](int64_t j0, int64_t count, float* dst) {
    for (int64_t i = 0; i < count; ++i)
      int8_row(w, j0 + i, a.k, a.sc.data_ptr<float>(), a.groups, dst + i * a.k);
  };
  const char* base = reinterpret_cast<const char*>(w);
  return gemm::gemm_here(xc, a.n, gemm::DequantisedSource<decltype(rows)>{rows, base, a.k, a.k});
}

// int4_linear's weights as the prefill GEMM reads them.
struct Int4Source {
  const Int4Args& a;
  template <class Isa>
  void pack(int64_t j0, int64_t rows, float* bp) const {
    pack_panels<Isa::NR>(j0, rows, a.k, bp, [this](int64_t p, float* dst) {
      if constexpr (Isa::W == 16) {
        avx512::int4_panel(a, p, dst, Isa::NR);
      } else {
        avx2::int4_panel(a, p, dst, Isa::NR);
      }
    });
  }
  const char* address(int64_t j) const {
    return reinterpret_cast<const char*>(a.pc.data_ptr<uint8_t>()) + j * a.k / 2;
  }
  int64_t bytes(int64_t rows) const { return rows * a.k / 2; }
};

// y [M, N] = x [M, K] @ W^T for int4_linear's weights on the prefill GEMM, packed from the
// panels as they are stored. N counts the padded rows.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& offsets, int64_t group) {
  const at::Tensor xc = gemm_rows(x, packed, "int4_gemm", true);
  const Int4Args a(packed, scales, offsets, group, "int4_gemm");
  TORCH_CHECK(a.k == x.size(1), "int4_gemm: x [M, K] and weights of K inputs");
  return gemm::gemm_here(xc, a.n, Int4Source{a});
}

// float_linear's bf16 or float32 weight wc times xc [M, K] in Rows' tiles of one width.
template <template <class> class Rows>
at::Tensor float_rows(const at::Tensor& xc, const at::Tensor& wc) {
  const int64_t k = xc.size(1), n = wc.size(0);
  if (wc.scalar_type() == at::kBFloat16) {
    const std::vector<float> xs = split_pairs<Rows<float>::kLanes>(xc);
    return run(Rows<at::BFloat16>{xs.data(), wc.data_ptr<at::BFloat16>(), k}, xc, n);
  }
  const at::Tensor xf = xc.to(at::kFloat).contiguous();  // a float32 model's are already
  return run(Rows<float>{xf.data_ptr<float>(), wc.data_ptr<float>(), k}, xc, n);
}

// y [M, N] = x [M, K] @ weight^T for a float32 or bf16 weight, K a multiple of 8.
// dot: bf16 weights and activations multiplied by AVX512-BF16's vdpbf16ps (Bf16DotWeights).
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, bool dot) {
  check_rows(x, weight, "float_linear");
  const int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && k % 8 == 0, "float_linear: weight [N, K], K a multiple of 8");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  if (dot && wc.scalar_type() == at::kBFloat16 && xc.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(bf16_dot_here(), "float_linear: dot needs a CPU with AVX512-BF16");
    const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
    return run(Bf16DotWeights{xp, wp, k}, xc, n);
  }
  TORCH_CHECK(wc.scalar_type() == at::kBFloat16 || wc.scalar_type() == at::kFloat,
              "float_linear: a float32 or bf16 weight");
  return pagechat::avx512_here() ? float_rows<avx512::FloatRows>(xc, wc)
                                 : float_rows<avx2::FloatRows>(xc, wc);
}

// Reads every byte of t once (a plain streaming read, split over threads as the matmuls are) and
// returns their 64-bit words OR-ed together, so that the reads cannot be left out: what the bench
// divides the bytes by to know the memory's speed.
int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 128 == 0,
              "stream_read: a contiguous tensor whose size is a multiple of 128 bytes");
  const char* p = static_cast<const char*>(t.data_ptr());
  const int64_t lines = static_cast<int64_t>(t.nbytes()) / 128;
  std::vector<int64_t> parts(at::get_num_threads(), 0);
  at::parallel_for(0, lines, 4096, [&](int64_t l0, int64_t l1) {
    // several streams at once, as a matmul reads several weight rows: one sequential stream
    // keeps too few lines in flight to reach the memory's speed from one core (measured: 4 or 8
    // streams read as fast as MKL's matrix-vector product, one stream 15-25% slower)
    constexpr int kStreams = 8;
    const int64_t stride = (l1 - l0) / kStreams;
    __m256i acc[kStreams];
    for (int i = 0; i < kStreams; ++i) acc[i] = _mm256_setzero_si256();
    auto read_line = [&](int i, int64_t l) {
      const __m256i* q = reinterpret_cast<const __m256i*>(p + l * 128);
      acc[i] = _mm256_or_si256(
          acc[i],
          _mm256_or_si256(_mm256_or_si256(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)),
                          _mm256_or_si256(_mm256_loadu_si256(q + 2), _mm256_loadu_si256(q + 3))));
    };
    for (int64_t l = 0; l < stride; ++l) {
      for (int i = 0; i < kStreams; ++i) read_line(i, l0 + i * stride + l);
    }
    for (int64_t l = l0 + kStreams * stride; l < l1; ++l) read_line(0, l);
    __m256i v = acc[0];
    for (int i = 1; i < kStreams; ++i) v = _mm256_or_si256(v, acc[i]);
    alignas(32) int64_t w[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(w), v);
    parts[at::get_thread_num()] |= w[0] | w[1] | w[2] | w[3];
  });
  int64_t all = 0;
  for (int64_t part : parts) all |= part;
  return all;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagechat, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_unpanel(Tensor weight, ScalarType dtype, Tensor? scales=None) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group) -> Tensor");
  m.def(
      "int4_dequantize(Tensor packed, Tensor scales, Tensor offsets, int group, Tensor? rows=None, "
      "ScalarType? dtype=None) -> Tensor");
  m.def("float_linear(Tensor x, Tensor weight, bool dot=False) -> Tensor");
  m.def("float_gemm(Tensor x, Tensor weight) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group) -> Tensor");
  m.def("stream_read(Tensor t) -> int");
}

TORCH_LIBRARY_IMPL(pagechat, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_unpanel", &int8_unpanel);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("float_linear", &float_linear);
  m.impl("float_gemm", &float_gemm);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("stream_read", &stream_read);
}
