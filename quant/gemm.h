// pagechat's GEMM for prefill: many float32 activation rows times a weight [N, K] read as it is
// stored (float32, bf16, and kernels.cpp's int8 and int4 layouts), for quant/kernels.cpp.
//
// A weight-only layer (bf16-wo, the default for a bf16 checkpoint on a CPU without native bf16;
// int8 and int4 ones) used to dequantise its whole weight to a fresh float32 copy on every prefill
// call before torch's GEMM: twice a bf16 weight's bytes written and read again, 16% of a
// 128-token prefill of the 135M shape. Here the weights are read as they are stored, a panel at
// a time.
//
// The design is GotoBLAS's, made smaller. The weight's rows are cut into panels of NR rows. A
// thread packs one panel transposed, as [K][NR] floats (bf16 widened, int8 and int4 dequantised
// on the way: their 16-row panels need no transpose, kernels.cpp's int4_panel_*), into a buffer
// that stays in L2, and asks for the next panel's bytes while it
// multiplies this one (without that the packing waited on memory: 15% of the time). The
// activations are not packed: MR rows at a time go through a register tile of MR x NR sums, each
// k one broadcast per row and NR/W vector loads for MR * NR/W FMAs.
//
// Every output is one float32 sum over k in order, by FMA, as a dot product's: the error is within
// Higham's bound for such sums, and the result depends neither on the number of threads nor on the
// tile (AVX2's and AVX512's give the same bits).
//
// The AVX512 tile alone is compiled under a target pragma, and runs only where the CPU has AVX512F
// (and not under PAGECHAT_KERNELS=avx2).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace pagechat::gemm {

// Asks for bytes [from, to) of `base` a cache line at a time, into L2: the next panel's weights,
// spread over this panel's row tiles.
inline void prefetch_lines(const char* base, int64_t from, int64_t to) {
  for (int64_t at = from; at < to; at += 64) _mm_prefetch(base + at, _MM_HINT_T1);
}

// W consecutive weights of a row as floats, zeros past `count`: a panel's padded blocks.
template <int W, class T>
void tail_copy(const T* src, int64_t count, float* dst) {
  for (int i = 0; i < W; ++i) dst[i] = i < count ? static_cast<float>(src[i]) : 0.0f;
}

// The AVX2 tile: 8 floats a vector, panels of 16 rows, 6 activation rows (12 sums, 2 weight
// vectors and a broadcast: 15 of the 16 ymm registers).
struct Avx2 {
  static constexpr int W = 8, NV = 2, NR = W * NV, MR = 6;

  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load(const at::BFloat16* p) { return pagechat::load8(p); }

  // 8 x 8 floats transposed in registers.
  static void transpose(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
      t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; ++i) r[i] = t[i];
  }

  // Weight rows [0, rows) of a panel (row stride k) -> bp [k][NR], rows past `rows` as zeros.
  template <class T>
  static void pack(const T* w, int64_t k, int64_t rows, float* bp) {
    const int64_t full = rows == NR ? k / W * W : 0;  // blocks with nothing to pad: no branches
    for (int v = 0; v < NV; ++v) {
      for (int64_t k0 = 0; k0 < full; k0 += W) {
        __m256 r[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) r[i] = load(w + (v * W + i) * k + k0);
        transpose(r);
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) _mm256_store_ps(bp + (k0 + i) * NR + v * W, r[i]);
      }
      for (int64_t k0 = full; k0 < k; k0 += W) {
        __m256 r[W];
        for (int i = 0; i < W; ++i) {
          alignas(32) float tail[W];
          const int64_t row = v * W + i;
          tail_copy<W>(w + row * k + k0, row < rows ? std::min<int64_t>(W, k - k0) : 0, tail);
          r[i] = _mm256_load_ps(tail);
        }
        transpose(r);
        for (int i = 0; i < W && k0 + i < k; ++i) _mm256_store_ps(bp + (k0 + i) * NR + v * W, r[i]);
      }
    }
  }

  // c[R][cols] = a[R][k] (row stride lda) times the packed panel bp; c's row stride ldc.
  template <int R>
  static void tile(const float* a, int64_t lda, const float* bp, int64_t k, float* c,
                   int64_t ldc, int64_t cols) {
    __m256 acc[R][NV];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m256 b0 = _mm256_load_ps(bp + kk * NR), b1 = _mm256_load_ps(bp + kk * NR + W);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a + i * lda + kk);
        acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < NV; ++v) {
        const int64_t left = cols - v * W;
        if (left >= W) {
          _mm256_storeu_ps(c + i * ldc + v * W, acc[i][v]);
        } else if (left > 0) {
          alignas(32) float out[W];
          _mm256_store_ps(out, acc[i][v]);
          std::memcpy(c + i * ldc + v * W, out, left * sizeof(float));
        }
      }
    }
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

// The AVX512 tile: 16 floats a vector, panels of 48 rows, 8 activation rows (24 sums and 3 weight
// vectors of the 32 zmm registers; the broadcasts come from memory inside the FMAs). 8 x 48 and
// 7 x 64 were the fastest of the tiles tried (135M shape, 128 rows, bf16 weights:
// docs/benchmarks.md).
struct Avx512 {
  static constexpr int W = 16, NV = 3, NR = W * NV, MR = 8;

  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const at::BFloat16* p) {  // bf16 is a float's high half: widen and shift
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }

  // 16 x 16 floats transposed in registers.
  static void transpose(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
      t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
      r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
      r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
  }

  // Avx2::pack's steps on 16-wide vectors (and tile below, Avx2::tile's): one template cannot
  // serve both, as AVX512 code must stay inside its target pragma and AVX2 code outside it.
  template <class T>
  static void pack(const T* w, int64_t k, int64_t rows, float* bp) {
    const int64_t full = rows == NR ? k / W * W : 0;  // blocks with nothing to pad: no branches
    for (int v = 0; v < NV; ++v) {
      for (int64_t k0 = 0; k0 < full; k0 += W) {
        __m512 r[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) r[i] = load(w + (v * W + i) * k + k0);
        transpose(r);
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) _mm512_store_ps(bp + (k0 + i) * NR + v * W, r[i]);
      }
      for (int64_t k0 = full; k0 < k; k0 += W) {
        __m512 r[W];
        for (int i = 0; i < W; ++i) {
          alignas(64) float tail[W];
          const int64_t row = v * W + i;
          tail_copy<W>(w + row * k + k0, row < rows ? std::min<int64_t>(W, k - k0) : 0, tail);
          r[i] = _mm512_load_ps(tail);
        }
        transpose(r);
        for (int i = 0; i < W && k0 + i < k; ++i) _mm512_store_ps(bp + (k0 + i) * NR + v * W, r[i]);
      }
    }
  }

  template <int R>
  static void tile(const float* a, int64_t lda, const float* bp, int64_t k, float* c,
                   int64_t ldc, int64_t cols) {
    __m512 acc[R][NV];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 b[NV];
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(bp + kk * NR + v * W);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 ai = _mm512_set1_ps(a[i * lda + kk]);
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, b[v], acc[i][v]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < NV; ++v) {
        const int64_t left = std::min<int64_t>(cols - v * W, W);
        if (left > 0) {
          const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
          _mm512_mask_storeu_ps(c + i * ldc + v * W, mask, acc[i][v]);
        }
      }
    }
  }
};

#pragma GCC pop_options

// Rows [m0, m1) of y [M, N] = x [M, K] times w [N, K]^T for panel p, packed in bp already:
// MR rows at a time, asking for `next_bytes` of `next` (the next panel's weights) on the way.
template <class Isa>
void panel_times_rows(const float* x, int64_t k, const float* bp, int64_t rows, float* y,
                      int64_t n, int64_t m0, int64_t m1, const char* next, int64_t next_bytes) {
  constexpr int MR = Isa::MR;
  const int64_t tiles = (m1 - m0 + MR - 1) / MR;
  const int64_t per_tile = (next_bytes / tiles + 63) & ~int64_t{63};
  for (int64_t t = 0; t < tiles; ++t) {
    prefetch_lines(next, t * per_tile, std::min(next_bytes, (t + 1) * per_tile));
    const int64_t m = m0 + t * MR;
    const float* a = x + m * k;
    float* c = y + m * n;
    if (m + MR <= m1) {
      Isa::template tile<MR>(a, k, bp, k, c, n, rows);
    } else {
      with_count<MR - 1>(m1 - m, [&](auto r) {
        Isa::template tile<decltype(r)::value>(a, k, bp, k, c, n, rows);
      });
    }
  }
}

// y [M, N] = x [M, K] times w [N, K]^T on the tile Isa, w as a Source gives it:
//   template <class Isa> void pack(j0, rows, float* bp): rows [j0, j0 + rows) into a panel;
//   const char* address(j): where row j's bytes start (a panel's rows are contiguous);
//   int64_t bytes(rows): how many bytes that many rows take.
// A task is one panel times one part of the rows: the rows are cut in parts only where there are
// too few panels for every thread to have two (a thread packs a panel once for consecutive parts
// of it).
template <class Isa, class Source>
at::Tensor gemm_on(const at::Tensor& x, int64_t n, const Source& w) {
  constexpr int NR = Isa::NR, MR = Isa::MR;
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const int64_t panels = (n + NR - 1) / NR;
  const int64_t wanted = (2 * at::get_num_threads() + panels - 1) / panels;
  const int64_t parts = std::max<int64_t>(1, std::min(wanted, m / (4 * MR)));
  const int64_t part_rows = (m + parts - 1) / parts;
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, panels * parts, 1, [&](int64_t t0, int64_t t1) {
    // one panel's packed weights, reused by every task this thread takes (64-byte aligned)
    thread_local std::vector<float> buffer;
    buffer.resize(k * NR + 16);
    float* bp = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) / 4 & 15);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / parts, part = t % parts;
      const int64_t rows = std::min<int64_t>(NR, n - p * NR);
      if (t == t0 || part == 0) w.template pack<Isa>(p * NR, rows, bp);
      // the next panel, when this task is the last of this one and this thread takes the next
      const bool ahead = part == parts - 1 && t + 1 < t1;
      const int64_t next_bytes = ahead ? w.bytes(std::min<int64_t>(NR, n - (p + 1) * NR)) : 0;
      const int64_t m0 = part * part_rows, m1 = std::min(m, m0 + part_rows);
      panel_times_rows<Isa>(xp, k, bp, rows, yp + p * NR, n, m0, m1,
                            ahead ? w.address((p + 1) * NR) : nullptr, next_bytes);
    }
  });
  return out;
}

// A float32 or bf16 weight [N, K]: packed straight from its rows.
template <class T>
struct FloatSource {
  const T* w;
  int64_t k;
  template <class Isa>
  void pack(int64_t j0, int64_t rows, float* bp) const {
    Isa::pack(w + j0 * k, k, rows, bp);
  }
  const char* address(int64_t j) const { return reinterpret_cast<const char*>(w + j * k); }
  int64_t bytes(int64_t rows) const { return rows * k * static_cast<int64_t>(sizeof(T)); }
};

// A weight whose rows are dequantised first, `rows(j0, count, dst)` writing rows [j0, j0 + count)
// as floats [count][K]: packed from those (a thread's scratch, in L2). int8 rows (AVX2 CPUs) take
// it; for int4 and int8 panels packing straight from the panels was 1.08-1.2x faster at 128 rows.
template <class Dequantise>
struct DequantisedSource {
  Dequantise rows;
  const char* base;  // row 0's bytes
  int64_t k, row_bytes;
  template <class Isa>
  void pack(int64_t j0, int64_t count, float* bp) const {
    thread_local std::vector<float> scratch;
    scratch.resize(Isa::NR * k);
    rows(j0, count, scratch.data());
    Isa::pack(scratch.data(), k, count, bp);
  }
  const char* address(int64_t j) const { return base + j * row_bytes; }
  int64_t bytes(int64_t count) const { return count * row_bytes; }
};

// Whether this CPU runs the AVX512 tile (AVX512F), unless PAGECHAT_KERNELS=avx2.
inline bool avx512_here() {
  static const bool here = !pagechat::avx2_forced() && __builtin_cpu_supports("avx512f");
  return here;
}

// y = x times the weight w on the tile this CPU runs.
template <class Source>
at::Tensor gemm_here(const at::Tensor& x, int64_t n, const Source& w) {
  return avx512_here() ? gemm_on<Avx512>(x, n, w) : gemm_on<Avx2>(x, n, w);
}

}  // namespace pagechat::gemm
