// The arithmetic of ops.cpp's prefill_attention for one vector width, and the exponential every op
// there uses. ops.cpp includes this file twice: in namespace avx2 with V = Vec8, and in namespace
// avx512 with V = Vec16 under AVX512's target pragma. One text serves both widths: AVX512 code
// must stay inside its pragma and AVX2 code outside it, so a template over the width alone could
// not. No include guard, for the same reason.
//
// A task's rows (its query heads times its queries) lie in the vectors' lanes: scores are kept as
// S^T [keys][rows], the values' sums as O^T [d][rows]. The keys and values are broadcast one
// element at a time, and the softmax's maxima, exponentials and sums run down the columns, a
// vector of rows at once. (A kernel with the keys in the lanes spent as much on each row's
// reductions as on its products: docs/benchmarks.md, "Tried and not kept: a causal prefill
// attention".)
//
// Every sum runs in the same order on both widths (scores over d, the values over the chunk's
// keys after the rescale, each row's total over keys), with the same exponential: the two give
// the same bits.
//
// V (simd.h's Vec8, Vec16) gives: R (a vector of W floats), MR and NV (a tile's broadcast
// elements and row vectors), zero, set1, load, store, add, sub, mul, fmadd, min, max, round (to
// nearest), pow2 (2^n of a whole-valued vector), and le(a, b, x, y): a <= b ? x : y, lane by
// lane. Block (a task's buffers) is ops.cpp's.

// e^x to about an ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6 (the
// next term is under 1.2e-7 of it), times 2^n built in the exponent bits. x is clamped so that n
// stays in [-126, 128]: e^x saturates to inf (2^128) above ~88.4, as torch's does, and to 2^-126
// below -87.3 (torch's goes on through the subnormals); NaN passes through (max and min return
// their second operand, x, when it is NaN).
inline V::R vexp(V::R x) {
  x = V::min(V::set1(89.0f), x);
  x = V::max(V::set1(-87.3365447505531f), x);
  const V::R n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  // ln2 in two parts, so that n * ln2 is taken off x exactly enough
  V::R r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  V::R p = V::set1(1.0f / 720);
  p = V::fmadd(p, r, V::set1(1.0f / 120));
  p = V::fmadd(p, r, V::set1(1.0f / 24));
  p = V::fmadd(p, r, V::set1(1.0f / 6));
  p = V::fmadd(p, r, V::set1(0.5f));
  p = V::fmadd(p, r, V::set1(1.0f));
  p = V::fmadd(p, r, V::set1(1.0f));
  return V::mul(p, V::pow2(n));
}

// st[j][r] = sum over e of kf[j][e] * qt[e][r], for M keys from j0 and N row vectors from r0.
template <int M, int N>
inline void score_tile(const Block& b, int64_t j0, int64_t r0) {
  V::R acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < N; ++c) acc[m][c] = V::zero();
  for (int64_t e = 0; e < b.d; ++e) {
    V::R q[N];
    for (int c = 0; c < N; ++c) q[c] = V::load(b.qt + e * b.rows + r0 + c * V::W);
    for (int m = 0; m < M; ++m) {
      const V::R k = V::set1(b.kf[(j0 + m) * b.d + e]);
      for (int c = 0; c < N; ++c) acc[m][c] = V::fmadd(k, q[c], acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < N; ++c) V::store(b.st + (j0 + m) * b.rows + r0 + c * V::W, acc[m][c]);
}

// ot[e][r] += sum over the chunk's keys j of vf[j][e] * st[j][r], for M dimensions from e0 and N
// row vectors from r0.
template <int M, int N>
inline void value_tile(const Block& b, int64_t e0, int64_t r0) {
  V::R acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < N; ++c) acc[m][c] = V::load(b.ot + (e0 + m) * b.rows + r0 + c * V::W);
  for (int64_t j = 0; j < b.n; ++j) {
    V::R p[N];
    for (int c = 0; c < N; ++c) p[c] = V::load(b.st + j * b.rows + r0 + c * V::W);
    for (int m = 0; m < M; ++m) {
      const V::R v = V::set1(b.vf[j * b.d + e0 + m]);
      for (int c = 0; c < N; ++c) acc[m][c] = V::fmadd(v, p[c], acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < N; ++c) V::store(b.ot + (e0 + m) * b.rows + r0 + c * V::W, acc[m][c]);
}

// Tile(M, N, at, r0) over every (at, r0): `count` broadcast elements (keys or dimensions) in tiles
// of MR, the rows in tiles of NV vectors; the last tiles smaller.
template <template <int, int> class Tile>
void over_tiles(const Block& b, int64_t count) {
  const int64_t vectors = b.rows / V::W;
  for (int64_t c0 = 0; c0 < vectors; c0 += V::NV) {
    pagechat::with_count<V::NV>(std::min<int64_t>(V::NV, vectors - c0), [&](auto nv) {
      int64_t at = 0;
      for (; at + V::MR <= count; at += V::MR) Tile<V::MR, nv()>::run(b, at, c0 * V::W);
      if (at < count) {
        pagechat::with_count<V::MR>(count - at, [&](auto mr) {
          Tile<mr(), nv()>::run(b, at, c0 * V::W);
        });
      }
    });
  }
}
template <int M, int N>
struct Scores {
  static void run(const Block& b, int64_t at, int64_t r0) { score_tile<M, N>(b, at, r0); }
};
template <int M, int N>
struct Values {
  static void run(const Block& b, int64_t at, int64_t r0) { value_tile<M, N>(b, at, r0); }
};

// The chunk's scores (keys at positions first .. first + n) to exponentials, online: each row's
// largest score so far, its total rescaled to it, and its values' sums too. masked: some key is
// past some row's position, or before its window (`window` keys back; 0: none), and weighs 0.
inline void softmax_chunk(const Block& b, float first, bool masked, float window) {
  const V::R none = V::set1(-INFINITY);
  for (int64_t r0 = 0; r0 < b.rows; r0 += V::W) {
    const V::R pos = V::load(b.pos + r0), old = V::load(b.top + r0);
    const V::R after = V::sub(pos, V::set1(window));  // keys at or before it are out of the window
    // a key's score if row r may read it, else `cut`
    const auto keep = [&](float key, V::R s, V::R cut) {
      const V::R k = V::set1(key);
      s = V::le(k, pos, s, cut);
      return window > 0 ? V::le(k, after, cut, s) : s;
    };
    // four maxima and sums, each over every fourth key (one chain waited on its last add), the
    // last n % 4 keys in the first
    const auto score = [&](int64_t j, V::R cut) {
      const V::R s = V::load(b.st + j * b.rows + r0);
      return masked ? keep(first + j, s, cut) : s;
    };
    V::R best[4] = {none, none, none, none};
    int64_t j = 0;
    for (; j + 4 <= b.n; j += 4)
      for (int u = 0; u < 4; ++u) best[u] = V::max(best[u], score(j + u, none));
    for (; j < b.n; ++j) best[0] = V::max(best[0], score(j, none));
    const V::R top = V::max(old, V::max(V::max(best[0], best[1]), V::max(best[2], best[3])));
    const V::R shift = V::le(top, none, V::zero(), top);  // a row with no key yet: no NaN
    const V::R scale = vexp(V::sub(old, shift));           // 2^-126 from -inf: sums of 0 stay 0
    // a key's weight, stored over its score
    const auto weigh = [&](int64_t j) {
      V::R p = vexp(V::sub(V::load(b.st + j * b.rows + r0), shift));
      if (masked) p = keep(first + j, p, V::zero());
      V::store(b.st + j * b.rows + r0, p);
      return p;
    };
    V::R sums[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (j = 0; j + 4 <= b.n; j += 4)
      for (int u = 0; u < 4; ++u) sums[u] = V::add(sums[u], weigh(j + u));
    for (; j < b.n; ++j) sums[0] = V::add(sums[0], weigh(j));
    const V::R sum = V::add(V::add(sums[0], sums[1]), V::add(sums[2], sums[3]));
    V::store(b.top + r0, top);
    V::store(b.total + r0, V::add(V::mul(V::load(b.total + r0), scale), sum));
    for (int64_t e = 0; e < b.d; ++e) {
      V::store(b.ot + e * b.rows + r0, V::mul(V::load(b.ot + e * b.rows + r0), scale));
    }
  }
}

// One chunk of keys for a task's rows: scores, softmax, values.
inline void attend_chunk(const Block& b, float first, bool masked, float window) {
  over_tiles<Scores>(b, b.n);
  softmax_chunk(b, first, masked, window);
  over_tiles<Values>(b, b.d);
}
