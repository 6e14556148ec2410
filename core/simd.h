// AVX2 helpers that pagechat's C++ ops (core/ops.cpp) and matmul kernels (quant/kernels.cpp)
// share; core/native.py puts this folder on their include path and its headers in their build hash.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
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

// 8 floats to float32 memory, or rounded to bf16 memory.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

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

}  // namespace pagechat
