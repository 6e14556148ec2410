// AVX2 helpers that pagechat's C++ ops (core/ops.cpp) and matmul kernels (quant/kernels.cpp)
// share; core/native.py puts this folder on their include path and its headers in their build hash.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
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

// Calls f(std::integral_constant<int, n>()) for a count 1 <= n <= Max known only at run time, so
// that f's loops over n have a compile-time bound (and their sums stay in registers).
template <int Max, class F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int, Max>());
    with_count<Max - 1>(n, f);
  }
}

}  // namespace pagechat
