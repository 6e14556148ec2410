// AVX2 helpers that pagechat's C++ ops (core/ops.cpp) and matmul kernels (quant/kernels.cpp)
// share, and the vectors of 8 and 16 floats their width-generic code takes (Vec8, Vec16: AVX512's
// under its target pragma); core/native.py puts this folder on their include path and its headers
// in their build hash.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

namespace pagechat {

// The sum of 8 floats.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 floats from float32, float16 or bf16 memory.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {  // bf16 is a float's high half: widen and shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats rounded to bf16's precision as torch rounds (to nearest, ties to even; a NaN stays a
// NaN), kept as floats: what a bf16 op's result is before it is stored.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 rounded =
      _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(rounded, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// v rounded to T's precision: float32 as it is, bf16 by round_bf16.
template <class T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return round_bf16(v);
  return v;
}

// 8 floats to float32 memory, or rounded to float16 or bf16 memory (to nearest, ties to even, as
// torch's conversions).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The vectors of floats that code written once for both widths takes as V (ops.cpp's
// attention_tiles.h, quant/gemm_tile.h, quant/float_rows.h and quant/int4_panel.h; each included
// once per width): a GEMM tile of MR broadcast elements by NV vectors holds MR x NV sums, beside NV
// vectors and a broadcast in the registers.
// AVX2: 8 floats, 6 x 2 (15 of the 16 ymm registers).
struct Vec8 {
  using R = __m256;
  static constexpr int W = 8, MR = 6, NV = 2;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const at::BFloat16* p) { return load8(p); }
  static R load(const at::Half* p) { return load8(p); }
  static R load(const void* p, bool half, int64_t at) {  // fp16 (half) or float32, from element at
    return half ? load(static_cast<const at::Half*>(p) + at)
                : load(static_cast<const float*>(p) + at);
  }
  static R load_bytes(const uint8_t* p) {  // W unsigned bytes as floats
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
  // W 32-bit lanes of bits, and one 4-bit field of each (bits [shift, shift + 4)) as floats
  using I = __m256i;
  static I load_bits(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static R nibble(I v, int shift) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(15)));
  }
  // 2W bf16 values as the W at even places and the W at odd places, in floats: a bf16 is a float's
  // high half, so a shift and a mask, no shuffle
  static void split_bf16(const at::BFloat16* p, R& even, R& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, R v, int64_t count) {  // lanes [0, count < W)
    alignas(32) float out[W];
    _mm256_store_ps(out, v);
    std::memcpy(p, out, count * sizeof(float));
  }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(R v) { return sum8(v); }
  static R min(R a, R b) { return _mm256_min_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R round(R x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static R pow2(R n) {  // 2^n of a whole-valued n, built in the exponent bits
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static R le(R a, R b, R x, R y) {  // a <= b ? x : y, lane by lane
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LE_OQ));
  }
  // 8 x 8 floats transposed in registers.
  static void transpose(R (&r)[W]) {
    R t[8];
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
};

#pragma GCC push_options
#pragma GCC target("avx512f")
// AVX512: 16 floats, 8 x 3 (28 of the 32 zmm registers). Runs only where the CPU has AVX512F.
struct Vec16 {
  using R = __m512;
  static constexpr int W = 16, MR = 8, NV = 3;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const at::BFloat16* p) {  // bf16 is a float's high half: widen and shift
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static R load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static R load(const void* p, bool half, int64_t at) {
    return half ? load(static_cast<const at::Half*>(p) + at)
                : load(static_cast<const float*>(p) + at);
  }
  static R load_bytes(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  }
  using I = __m512i;
  static I load_bits(const void* p) { return _mm512_loadu_si512(p); }
  static R nibble(I v, int shift) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15)));
  }
  static void split_bf16(const at::BFloat16* p, R& even, R& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, R v, int64_t count) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << count) - 1), v);
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(R v) { return _mm512_reduce_add_ps(v); }
  static R min(R a, R b) { return _mm512_min_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R round(R x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static R pow2(R n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static R le(R a, R b, R x, R y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x);
  }
  // 16 x 16 floats transposed in registers.
  static void transpose(R (&r)[W]) {
    R t[16];
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
};
#pragma GCC pop_options

// Calls f(std::integral_constant<int, n>()) for a count 1 <= n <= Max known only at run time, so
// that f's loops over n have a compile-time bound (and their sums stay in registers).
template <int Max, class F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int, Max>());
    with_count<Max - 1>(n, f);
  }
}

// Whether PAGECHAT_KERNELS=avx2 asks for the AVX2 code alone, as core/native.py's avx2_only reads
// it (spaces dropped, any case): the kernels then leave their AVX512 parts out.
inline bool avx2_forced() {
  std::string env = std::getenv("PAGECHAT_KERNELS") ? std::getenv("PAGECHAT_KERNELS") : "";
  env.erase(std::remove_if(env.begin(), env.end(), ::isspace), env.end());
  std::transform(env.begin(), env.end(), env.begin(), ::tolower);
  return env == "avx2";
}

// Whether this CPU runs the Vec16 code (AVX512F: the GEMM's and the prefill attention's tiles),
// unless PAGECHAT_KERNELS=avx2.
inline bool avx512_here() {
  static const bool here = !avx2_forced() && __builtin_cpu_supports("avx512f");
  return here;
}

}  // namespace pagechat
