// One layer's matmul on quantized weights, W8A8 in blocks of 32, as an XLA FFI custom call:
// out = x @ w[layer], with x quantized to int8 per block of 32 inputs of a row (llama.cpp's Q8_0 x Q8_0 idea).
// Axis letters: the table in kernels_cpu/__init__.py; quant_matmul.py's `reference` is the same arithmetic
// in jnp (and XLA's W8A8 path, jaxinfer's quant._int8_dot, runs the same rule).
//
//   x      f32[M, I]            activations
//   codes  u8[N, C, U, 64]      every layer's unsigned weight codes in C panels of 16 output columns; a row of
//                               64 bytes holds 4 consecutive inputs of each of the 16 columns (byte 4c + i: input
//                               4u + i of column c). 8-bit: U = I / 4. 4-bit: U = I / 8, and the low nibbles are
//                               inputs 8u .. 8u+3, the high nibbles 8u+4 .. 8u+7.
//   scale  f16[N, C, A, 16]     per block of 32 inputs (A = I / 32) and column: w = code * scale + offset
//   offset f16[N, C, A, 16]     (JaxinferQuantMatmul) or none, with w = (code - zero_point) * scale
//                               (JaxinferQuantMatmulSymmetric: Q8_0 and int8 have zero point 128, Q4_0 8)
//   layer  s32[]
//   out    f32[M, F]            F = 16 C
//
// Per block a of a row m: x ~ sx * q with q = round(x * 127 / max|x|) in [-127, 127]. Then
//   sum_i w x = sx * (scale * sum_i code q + offset * sum_i q)            (with offsets)
//   sum_i w x = sx * scale * (sum_i code q - zero_point * sum_i q)        (symmetric: the subtraction is in int32)
// an exact int32 dot per block (AVX512-VNNI's u8 x s8 dot, vpdpbusd), then a conversion, a multiply and one
// or two fused multiply-adds: the symmetric form saves one floating-point op per 8 (4-bit: 8, 8-bit: 8) dots
// and the offsets' bytes. Activation codes are broadcast straight from memory (a load, not a vector-pipe
// shuffle from a general register). Column tiles of kPanels panels are split across XLA's intra-op threads;
// each is multiplied by kRows rows at a time in registers. At decode's few rows of 4-bit codes a task is
// a run of kRun adjacent tiles, and each tile's last pass prefetches the next one's codes into L2, so the
// read of the weights from memory overlaps the arithmetic instead of adding to it (the microbenchmark that
// decided it is in the message of commit 77aeb0b; the kernel's timings as it stands are
// experiments/results/bench_quant_kernel.json). The layer's slice is read in place (see layer_matmul.cc for
// why). Without VNNI a plain loop computes the same sums; the tuner decides whether either wins on the
// machine (jaxinfer/engine/tuning.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "w8a8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer::half_to_float;

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel (panels.QUANT_PANEL_WIDTH)
constexpr int64_t kBlock = 32;  // inputs per activation scale and per weight scale
constexpr int kRows = 4, kPanels = 2;  // register tile: kRows x kPanels int32 and f32 accumulators
constexpr int64_t kRun = 4;  // column tiles per task at up to 4 kRows rows
using Codes = ffi::Buffer<ffi::U8, 4>;
using Scales = ffi::Buffer<ffi::F16, 4>;

// x quantized per block: int8 codes [M, I], and per (row, block) sx and the sum of the codes.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t I, blocks;
};

void quantize_row(const float* x, int64_t row, Activations& a) {
  for (int64_t b = 0; b < a.blocks; ++b) {
    int32_t sum = 0;
    a.scale[row * a.blocks + b] = jaxinfer::quantize_group(x + row * a.I + b * kBlock, kBlock, kBlock, a.codes.data() + row * a.I + b * kBlock, &sum);
    a.sum[row * a.blocks + b] = sum;
  }
}

// One layer of the packed weight, and the geometry of the call.
struct Layer {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* offset;  // nullptr in the symmetric form
  int64_t I, blocks, steps, F;  // steps: rows of 64 bytes per panel (U)
  int bits, zero_point;
};

#ifdef JAXINFER_VNNI
// out[m0 : m0 + R, 16 p0 : 16 (p0 + kPanels)] for one column tile. `ahead`: prefetch the next tile's codes
// (4-bit only; Run never asks it of 8-bit codes).
template <int R, int Bits, bool Symmetric>
void tile(const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  const int64_t next_tile = kPanels * w.steps * 64;  // bytes from a row of codes to the same row of the next tile
  __m512 acc[R][kPanels];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanels; ++v) acc[r][v] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i dot[R][kPanels];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kPanels; ++v) dot[r][v] = _mm512_setzero_si512();
    const int8_t* xb = a.codes.data() + m0 * a.I + b * kBlock;
    if constexpr (Bits == 8) {
      for (int s = 0; s < kBlock / 4; ++s) {
        __m512i wv[kPanels];
        for (int v = 0; v < kPanels; ++v) wv[v] = _mm512_loadu_si512(w.codes + ((p0 + v) * w.steps + b * 8 + s) * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_broadcastd_epi32(_mm_loadu_si32(xb + r * a.I + 4 * s));
          for (int v = 0; v < kPanels; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], wv[v], xv);
        }
      }
    } else {
      for (int s = 0; s < kBlock / 8; ++s) {
        __m512i lo[kPanels], hi[kPanels];
        for (int v = 0; v < kPanels; ++v) {
          const uint8_t* at = w.codes + ((p0 + v) * w.steps + b * 4 + s) * 64;
          if (ahead) _mm_prefetch(reinterpret_cast<const char*>(at + next_tile), _MM_HINT_T1);
          const __m512i raw = _mm512_loadu_si512(at);
          lo[v] = _mm512_and_si512(raw, low_nibbles);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * a.I + 8 * s;
          const __m512i x0 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr)), x1 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr + 4));
          for (int v = 0; v < kPanels; ++v) dot[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][v], lo[v], x0), hi[v], x1);
        }
      }
    }
    __m512 scale[kPanels], offset[kPanels];
    for (int v = 0; v < kPanels; ++v) {
      const int64_t at = ((p0 + v) * w.blocks + b) * kPanel;
      scale[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scale + at)));
      if constexpr (!Symmetric) offset[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.offset + at)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.blocks + b;
      const __m512 sx = _mm512_set1_ps(a.scale[at]);
      if constexpr (Symmetric) {
        const __m512i zero_sum = _mm512_set1_epi32(w.zero_point * a.sum[at]);
        for (int v = 0; v < kPanels; ++v) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v], zero_sum)), sx);
          acc[r][v] = _mm512_fmadd_ps(t, scale[v], acc[r][v]);
        }
      } else {
        const __m512 ss = _mm512_set1_ps(a.scale[at] * static_cast<float>(a.sum[at]));
        for (int v = 0; v < kPanels; ++v) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v]), sx);
          acc[r][v] = _mm512_fmadd_ps(offset[v], ss, _mm512_fmadd_ps(t, scale[v], acc[r][v]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanels; ++v) _mm512_storeu_ps(out + (m0 + r) * w.F + (p0 + v) * kPanel, acc[r][v]);
}

// The column tile at p0; `ahead`: the same core does the tile after it next, so the last pass over this
// tile's codes (one pass per kRows rows) prefetches that tile's into L2 while it computes.
template <int Bits, bool Symmetric>
void column_tile(const Activations& a, const Layer& w, int64_t p0, int64_t M, bool ahead, float* out) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, Bits, Symmetric>(a, w, p0, m, ahead && m + kRows == M, out);
  switch (M - m) {  // the rows left over, fewer than kRows
    case 1: tile<1, Bits, Symmetric>(a, w, p0, m, ahead, out); break;
    case 2: tile<2, Bits, Symmetric>(a, w, p0, m, ahead, out); break;
    case 3: tile<3, Bits, Symmetric>(a, w, p0, m, ahead, out); break;
    default: break;
  }
}

void column_tile_vnni(const Activations& a, const Layer& w, int64_t p0, int64_t M, bool ahead, float* out) {
  const bool symmetric = w.offset == nullptr;
  if (w.bits == 8) symmetric ? column_tile<8, true>(a, w, p0, M, ahead, out) : column_tile<8, false>(a, w, p0, M, ahead, out);
  else symmetric ? column_tile<4, true>(a, w, p0, M, ahead, out) : column_tile<4, false>(a, w, p0, M, ahead, out);
}
#endif

// The same sums without VNNI, one column at a time.
uint32_t code_at(const Layer& w, int64_t p, int64_t c, int64_t k) {
  if (w.bits == 8) return w.codes[(p * w.steps + k / 4) * 64 + 4 * c + k % 4];
  const uint8_t byte = w.codes[(p * w.steps + k / 8) * 64 + 4 * c + k % 4];
  return (k % 8 < 4 ? byte : byte >> 4) & 0x0F;
}

void column_tile_plain(const Activations& a, const Layer& w, int64_t p0, int64_t M, float* out) {
  for (int64_t p = p0; p < p0 + kPanels; ++p)
    for (int64_t c = 0; c < kPanel; ++c)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < w.blocks; ++b) {
          int32_t dot = 0;
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) dot += static_cast<int32_t>(code_at(w, p, c, k)) * a.codes[m * a.I + k];
          const int64_t at = (p * w.blocks + b) * kPanel + c, row_block = m * a.blocks + b;
          const float sum = static_cast<float>(a.sum[row_block]);
          const float offset = w.offset ? half_to_float(w.offset[at]) : -static_cast<float>(w.zero_point) * half_to_float(w.scale[at]);
          acc += a.scale[row_block] * (static_cast<float>(dot) * half_to_float(w.scale[at]) + offset * sum);
        }
        out[m * w.F + p * kPanel + c] = acc;
      }
}

template <typename A, typename B>
bool same_shape(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Both forms: `offset` is nullptr for the symmetric one (then w = (code - zero_point) * scale).
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, Codes codes, Scales scale, const Scales* offset, int zero_point,
               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32>& out) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (auto e = jaxinfer::check(xd.size() == 2 && xd[1] % kBlock == 0 && cd[3] == 64 && cd[1] % kPanels == 0, "quant_matmul: x must be [M, I] with I a multiple of 32, codes [N, C, U, 64] with C even"); e.failure()) return e;
  const int64_t M = xd[0], I = xd[1], index = layer.typed_data()[0];
  const int bits = cd[2] == I / 4 ? 8 : 4;
  if (auto e = jaxinfer::check(cd[2] == I / (bits == 8 ? 4 : 8) && sd[0] == cd[0] && sd[1] == cd[1] && sd[2] == I / kBlock && sd[3] == kPanel && (!offset || same_shape(offset->dimensions(), sd)),
                               "quant_matmul: codes must be [N, C, I/4 or I/8, 64] and scale, offset [N, C, I/32, 16]"); e.failure()) return e;
  if (auto e = jaxinfer::check(0 <= index && index < cd[0], "quant_matmul: layer out of range"); e.failure()) return e;
  if (auto e = jaxinfer::check(0 <= zero_point && zero_point < (1 << bits), "quant_matmul: zero_point must be a code"); e.failure()) return e;
  const int64_t C = cd[1], layer_codes = C * cd[2] * 64, layer_scales = C * (I / kBlock) * kPanel;
  const uint16_t* offsets = offset ? reinterpret_cast<const uint16_t*>(offset->untyped_data()) + index * layer_scales : nullptr;
  const Layer w{codes.typed_data() + index * layer_codes, reinterpret_cast<const uint16_t*>(scale.untyped_data()) + index * layer_scales,
                offsets, I, I / kBlock, cd[2], C * kPanel, bits, zero_point};
  Activations a{std::vector<int8_t>(M * I), std::vector<float>(M * w.blocks), std::vector<int32_t>(M * w.blocks), I, w.blocks};
  const float* xp = x.typed_data();
  jaxinfer::parallel_for(pool, M, [&](int64_t row) { quantize_row(xp, row, a); });
  float* op = out->typed_data();
  // A task is a run of adjacent column tiles: kRun of them for 4-bit codes at decode's few rows, where a
  // tile's codes come from memory and the next one's are prefetched while it computes; one otherwise: at
  // many rows the codes are reused from L2 and small tasks balance the cores, and 8-bit tiles (twice the
  // bytes) measured slower with the prefetch (the microbenchmark is in the message of commit 18916b1).
  const int64_t tiles = C / kPanels, run = M <= 4 * kRows && bits == 4 ? kRun : 1, chunks = (tiles + run - 1) / run;
  jaxinfer::parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t first = c * run, last = std::min(tiles, first + run);
    for (int64_t t = first; t < last; ++t) {
#ifdef JAXINFER_VNNI
      column_tile_vnni(a, w, t * kPanels, M, t + 1 < last, op);
#else
      column_tile_plain(a, w, t * kPanels, M, op);
#endif
    }
  });
  return ffi::Error::Success();
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Codes codes, Scales scale, Scales offset,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, x, codes, scale, &offset, 0, layer, out);
}

ffi::Error QuantMatmulSymmetricImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Codes codes, Scales scale,
                                    ffi::Buffer<ffi::S32> layer, int32_t zero_point, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, x, codes, scale, nullptr, zero_point, layer, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<Codes>()                     // codes
                                  .Arg<Scales>()                    // scale
                                  .Arg<Scales>()                    // offset
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantMatmulSymmetric, QuantMatmulSymmetricImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<Codes>()                     // codes
                                  .Arg<Scales>()                    // scale
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer
                                  .Attr<int32_t>("zero_point")
                                  .Ret<ffi::Buffer<ffi::F32>>());
