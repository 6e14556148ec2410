// gemm.h's packing and register tile for one vector width. gemm.h includes this file twice: in
// namespace avx2 with V = pagechat::Vec8 and in namespace avx512 with V = pagechat::Vec16 under
// AVX512's target pragma. One text serves both widths: AVX512 code must stay inside its pragma
// and AVX2 code outside it, so a template over the width alone could not. No include guard, for
// the same reason.
//
// Panels of NR = NV x W weight rows; MR activation rows at a time through a tile of MR x NV sums
// (V's tile: AVX2 6 rows x 16, AVX512 8 x 48). Every output is one sum over k in order, so the two
// widths give the same bits.
struct Tile {
  static constexpr int W = V::W, NV = V::NV, NR = W * NV, MR = V::MR;

  // Weight rows [0, rows) of a panel (row stride k) -> bp [k][NR], rows past `rows` as zeros:
  // W x W blocks transposed in registers.
  template <class T>
  static void pack(const T* w, int64_t k, int64_t rows, float* bp) {
    const int64_t full = rows == NR ? k / W * W : 0;  // blocks with nothing to pad: no branches
    for (int v = 0; v < NV; ++v) {
      for (int64_t k0 = 0; k0 < full; k0 += W) {
        V::R r[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) r[i] = V::load(w + (v * W + i) * k + k0);
        V::transpose(r);
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) V::store(bp + (k0 + i) * NR + v * W, r[i]);
      }
      for (int64_t k0 = full; k0 < k; k0 += W) {
        V::R r[W];
        for (int i = 0; i < W; ++i) {
          float tail[W];
          const int64_t row = v * W + i;
          tail_copy<W>(w + row * k + k0, row < rows ? std::min<int64_t>(W, k - k0) : 0, tail);
          r[i] = V::load(tail);
        }
        V::transpose(r);
        for (int i = 0; i < W && k0 + i < k; ++i) V::store(bp + (k0 + i) * NR + v * W, r[i]);
      }
    }
  }

  // c[R][cols] = a[R][k] (row stride lda) times the packed panel bp; c's row stride ldc. The k
  // loop unrolled by 4: 1.00-1.08x the rolled tile (AVX2: 1.03-1.10x), the same sums.
  template <int R>
  static void tile(const float* a, int64_t lda, const float* bp, int64_t k, float* c,
                   int64_t ldc, int64_t cols) {
    V::R acc[R][NV];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; ++kk) {
      V::R b[NV];
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) b[v] = V::load(bp + kk * NR + v * W);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const V::R ai = V::set1(a[i * lda + kk]);
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) acc[i][v] = V::fmadd(ai, b[v], acc[i][v]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int v = 0; v < NV; ++v) {
        const int64_t left = cols - v * W;
        if (left >= W) {
          V::store(c + i * ldc + v * W, acc[i][v]);
        } else if (left > 0) {
          V::store_first(c + i * ldc + v * W, acc[i][v], left);
        }
      }
    }
  }
};
