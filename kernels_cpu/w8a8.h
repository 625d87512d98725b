// Shared by quant_matmul.cc and kquant_matmul.cc: which vector form is built, the int8 activation rule of
// their W8A8 dots, and fp16 decoding for their plain loops.
//
// JAXINFER_VNNI is defined when the compiler targets AVX512F + AVX512BW + AVX512-VNNI (-march=native on such a
// CPU); the kernels then build their vector tiles, else only their plain loops (the same sums).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define JAXINFER_VNNI 1
#endif

namespace jaxinfer {

// One group of `group` inputs (a multiple of 16) of an activation row, quantized symmetrically: codes
// q = clamp(round(x * 127 / max|x|), -127, 127) into `codes`, the sums of its sub-blocks of `sub` inputs added
// to sums[0 .. group / sub); returns the scale sx = max|x| / 127. The AVX-512 form does the same f32 products
// and rounds as nearbyint does (to nearest even, the default MXCSR mode): both give the same codes. The scalar
// loop was 40% of a 64-row K-quant call on Zen 4, as long as the integer dots themselves.
inline float quantize_group(const float* x, int64_t group, int64_t sub, int8_t* codes, int32_t* sums) {
#ifdef JAXINFER_VNNI
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < group; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i lowest = _mm512_set1_epi32(-127), highest = _mm512_set1_epi32(127);
  for (int64_t i = 0; i < group; i += 16) {
    const __m512i c = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv)), highest), lowest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(c));
    sums[i / sub] += _mm512_reduce_add_epi32(c);
  }
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < group; ++i) {
    const int32_t c = std::clamp(static_cast<int32_t>(std::nearbyint(x[i] * inv)), -127, 127);
    codes[i] = static_cast<int8_t>(c);
    sums[i / sub] += c;
  }
#endif
  return amax / 127.0f;
}

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, subnormals included
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    float value = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace jaxinfer
