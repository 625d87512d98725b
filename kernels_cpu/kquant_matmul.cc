// One layer's matmul on GGUF K-quant (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 weights kept as stored, as an XLA FFI
// custom call: out = x @ w[layer]. kquant_matmul.py packs the weights (`pack`: the panel layout is in its
// docstring) and holds `reference`, the same arithmetic in jnp. Axis letters: kernels_cpu/__init__.py.
//
//   x             f32[M, I]
//   codes         u8[N, C, I/8, 64]   low 4 bits of the codes, quant_matmul.cc's 4-bit layout
//   high          u8[N, C, I/32 or I/16, 64]  bit 4 (5-bit formats) or bits 4-5 (q6_k); empty for q4_k
//   scales        u8 / s8 / f16 [N, C, I/32 or I/16, 16]  sub-block scales (q4_k, q5_k: 6-bit sc; q6_k: int8
//                                     per 16) or the fp16 block scale d (q5_0, q5_1)
//   mins          u8 / f16 [N, C, I/32, 16]  q4_k, q5_k: 6-bit m; q5_1: fp16 m; else empty
//   super_scales  f16[N, C, I/256, 16]  K-quants' d; super_mins f16 the same, q4_k / q5_k's dmin; else empty
//   layer         s32[];  attributes: format (kquant_matmul.FORMATS' index), vectorized (0: the plain loop)
//   out           f32[M, F], F = 16 C
//
// Activations: the project's one W8A8 rule (quant_matmul.cc's quantize_row: int8, symmetric, scale max|x|/127
// per block of 32 of a row), not llama.cpp's Q8_K (one scale per 256, with sums per 16). Chosen for fidelity:
// a block of 32 follows the activations' outliers eight times more closely than a block of 256, and every
// W8A8 path of jaxinfer (XLA's int8 dot, quant_matmul) then quantizes x the same way. The cost is a float
// multiply-add per 32 inputs instead of integer scales summed over 256, which decode does not notice (it
// waits on memory) and prefill pays in about one float op per two vpdpbusd. Per block j of 32 inputs of a
// row, dot = the exact int32 dot of the unsigned codes q with the int8 activation codes, sum = the sum of the
// activation codes, sx = the activation scale (all per 16 inputs for q6_k's halves h):
//   q4_k, q5_k  acc += (dot sx) (d sc_j) - (sx sum) (dmin m_j)     d sc_j and dmin m_j: exact f32 products
//   q6_k        acc += sx ((dot_0 - 32 sum_0) (d sc_0) + (dot_1 - 32 sum_1) (d sc_1))   (the - 32 in int32)
//   q5_0        acc += ((dot - 16 sum) sx) d
//   q5_1        acc += (dot sx) d + (sx sum) m
// Codes: the low nibbles as quant_matmul.cc's (one 64-byte row: 8 inputs of 16 columns, two vpdpbusd), the
// bits above them or-ed in from a 64-byte row of high bits per 32 (1 bit) or 16 (2 bits) inputs, shifted into
// place two bits (or four) per code row. The design is quant_matmul.cc's: column tiles of kPanels panels of 16
// columns split across XLA's intra-op threads, kRows rows in registers, and up to 16 rows runs of kRun tiles,
// each tile's last pass prefetching the next one's bytes (codes, high bits, scales) into L2. Under kRows rows
// each panel is a pass of its own that prefetches the next panel: six arrays per panel are many pointers, and
// a pair of panels spilled them. The layer is read in place.
// Without AVX512-VNNI (or with vectorized = 0) a plain loop computes the same sums.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define JAXINFER_VNNI 1
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kSuper = 256;  // inputs per K-quant super-block
constexpr int kRows = 4, kPanels = 2;  // register tile
constexpr int64_t kRun = 4;  // column tiles per task at decode's few rows

enum Format { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ50 = 3, kQ51 = 4 };
constexpr int kHighBits[] = {0, 1, 2, 1, 1};  // bits above the low nibble
constexpr bool kKQuant(int f) { return f <= kQ6K; }
constexpr bool kHasMins(int f) { return f == kQ4K || f == kQ5K || f == kQ51; }

// x quantized per block of 32 (quant_matmul.cc's rule), with what each format's correction needs.
struct Activations {
  std::vector<int8_t> codes;        // [M, I]
  std::vector<float> scale;         // [M, A]: sx
  std::vector<float> scaled_sum;    // [M, A]: sx * sum of the block's codes (mins)
  std::vector<int32_t> zero_sum;    // [M, J]: zero point * sum of the codes per sub-block (J = I/16 for q6_k, I/32 for q5_0)
  int64_t I, blocks;
};

void quantize_row(const float* x, int64_t row, int format, Activations& a) {
  const int64_t sub = format == kQ6K ? 16 : kBlock, subs = a.I / sub;
  const int32_t zero_point = format == kQ6K ? 32 : format == kQ50 ? 16 : 0;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* xb = x + row * a.I + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* q = a.codes.data() + row * a.I + b * kBlock;
    int32_t sums[2] = {0, 0};
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t c = std::clamp(static_cast<int32_t>(std::nearbyint(xb[i] * inv)), -127, 127);
      q[i] = static_cast<int8_t>(c);
      sums[i / 16] += c;
    }
    const float sx = amax / 127.0f;
    a.scale[row * a.blocks + b] = sx;
    a.scaled_sum[row * a.blocks + b] = sx * static_cast<float>(sums[0] + sums[1]);
    if (sub == 16) {
      a.zero_sum[row * subs + 2 * b] = zero_point * sums[0];
      a.zero_sum[row * subs + 2 * b + 1] = zero_point * sums[1];
    } else {
      a.zero_sum[row * subs + b] = zero_point * (sums[0] + sums[1]);
    }
  }
}

float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, subnormals included
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

// One layer of the packed weight. Every array is panel-major: panel p's part starts at p * (its per-panel size).
struct Layer {
  const uint8_t* codes;    // per panel: steps rows of 64
  const uint8_t* high;     // per panel: high_rows rows of 64
  const uint8_t* scales;   // per panel: sub_scales rows of 16 (u8, s8, or f16: then 32 bytes a row)
  const uint8_t* mins;     // per panel: blocks rows of 16 (u8 or f16)
  const uint16_t* super_scales, *super_mins;  // per panel: supers rows of 16 f16
  int64_t I, blocks, steps, high_rows, sub_scales, supers, F;
};

int64_t scale_bytes(int format) { return format == kQ50 || format == kQ51 ? 2 : 1; }

#ifdef JAXINFER_VNNI
inline __m512 load_f16(const uint16_t* at) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))); }
inline __m512 load_u8(const uint8_t* at) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))); }
inline __m512 load_s8(const uint8_t* at) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))); }
inline void prefetch(const uint8_t* at) { _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1); }

// out[m0 : m0 + R, 16 p0 : 16 (p0 + P)]: P panels (a column tile, or one panel of it at decode's few rows);
// `ahead`: prefetch the bytes of the P panels after them.
template <int R, int P, int Fmt>
void tile(const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  constexpr int Width = kHighBits[Fmt];
  constexpr int Halves = Fmt == kQ6K ? 2 : 1;  // dots per block of 32: q6_k's scales are per 16
  constexpr int SB = Fmt == kQ50 || Fmt == kQ51 ? 2 : 1;  // bytes per sub-block scale
  const int64_t code_panel = w.steps * 64, high_panel = w.high_rows * 64, scale_panel = w.sub_scales * kPanel * SB,
                min_panel = w.blocks * kPanel * SB, super_panel = w.supers * kPanel;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) acc[r][v] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_mask = _mm512_set1_epi8(Width == 2 ? 0x30 : 0x10);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i dot[R][P][Halves];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < P; ++v)
        for (int h = 0; h < Halves; ++h) dot[r][v][h] = _mm512_setzero_si512();
    const int8_t* xb = a.codes.data() + m0 * a.I + b * kBlock;
    __m512i cur[P];  // this block's high bits, shifted down as code rows use them
#pragma GCC unroll 4
    for (int s = 0; s < kBlock / 8; ++s) {
      __m512i lo[P], hi[P];
      for (int v = 0; v < P; ++v) {
        const uint8_t* at = w.codes + (p0 + v) * code_panel + (b * 4 + s) * 64;
        if (ahead) prefetch(at + P * code_panel);
        const __m512i raw = _mm512_loadu_si512(at);
        lo[v] = _mm512_and_si512(raw, low_nibbles);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
        if constexpr (Width > 0) {
          if (s % (4 / Width) == 0) {  // a new row of high bits: per 32 inputs (1 bit), per 16 (2 bits)
            const uint8_t* hat = w.high + (p0 + v) * high_panel + (b * Width + s * Width / 4) * 64;
            if (ahead) prefetch(hat + P * high_panel);
            cur[v] = _mm512_loadu_si512(hat);
          }
          // code row s uses the lowest 2 Width bits of each byte: the first Width for the low nibbles' inputs
          lo[v] = _mm512_or_si512(lo[v], _mm512_and_si512(_mm512_slli_epi16(cur[v], 4), high_mask));
          hi[v] = _mm512_or_si512(hi[v], _mm512_and_si512(_mm512_slli_epi16(cur[v], 4 - Width), high_mask));
          cur[v] = _mm512_srli_epi16(cur[v], 2 * Width);  // bits crossing from the next byte land above those read
        }
      }
      const int h = Halves == 2 ? s / 2 : 0;
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xb + r * a.I + 8 * s;
        const __m512i x0 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr)), x1 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr + 4));
        for (int v = 0; v < P; ++v) dot[r][v][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][v][h], lo[v], x0), hi[v], x1);
      }
    }
    // the scales of block b, per panel
    __m512 scale[P][Halves], minimum[P];
    for (int v = 0; v < P; ++v) {
      const int64_t p = p0 + v;
      if (ahead && b % 2 == 0) {
        prefetch(w.scales + p * scale_panel + b * Halves * kPanel * SB + P * scale_panel);
        if constexpr (kHasMins(Fmt)) prefetch(w.mins + p * min_panel + b * kPanel * SB + P * min_panel);
      }
      if constexpr (kKQuant(Fmt)) {
        const uint16_t* d = w.super_scales + p * super_panel + (b * kBlock / kSuper) * kPanel;
        if (ahead && b % 8 == 0) {
          prefetch(reinterpret_cast<const uint8_t*>(d + P * super_panel));
          if constexpr (Fmt != kQ6K) prefetch(reinterpret_cast<const uint8_t*>(w.super_mins + p * super_panel + (b / 8) * kPanel + P * super_panel));
        }
        const __m512 super = load_f16(d);
        for (int h = 0; h < Halves; ++h) {
          const uint8_t* sc = w.scales + p * scale_panel + (b * Halves + h) * kPanel;
          scale[v][h] = _mm512_mul_ps(super, Fmt == kQ6K ? load_s8(sc) : load_u8(sc));
        }
        if constexpr (Fmt != kQ6K)
          minimum[v] = _mm512_mul_ps(load_f16(w.super_mins + p * super_panel + (b / 8) * kPanel), load_u8(w.mins + p * min_panel + b * kPanel));
      } else {
        scale[v][0] = load_f16(reinterpret_cast<const uint16_t*>(w.scales + p * scale_panel + b * kPanel * 2));
        if constexpr (Fmt == kQ51) minimum[v] = load_f16(reinterpret_cast<const uint16_t*>(w.mins + p * min_panel + b * kPanel * 2));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.blocks + b;
      const __m512 sx = _mm512_set1_ps(a.scale[at]);
      for (int v = 0; v < P; ++v) {
        if constexpr (Fmt == kQ6K) {
          const int32_t* zs = a.zero_sum.data() + 2 * at;
          __m512 inner = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v][0], _mm512_set1_epi32(zs[0]))), scale[v][0]);
          inner = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v][1], _mm512_set1_epi32(zs[1]))), scale[v][1], inner);
          acc[r][v] = _mm512_fmadd_ps(inner, sx, acc[r][v]);
        } else if constexpr (Fmt == kQ50) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v][0], _mm512_set1_epi32(a.zero_sum[at]))), sx);
          acc[r][v] = _mm512_fmadd_ps(t, scale[v][0], acc[r][v]);
        } else {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v][0]), sx), ss = _mm512_set1_ps(a.scaled_sum[at]);
          acc[r][v] = _mm512_fmadd_ps(t, scale[v][0], acc[r][v]);
          acc[r][v] = Fmt == kQ51 ? _mm512_fmadd_ps(ss, minimum[v], acc[r][v]) : _mm512_fnmadd_ps(ss, minimum[v], acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) _mm512_storeu_ps(out + (m0 + r) * w.F + (p0 + v) * kPanel, acc[r][v]);
}

template <int Fmt>
void column_tile(const Activations& a, const Layer& w, int64_t p0, int64_t M, bool ahead, float* out) {
  if (M < kRows) {  // decode: one panel at a time, each prefetching the next (fewer live pointers than a pair)
    switch (M) {
      case 1: tile<1, 1, Fmt>(a, w, p0, 0, true, out), tile<1, 1, Fmt>(a, w, p0 + 1, 0, ahead, out); break;
      case 2: tile<2, 1, Fmt>(a, w, p0, 0, true, out), tile<2, 1, Fmt>(a, w, p0 + 1, 0, ahead, out); break;
      case 3: tile<3, 1, Fmt>(a, w, p0, 0, true, out), tile<3, 1, Fmt>(a, w, p0 + 1, 0, ahead, out); break;
      default: break;  // no rows
    }
    return;
  }
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, kPanels, Fmt>(a, w, p0, m, ahead && m + kRows == M, out);
  switch (M - m) {  // the rows left over, fewer than kRows
    case 1: tile<1, kPanels, Fmt>(a, w, p0, m, ahead, out); break;
    case 2: tile<2, kPanels, Fmt>(a, w, p0, m, ahead, out); break;
    case 3: tile<3, kPanels, Fmt>(a, w, p0, m, ahead, out); break;
    default: break;
  }
}

void column_tile_vnni(int format, const Activations& a, const Layer& w, int64_t p0, int64_t M, bool ahead, float* out) {
  switch (format) {
    case kQ4K: column_tile<kQ4K>(a, w, p0, M, ahead, out); break;
    case kQ5K: column_tile<kQ5K>(a, w, p0, M, ahead, out); break;
    case kQ6K: column_tile<kQ6K>(a, w, p0, M, ahead, out); break;
    case kQ50: column_tile<kQ50>(a, w, p0, M, ahead, out); break;
    default: column_tile<kQ51>(a, w, p0, M, ahead, out); break;
  }
}
#endif

// The same sums without VNNI, one column at a time, in the same order of float operations.
uint32_t code_at(int format, const Layer& w, int64_t p, int64_t c, int64_t k) {
  const uint8_t byte = w.codes[(p * w.steps + k / 8) * 64 + 4 * c + k % 4];
  uint32_t code = (k % 8 < 4 ? byte : byte >> 4) & 0x0F;
  const int width = kHighBits[format];
  if (width) {  // row g of high bits covers 32 / width inputs; within it, code row q = k' / 8, nibble h
    const int64_t span = 32 / width, g = k / span, within = k % span, bit = width * (2 * (within / 8) + (within % 8) / 4);
    code |= ((w.high[(p * w.high_rows + g) * 64 + 4 * c + k % 4] >> bit) & ((1 << width) - 1)) << 4;
  }
  return code;
}

float f16_at(const uint8_t* base, int64_t index) {
  uint16_t h;
  std::memcpy(&h, base + 2 * index, 2);
  return half_to_float(h);
}

void column_tile_plain(int format, const Activations& a, const Layer& w, int64_t p0, int64_t M, float* out) {
  const int64_t halves = format == kQ6K ? 2 : 1, sub = kBlock / halves;
  for (int64_t p = p0; p < p0 + kPanels; ++p)
    for (int64_t c = 0; c < kPanel; ++c)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < w.blocks; ++b) {
          int32_t dot[2] = {0, 0};
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
            dot[(k - b * kBlock) / sub] += static_cast<int32_t>(code_at(format, w, p, c, k)) * a.codes[m * a.I + k];
          const int64_t at = m * a.blocks + b, column = (p * w.blocks + b) * kPanel + c;
          const float sx = a.scale[at];
          const float d = kKQuant(format) ? half_to_float(w.super_scales[(p * w.supers + b * kBlock / kSuper) * kPanel + c]) : 0.0f;
          if (format == kQ6K) {
            float inner = 0.0f;
            for (int64_t h = 0; h < 2; ++h) {
              const float scale = d * static_cast<float>(static_cast<int8_t>(w.scales[(p * w.sub_scales + 2 * b + h) * kPanel + c]));
              inner = std::fma(static_cast<float>(dot[h] - a.zero_sum[2 * at + h]), scale, inner);
            }
            acc = std::fma(inner, sx, acc);
          } else if (format == kQ50) {
            acc = std::fma(static_cast<float>(dot[0] - a.zero_sum[at]) * sx, f16_at(w.scales, column), acc);
          } else if (format == kQ51) {
            acc = std::fma(static_cast<float>(dot[0]) * sx, f16_at(w.scales, column), acc);
            acc = std::fma(a.scaled_sum[at], f16_at(w.mins, column), acc);
          } else {
            const float dmin = half_to_float(w.super_mins[(p * w.supers + b * kBlock / kSuper) * kPanel + c]);
            acc = std::fma(static_cast<float>(dot[0]) * sx, d * static_cast<float>(w.scales[column]), acc);
            acc = std::fma(-a.scaled_sum[at], dmin * static_cast<float>(w.mins[column]), acc);
          }
        }
        out[m * w.F + p * kPanel + c] = acc;
      }
}

// Checks one panel array: [N, C, rows, width] of `bytes`-byte elements (or empty when the format has none).
ffi::Error check_array(const ffi::AnyBuffer& buffer, int64_t N, int64_t C, int64_t rows, int64_t width, int64_t bytes, const char* what) {
  const auto d = buffer.dimensions();
  if (rows == 0) return jaxinfer::check(buffer.element_count() == 0, what);
  const bool ok = d.size() == 4 && d[0] == N && d[1] == C && d[2] == rows && d[3] == width &&
                  static_cast<int64_t>(buffer.size_bytes()) == N * C * rows * width * bytes;
  return jaxinfer::check(ok, what);
}

const uint8_t* layer_of(const ffi::AnyBuffer& buffer, int64_t N, int64_t index) {
  if (buffer.element_count() == 0) return nullptr;
  return static_cast<const uint8_t*>(buffer.untyped_data()) + index * (buffer.size_bytes() / N);
}

ffi::Error KquantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::AnyBuffer high, ffi::AnyBuffer scales,
                            ffi::AnyBuffer mins, ffi::AnyBuffer super_scales, ffi::AnyBuffer super_mins, ffi::Buffer<ffi::S32> layer,
                            int32_t format, int32_t vectorized, ffi::ResultBuffer<ffi::F32> out) {
  if (auto e = jaxinfer::check(0 <= format && format <= kQ51, "kquant_matmul: unknown format"); e.failure()) return e;
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const int64_t super = kKQuant(format) ? kSuper : kBlock;
  if (auto e = jaxinfer::check(xd.size() == 2 && xd[1] % super == 0 && cd.size() == 4 && cd[1] % kPanels == 0,
                               "kquant_matmul: x must be [M, I] with I whole blocks of the format, codes [N, C, I/8, 64] with C even"); e.failure()) return e;
  const int64_t M = xd[0], I = xd[1], N = cd[0], C = cd[1], index = layer.typed_data()[0], blocks = I / kBlock;
  const int width = kHighBits[format];
  const int64_t high_rows = width * I / 32, sub_scales = format == kQ6K ? I / 16 : blocks, supers = kKQuant(format) ? I / kSuper : 0;
  if (auto e = check_array(codes, N, C, I / 8, 64, 1, "kquant_matmul: codes must be u8 [N, C, I/8, 64]"); e.failure()) return e;
  if (auto e = check_array(high, N, C, high_rows, 64, 1, "kquant_matmul: high must be u8 [N, C, I/32 (5-bit) or I/16 (q6_k), 64], empty for q4_k"); e.failure()) return e;
  if (auto e = check_array(scales, N, C, sub_scales, kPanel, scale_bytes(format), "kquant_matmul: scales must be [N, C, I/32 (I/16 for q6_k), 16]"); e.failure()) return e;
  if (auto e = check_array(mins, N, C, kHasMins(format) ? blocks : 0, kPanel, scale_bytes(format), "kquant_matmul: mins must be [N, C, I/32, 16] (q4_k, q5_k, q5_1), else empty"); e.failure()) return e;
  if (auto e = check_array(super_scales, N, C, supers, kPanel, 2, "kquant_matmul: super_scales must be f16 [N, C, I/256, 16] (K-quants), else empty"); e.failure()) return e;
  if (auto e = check_array(super_mins, N, C, format == kQ4K || format == kQ5K ? supers : 0, kPanel, 2, "kquant_matmul: super_mins must be f16 [N, C, I/256, 16] (q4_k, q5_k), else empty"); e.failure()) return e;
  if (auto e = jaxinfer::check(0 <= index && index < N, "kquant_matmul: layer out of range"); e.failure()) return e;
  const Layer w{layer_of(codes, N, index), layer_of(high, N, index), layer_of(scales, N, index), layer_of(mins, N, index),
                reinterpret_cast<const uint16_t*>(layer_of(super_scales, N, index)), reinterpret_cast<const uint16_t*>(layer_of(super_mins, N, index)),
                I, blocks, I / 8, high_rows, sub_scales, supers, C * kPanel};
  Activations a{std::vector<int8_t>(M * I), std::vector<float>(M * blocks), std::vector<float>(M * blocks),
                std::vector<int32_t>(M * (format == kQ6K ? I / 16 : blocks)), I, blocks};
  if (M == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  jaxinfer::parallel_for(pool, M, [&](int64_t row) { quantize_row(xp, row, format, a); });
  float* op = out->typed_data();
  // Runs of kRun tiles at decode's few rows (the next tile's bytes prefetched while one computes), one tile a
  // task otherwise (quant_matmul.cc's rule for 4-bit codes; every format here is under 7 bits a weight).
  const int64_t tiles = C / kPanels, run = M <= 4 * kRows ? kRun : 1, chunks = (tiles + run - 1) / run;
  jaxinfer::parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t first = c * run, last = std::min(tiles, first + run);
    for (int64_t t = first; t < last; ++t) {
#ifdef JAXINFER_VNNI
      if (vectorized) {
        column_tile_vnni(format, a, w, t * kPanels, M, t + 1 < last, op);
        continue;
      }
#endif
      column_tile_plain(format, a, w, t * kPanels, M, op);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferKquantMatmul, KquantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()            // codes
                                  .Arg<ffi::AnyBuffer>()            // high
                                  .Arg<ffi::AnyBuffer>()            // scales
                                  .Arg<ffi::AnyBuffer>()            // mins
                                  .Arg<ffi::AnyBuffer>()            // super_scales
                                  .Arg<ffi::AnyBuffer>()            // super_mins
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("vectorized")
                                  .Ret<ffi::Buffer<ffi::F32>>());
