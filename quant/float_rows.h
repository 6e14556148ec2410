// float_linear's rows for one vector width: float32 or bf16 weight rows (T: float or at::BFloat16)
// times float32 activations. kernels.cpp includes this file twice, in namespace avx2 with
// V = pagechat::Vec8 and in namespace avx512 with V = pagechat::Vec16 under AVX512's target pragma
// (as gemm.h includes gemm_tile.h, and for the same reason; no include guard).
//
// A tile is R activation rows by W weight rows, R x W sums of V::W lanes each, added across their
// lanes at the end. bf16 is a float's high half, so 2 V::W weights loaded at once are V::W floats
// at the even places once shifted left by 16 bits and V::W at the odd places once their low halves
// are masked off (V::split_bf16): two ALU ops, none on the shuffle port that widening needs (the
// limit at one row: 20.4 vs 13.7 GB/s for torch's bf16 matmul, 2 threads). The activations are
// split the same way once a call (split_pairs<kLanes>). A tail of fewer inputs than a step is read
// a vector at a time, zeros past its end, the activations there as they are.
//
// Tiles: AVX2's 16 registers hold 4 activation rows x 2 weight rows (8 sums, 2 weight rows split
// in 4, 2 activation vectors); AVX512's 32 hold 4 x 4 (16 sums, 8 weight vectors, 2 activation
// vectors), so that each activation vector loaded serves 4 weight rows and each weight vector 4
// activation rows. Several rows of a batched decode were bound by the AVX2 tiles' arithmetic: 8
// rows of the 135M shape's bf16 layers took 2.7x one row's time (26.7 against 10.0 ms, 2 threads),
// against 1.3x with AVX512's (docs/benchmarks.md); 4 x 4 took 0.83-0.98x the time of 8 x 2 at 8-16
// rows (bf16 and float32), and 6 x 4 (float32's registers allow it) no less than 4 x 4.
template <class T>
struct FloatRows {
  static constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  static constexpr int kLanes = V::W, kPassWidth = V::W == 16 ? 4 : 2, kRowsPerPass = 4;
  static constexpr int64_t kStep = kBf16 ? 2 * V::W : V::W;  // inputs a step
  const float* x;  // [M, K], split per kStep for bf16
  const T* w;
  int64_t k;

  // the inputs [i, i + count) of a row, count < V::W as well, as floats (zeros past count)
  template <class E>
  static typename V::R part(const E* row, int64_t i, int64_t count) {
    if (count == V::W) return V::load(row + i);
    float tail[V::W];
    gemm::tail_copy<V::W>(row + i, count, tail);
    return V::load(tail);
  }

  template <int R, int W>
  void tile(int64_t m0, int64_t j0, int64_t step, const Out& out) const {
    typename V::R acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) acc[r][c] = V::zero();
    int64_t i = 0;
    for (; i + kStep <= k; i += kStep) {
      typename V::R lo[W], hi[W];  // bf16: the even and odd weights; float32: the weights (lo)
      for (int c = 0; c < W; ++c) {
        const T* wr = w + (j0 + c * step) * k;
        prefetch_ahead(reinterpret_cast<const char*>(wr), i * static_cast<int64_t>(sizeof(T)));
        if constexpr (kBf16) {
          V::split_bf16(wr + i, lo[c], hi[c]);
        } else {
          lo[c] = V::load(wr + i);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * k + i;
        const typename V::R xe = V::load(xr);
        if constexpr (kBf16) {
          const typename V::R xo = V::load(xr + V::W);
          for (int c = 0; c < W; ++c)
            acc[r][c] = V::fmadd(hi[c], xo, V::fmadd(lo[c], xe, acc[r][c]));
        } else {
          for (int c = 0; c < W; ++c) acc[r][c] = V::fmadd(lo[c], xe, acc[r][c]);
        }
      }
    }
    for (; i < k; i += V::W) {  // k % kStep
      const int64_t count = std::min<int64_t>(V::W, k - i);
      for (int c = 0; c < W; ++c) {
        const typename V::R wv = part(w + (j0 + c * step) * k, i, count);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = V::fmadd(wv, part(x + (m0 + r) * k, i, count), acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) out.set(m0 + r, j0 + c * step, V::sum(acc[r][c]));
  }
};
