// int4 panel p packed for the prefill GEMM, for one vector width: dst[kk * ld + r] = row r's
// weight kk, as int4_dequantize gives it (the same float operations). No transpose is needed: part
// t of a block (64 bytes) holds each row's dword in lane r, whose byte j has inputs 4t + j (low
// nibble) and 16 + 4t + j (high), so a shift and a mask give one input of every row; V::W rows a
// vector (AVX2: a panel's two halves of 8, one after the other). kernels.cpp includes this file
// twice, in namespace avx2 with V = pagechat::Vec8 and in namespace avx512 with V =
// pagechat::Vec16 under AVX512's target pragma (as gemm.h includes gemm_tile.h; no include guard).
inline void int4_panel(const Int4Args& a, int64_t p, float* dst, int64_t ld) {
  const int64_t blocks = a.k / kBlock, groups = a.k / a.group;
  const uint8_t* w = a.pc.data_ptr<uint8_t>() + p * blocks * Panels<4>::kBlockBytes;
  for (int h = 0; h < Panels<4>::kRows / V::W; ++h) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (p * groups + b * kBlock / a.group) * Panels<4>::kRows + V::W * h;
      const typename V::R scale = V::load(a.sc.const_data_ptr(), a.half, at);
      const typename V::R offset =
          a.mins ? V::load(a.oc.const_data_ptr(), a.half, at) : V::load_bytes(a.zeros() + at);
      for (int t = 0; t < 4; ++t) {
        const typename V::I part =
            V::load_bits(w + b * Panels<4>::kBlockBytes + 64 * t + 4 * V::W * h);
        for (int j = 0; j < 8; ++j) {  // j < 4: byte j's low nibbles; else byte j - 4's high ones
          const typename V::R q = V::nibble(part, 8 * (j % 4) + 4 * (j / 4));
          const int64_t kk = b * kBlock + 16 * (j / 4) + 4 * t + j % 4;
          V::store(dst + kk * ld + V::W * h,
                   a.mins ? V::fmadd(q, scale, offset) : V::mul(V::sub(q, offset), scale));
        }
      }
    }
  }
}
