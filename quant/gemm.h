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

// The tiles (gemm_tile.h). AVX2: 8 floats a vector, panels of 16 rows, 6 activation rows (12 sums,
// 2 weight vectors and a broadcast: 15 of the 16 ymm registers). AVX512: 16 floats, panels of 48
// rows, 8 activation rows (24 sums and 3 weight vectors of the 32 zmm registers; the broadcasts
// come from memory inside the FMAs); 8 x 48 and 7 x 64 were the fastest of the tiles tried (135M
// shape, 128 rows, bf16 weights: docs/benchmarks.md).
namespace avx2 {
using V = pagechat::Vec8;
#include "gemm_tile.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace avx512 {
using V = pagechat::Vec16;
#include "gemm_tile.h"
}  // namespace avx512
#pragma GCC pop_options

using Avx2 = avx2::Tile;
using Avx512 = avx512::Tile;

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

// y = x times the weight w on the tile this CPU runs.
template <class Source>
at::Tensor gemm_here(const at::Tensor& x, int64_t n, const Source& w) {
  return pagechat::avx512_here() ? gemm_on<Avx512>(x, n, w) : gemm_on<Avx2>(x, n, w);
}

}  // namespace pagechat::gemm
