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
// Activations: int8, symmetric, scale max|x|/127, per group of a row: per 256 for the K-quants (llama.cpp's
// Q8_K granularity, so the sub-block scales fold into integer sums once per super-block), per 32 for q5_0 /
// q5_1 (quant_matmul.cc's W8A8 rule). dot_j = the exact int32 dot of the unsigned codes q of sub-block j with
// the activation codes, sum_j = the sum of those activation codes, sx = the group's activation scale:
//   q4_k, q5_k  per 256: acc += cvt(sum_j sc_j dot_j) (sx d) - cvt(sum_j m_j sum_j) (sx dmin)    (j per 32)
//   q6_k        per 256: acc += cvt(sum_h sc_h dot_h - 32 sum_h sc_h sum_h) (sx d)              (h per 16)
//   q5_0        per 32:  acc += ((dot - 16 sum) sx) d
//   q5_1        per 32:  acc += (dot sx) d + (sx sum) m
// The integer sums are exact in int32 (|sum sc dot| < 2^28); the float work is once per 256 inputs. sc_j dot_j
// is a vpmulld per sub-block (on Zen 4 a vpdpwssd costs as much as vpmulld + vpaddd: q4_k's dots of 16 inputs fit
// an int16, but one vpdpwssd per 16 inputs made the kernel 7% slower on one core, and a GFNI affine for the
// high nibbles made a loop of the tile's instructions 5% slower than the shift and mask); the min (q6_k: zero-point) term is a vpdpwssd per two sub-blocks, of the 16-bit
// pairs (m_j, m_j+1) of a column with the activation sums (sum_j, sum_j+1), kept as int16 pairs per row.
// Activations are quantized by w8a8.h's quantize_group (AVX-512 where built). Codes: the low nibbles as
// quant_matmul.cc's (one 64-byte row: 8 inputs of 16 columns, two vpdpbusd), the bits above them merged in by
// vpternlogd from a 64-byte row of high bits per 32 (1 bit) or 16 (2 bits) inputs. The design is quant_matmul.cc's: column tiles of kPanels panels of 16
// columns split across XLA's intra-op threads, up to kRows rows in registers (5 for the K-quants, whose f32 sums
// wait in `out` between super-blocks; 4 for q5_0 / q5_1; no tile of 1 or 2 rows after full ones), and up to 16 rows runs of kRun tiles, each tile's last
// pass prefetching the next one's bytes (codes, high bits, scales) into L2. Under kDecodeRows rows
// each panel is a pass of its own that prefetches the next panel: six arrays per panel are many pointers, and
// a pair of panels spilled them. From kTallRows rows q6_k's passes are one panel by kTallRows rows (its 2-bit
// unpacking, the costliest, shared by more rows: 1.01-1.07x on one core). The layer is read in place.
// Without AVX512-VNNI (or with vectorized = 0) a plain loop computes the same sums. Where the CPU has AMX (and
// vectorized = 2, kquant_matmul.py's default) the K-quants from kAmxMinRows rows run on tiles instead (amx_panel):
// the same int32 sums, the same f32 steps, the same bits. Measured on a 2-core Xeon with AMX (shared, loaded: CPU
// time, same-process A/B against the VNNI tiles, 4 layers of 2,048 x 8,192): 512 rows q4_k 1.58x, q6_k 2.51x; 64
// rows 1.48x / 1.82x; 32 rows 1.15-1.39x; 16 rows 0.84-0.91x (hence the threshold). A first form that kept q6_k's
// zero-point term and q4_k's mins term out of the tiles gave q6_k 1.98x; a third tile for the mins (16 rows a
// pass) and a super-block-outer loop were no faster; double-buffered sum tiles (the f32 steps of super-block
// g - 1 while g's tiles compute) gained about 5%; tasks of up to 4 panels (kAmxTaskBytes), each 16-row block
// through all of them in turn (its activation codes from L2 after the first), 1.09-1.15x at 512 rows, ~1.0-1.07x
// at 64 (same-process A/B against the one-panel tasks).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "w8a8.h"
#include "xla/ffi/api/ffi.h"

#if defined(JAXINFER_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define JAXINFER_AMX 1
#endif

namespace ffi = xla::ffi;
using jaxinfer::half_to_float;

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kSuper = 256;  // inputs per K-quant super-block
constexpr int kPanels = 2, kDecodeRows = 4;  // register tile: kPanels panels; under kDecodeRows rows, one panel
constexpr int64_t kAmxMinRows = 32;  // AMX tiles (JAXINFER_AMX) from this many rows: at 16, 0.84-0.91x CPU time (per-panel unpacking)
constexpr int kTallRows = 8;  // q6_k from 8 rows: one panel by 8 rows (its high bits are unpacked for 8 rows, not 5)
constexpr int64_t kRun = 4;  // column tiles per task at decode's few rows

enum Format { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ50 = 3, kQ51 = 4 };
constexpr int kHighBits[] = {0, 1, 2, 1, 1};  // bits above the low nibble
constexpr bool kKQuant(int f) { return f <= kQ6K; }
constexpr bool kHasMins(int f) { return f == kQ4K || f == kQ5K || f == kQ51; }

// Register tile rows: the K-quants keep their f32 sums in `out`, which leaves registers for a fifth row.
constexpr int kRows(int f) { return kKQuant(f) ? 5 : 4; }
constexpr int64_t kGroup(int f) { return kKQuant(f) ? kSuper : kBlock; }  // inputs per activation scale
constexpr int64_t kSub(int f) { return f == kQ6K ? 16 : kBlock; }  // inputs per weight sub-block scale

// x quantized per group (kGroup) with what each format's correction needs.
struct Activations {
  std::vector<int8_t> codes;        // [M, I]
  std::vector<float> scale;         // [M, A]: sx per group
  std::vector<float> scaled_sum;    // [M, A]: sx * sum of the group's codes (q5_1)
  std::vector<int32_t> zero_sum;    // [M, A]: 16 * sum of the group's codes (q5_0)
  std::vector<int32_t> pair_sums;   // [M, I / (2 kSub)] (K-quants): the sums of sub-blocks 2k, 2k + 1 as int16 lo, hi
  int64_t I, groups;
};

void quantize_row(const float* x, int64_t row, int format, Activations& a) {
  const int64_t group = kGroup(format), sub = kSub(format);
  for (int64_t g = 0; g < a.groups; ++g) {
    int32_t sums[kSuper / 16] = {};  // per sub-block
    const float sx = jaxinfer::quantize_group(x + row * a.I + g * group, group, sub, a.codes.data() + row * a.I + g * group, sums);
    a.scale[row * a.groups + g] = sx;
    if (kKQuant(format)) {  // |sum| <= 127 * 32: an int16
      const int64_t pairs = group / (2 * sub), first = (row * a.groups + g) * pairs;
      for (int64_t k = 0; k < pairs; ++k)
        a.pair_sums[first + k] = static_cast<int32_t>((static_cast<uint32_t>(sums[2 * k + 1]) << 16) | (static_cast<uint32_t>(sums[2 * k]) & 0xFFFF));
    } else {
      a.scaled_sum[row * a.groups + g] = sx * static_cast<float>(sums[0]);
      a.zero_sum[row * a.groups + g] = 16 * sums[0];
    }
  }
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
inline __m128i load_16(const uint8_t* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); }
inline void prefetch(const uint8_t* at) { _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1); }

// Per byte, one vpternlogd each: bits 0-3 of a with bits 4-7 of b (kSelectLow), or (a & 0x0F) | b (kOrLow: b
// has only bits 4 and up), the constant operand being 0x0F in every byte.
constexpr int kSelectLow = 0xE4, kOrLow = 0xEC;

// Code row `row` of P panels (step s of its block of 32): the low nibbles' inputs in lo, the high nibbles' in
// hi, the bits above them merged in from `cur` (the current row of high bits, kept as the format needs).
// 1 bit (per 32 inputs): cur[v] shifted down 2 bits a code row, bit 0 for lo and bit 1 for hi. 2 bits (per 16
// inputs, bits 4k + 2h of a byte for code row k, nibble h): cur[v] = the bits of the low nibbles (mask 0x33),
// cur[P + v] those of the high nibbles (0xCC), shifted into bits 4-5 by a code row's parity; the masks leave
// zeros wherever a 16-bit shift carries bits across bytes into bits 4-7.
template <int Width, int P>
inline void load_code_row(const Layer& w, int64_t p0, int64_t row, int s, bool ahead, __m512i* cur, __m512i* lo, __m512i* hi) {
  const int64_t code_panel = w.steps * 64, high_panel = w.high_rows * 64;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < P; ++v) {
    const uint8_t* at = w.codes + (p0 + v) * code_panel + row * 64;
    if (ahead) prefetch(at + P * code_panel);
    const __m512i raw = _mm512_loadu_si512(at), raw_high = _mm512_srli_epi16(raw, 4);
    if constexpr (Width == 0) {
      lo[v] = _mm512_and_si512(raw, low_nibbles);
      hi[v] = _mm512_and_si512(raw_high, low_nibbles);
    } else {
      if (s % (4 / Width) == 0) {  // a new row of high bits: per 32 inputs (1 bit), per 16 (2 bits)
        const uint8_t* hat = w.high + (p0 + v) * high_panel + (row * Width / 4) * 64;
        if (ahead) prefetch(hat + P * high_panel);
        cur[v] = _mm512_loadu_si512(hat);
        if constexpr (Width == 2) {
          cur[P + v] = _mm512_and_si512(cur[v], _mm512_set1_epi8(static_cast<char>(0xCC)));
          cur[v] = _mm512_and_si512(cur[v], _mm512_set1_epi8(0x33));
        }
      }
      if constexpr (Width == 1) {
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        lo[v] = _mm512_ternarylogic_epi32(raw, _mm512_and_si512(_mm512_slli_epi16(cur[v], 4), bit4), low_nibbles, kOrLow);
        hi[v] = _mm512_ternarylogic_epi32(raw_high, _mm512_and_si512(_mm512_slli_epi16(cur[v], 3), bit4), low_nibbles, kOrLow);
        cur[v] = _mm512_srli_epi16(cur[v], 2);  // bits crossing from the next byte land above those read
      } else if (s % 2 == 0) {
        lo[v] = _mm512_ternarylogic_epi32(raw, _mm512_slli_epi16(cur[v], 4), low_nibbles, kSelectLow);
        hi[v] = _mm512_ternarylogic_epi32(raw_high, _mm512_slli_epi16(cur[P + v], 2), low_nibbles, kSelectLow);
      } else {
        lo[v] = _mm512_ternarylogic_epi32(raw, cur[v], low_nibbles, kSelectLow);
        hi[v] = _mm512_ternarylogic_epi32(raw_high, _mm512_srli_epi16(cur[P + v], 2), low_nibbles, kSelectLow);
      }
    }
  }
}

// dot[r][v] += the 8 inputs of a code row times rows xr + r I's 8 activation codes.
template <int R, int P>
inline void dot_code_row(const int8_t* xr, int64_t I, const __m512i* lo, const __m512i* hi, __m512i (*dot)[P]) {
  for (int r = 0; r < R; ++r) {
    const __m512i x0 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr + r * I)), x1 = _mm512_broadcastd_epi32(_mm_loadu_si32(xr + r * I + 4));
    for (int v = 0; v < P; ++v) dot[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][v], lo[v], x0), hi[v], x1);
  }
}

template <int R, int P>
inline void set_zero(__m512i (*a)[P]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) a[r][v] = _mm512_setzero_si512();
}

// Code row s of block b (32 inputs) of P panels times rows m0 .. m0 + R: dot += its 8 inputs' products.
template <int Width, int R, int P>
inline void block_code_row(const Activations& a, const Layer& w, int64_t p0, int64_t m0, int64_t b, int s, bool ahead, __m512i* cur, __m512i (*dot)[P]) {
  __m512i lo[P], hi[P];
  load_code_row<Width, P>(w, p0, b * 4 + s, s, ahead, cur, lo, hi);
  dot_code_row<R, P>(a.codes.data() + m0 * a.I + b * kBlock + 8 * s, a.I, lo, hi, dot);
}

// Prefetches one super-block g of the P panels from p0 on (its sub-scales, mins and fp16 scales).
template <int P, int Fmt>
inline void prefetch_scales(const Layer& w, int64_t p0, int64_t g) {
  constexpr int64_t Subs = kSuper / kSub(Fmt);
  for (int v = 0; v < P; ++v) {
    const int64_t p = p0 + v;
    for (int64_t line = 0; line < Subs * kPanel; line += 64) prefetch(w.scales + p * w.sub_scales * kPanel + g * Subs * kPanel + line);
    if constexpr (Fmt != kQ6K) {
      for (int64_t line = 0; line < 8 * kPanel; line += 64) prefetch(w.mins + p * w.blocks * kPanel + g * 8 * kPanel + line);
      prefetch(reinterpret_cast<const uint8_t*>(w.super_mins + (p * w.supers + g) * kPanel));
    }
    prefetch(reinterpret_cast<const uint8_t*>(w.super_scales + (p * w.supers + g) * kPanel));
  }
}

// out[m0 : m0 + R, 16 p0 : 16 (p0 + P)] of a K-quant: P panels (a column tile, or one panel of it at decode's
// few rows), one super-block of 256 inputs at a time; `ahead`: prefetch the bytes of the P panels after them.
// The f32 sums live in `out` between super-blocks, which frees their registers for the integer ones.
template <int R, int P, int Fmt>
void super_tile(const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  constexpr int Width = kHighBits[Fmt];
  constexpr int64_t Sub = kSub(Fmt), Subs = kSuper / Sub, Pairs = Subs / 2, StepsPerSub = Sub / 8;
  const uint8_t* pair_weights = Fmt == kQ6K ? w.scales : w.mins;  // the 16-bit pairs of the correction term
  const int64_t pair_panel = (Fmt == kQ6K ? w.sub_scales : w.blocks) * kPanel, pairs_per_row = a.I / (2 * Sub);
  // lane c of a pair row: elements c and 16 + c (sub-blocks 2k and 2k + 1 of column c)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t g = 0; g < w.supers; ++g) {
    if (ahead) prefetch_scales<P, Fmt>(w, p0 + P, g);
    __m512i sums[R][P];  // sum_j sc_j dot_j
    set_zero<R, P>(sums);
    for (int64_t b = g * (kSuper / kBlock); b < (g + 1) * (kSuper / kBlock); ++b) {
      __m512i dot[R][P], cur[2 * P];
      set_zero<R, P>(dot);
#pragma GCC unroll 4
      for (int s = 0; s < kBlock / 8; ++s) {
        block_code_row<Width, R, P>(a, w, p0, m0, b, s, ahead, cur, dot);
        if ((s + 1) % StepsPerSub == 0) {  // sub-block j complete: sums += sc_j dot_j
          const int64_t j = (b * 4 + s) / StepsPerSub;
          __m512i sc[P];
          for (int v = 0; v < P; ++v) {
            const __m128i raw = load_16(w.scales + (p0 + v) * w.sub_scales * kPanel + j * kPanel);
            sc[v] = Fmt == kQ6K ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
          }
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < P; ++v) {
              sums[r][v] = _mm512_add_epi32(sums[r][v], _mm512_mullo_epi32(dot[r][v], sc[v]));
              dot[r][v] = _mm512_setzero_si512();
            }
        }
      }
    }
    __m512i corr[R][P];  // q4_k, q5_k: sum_j m_j sum_j; q6_k: sum_h sc_h sum_h
    set_zero<R, P>(corr);
    for (int64_t k = 0; k < Pairs; ++k) {
      __m512i pair[P];
      for (int v = 0; v < P; ++v) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_weights + (p0 + v) * pair_panel + (g * Subs + 2 * k) * kPanel));
        pair[v] = _mm512_permutexvar_epi16(interleave, Fmt == kQ6K ? _mm512_cvtepi8_epi16(raw) : _mm512_cvtepu8_epi16(raw));
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(a.pair_sums[(m0 + r) * pairs_per_row + g * Pairs + k]);
        for (int v = 0; v < P; ++v) corr[r][v] = _mm512_dpwssd_epi32(corr[r][v], pair[v], x);
      }
    }
    for (int v = 0; v < P; ++v) {
      const __m512 d = load_f16(w.super_scales + ((p0 + v) * w.supers + g) * kPanel);
      const __m512 dmin = Fmt == kQ6K ? d : load_f16(w.super_mins + ((p0 + v) * w.supers + g) * kPanel);
      for (int r = 0; r < R; ++r) {
        float* at = out + (m0 + r) * w.F + (p0 + v) * kPanel;
        const __m512 sx = _mm512_set1_ps(a.scale[(m0 + r) * a.groups + g]);
        __m512 acc = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(at);
        if constexpr (Fmt == kQ6K) {
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][v], _mm512_slli_epi32(corr[r][v], 5))), _mm512_mul_ps(sx, d), acc);
        } else {
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][v]), _mm512_mul_ps(sx, d), acc);
          acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr[r][v]), _mm512_mul_ps(sx, dmin), acc);
        }
        _mm512_storeu_ps(at, acc);
      }
    }
  }
}

// out[m0 : m0 + R, 16 p0 : 16 (p0 + P)] of q5_0 / q5_1, a block of 32 inputs at a time (as super_tile).
template <int R, int P, int Fmt>
void block_tile(const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  const int64_t scale_panel = w.blocks * kPanel * 2;  // f16 d (and m) per block and column
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i dot[R][P], cur[2 * P];
    set_zero<R, P>(dot);
#pragma GCC unroll 4
    for (int s = 0; s < kBlock / 8; ++s) block_code_row<1, R, P>(a, w, p0, m0, b, s, ahead, cur, dot);
    __m512 scale[P], minimum[P];
    for (int v = 0; v < P; ++v) {
      const int64_t p = p0 + v;
      if (ahead && b % 2 == 0) {
        prefetch(w.scales + p * scale_panel + b * kPanel * 2 + P * scale_panel);
        if constexpr (Fmt == kQ51) prefetch(w.mins + p * scale_panel + b * kPanel * 2 + P * scale_panel);
      }
      scale[v] = load_f16(reinterpret_cast<const uint16_t*>(w.scales + p * scale_panel + b * kPanel * 2));
      if constexpr (Fmt == kQ51) minimum[v] = load_f16(reinterpret_cast<const uint16_t*>(w.mins + p * scale_panel + b * kPanel * 2));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * a.groups + b;
      const __m512 sx = _mm512_set1_ps(a.scale[at]);
      for (int v = 0; v < P; ++v) {
        if constexpr (Fmt == kQ50) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v], _mm512_set1_epi32(a.zero_sum[at]))), sx);
          acc[r][v] = _mm512_fmadd_ps(t, scale[v], acc[r][v]);
        } else {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v]), sx);
          acc[r][v] = _mm512_fmadd_ps(t, scale[v], acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(a.scaled_sum[at]), minimum[v], acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < P; ++v) _mm512_storeu_ps(out + (m0 + r) * w.F + (p0 + v) * kPanel, acc[r][v]);
}

template <int R, int P, int Fmt>
void tile(const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  if constexpr (kKQuant(Fmt)) super_tile<R, P, Fmt>(a, w, p0, m0, ahead, out);
  else block_tile<R, P, Fmt>(a, w, p0, m0, ahead, out);
}

// tile<rows, P> for 0 <= rows < R: the rows left over.
template <int R, int P, int Fmt>
void tile_rows(int64_t rows, const Activations& a, const Layer& w, int64_t p0, int64_t m0, bool ahead, float* out) {
  if constexpr (R > 1) {
    if (rows == R - 1) tile<R - 1, P, Fmt>(a, w, p0, m0, ahead, out);
    else tile_rows<R - 1, P, Fmt>(rows, a, w, p0, m0, ahead, out);
  }
}

template <int Fmt>
void column_tile(const Activations& a, const Layer& w, int64_t p0, int64_t M, bool ahead, float* out) {
  if (M < kDecodeRows) {  // decode: one panel at a time, each prefetching the next (fewer live pointers than a pair)
    tile_rows<kDecodeRows, 1, Fmt>(M, a, w, p0, 0, true, out);
    tile_rows<kDecodeRows, 1, Fmt>(M, a, w, p0 + 1, 0, ahead, out);
    return;
  }
  if constexpr (Fmt == kQ6K) {
    if (M >= kTallRows) {
      for (int64_t p = p0; p < p0 + kPanels; ++p) {
        const bool next = p + 1 < p0 + kPanels || ahead;
        int64_t m = 0;
        for (; m + kTallRows <= M; m += kTallRows) tile<kTallRows, 1, Fmt>(a, w, p, m, next && m + kTallRows == M, out);
        tile_rows<kTallRows, 1, Fmt>(M - m, a, w, p, m, next, out);
      }
      return;
    }
  }
  // Tiles of Rows rows and one of the rest, unless the rest is 1 or 2 rows: then ceil(M / Rows) tiles of near-equal
  // rows (16: 4 4 4 4, not 5 5 5 1). A tile of one or two rows keeps too few chains of vpdpbusd in flight to hide
  // their latency (16 rows: 4-8% less CPU time on the 1B shapes, loaded A/B; 8 rows, 5 3, were no faster as 4 4).
  constexpr int Rows = kRows(Fmt);
  const int64_t tiles = (M + Rows - 1) / Rows, rest = M % Rows;
  const bool spread = rest == 1 || rest == 2;
  const int64_t base = spread ? M / tiles : Rows, taller = spread ? M % tiles : 0;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = std::min(base + (t < taller), M - m);
    tile_rows<Rows + 1, kPanels, Fmt>(rows, a, w, p0, m, ahead && t + 1 == tiles, out);
    m += rows;
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

#ifdef JAXINFER_AMX
// AMX (Sapphire Rapids and later), K-quants from kAmxMinRows rows, one panel a task. The panel's codes times their
// sub-block scales, p = sc q (q6_k: sc (q - 32), its zero point folded in; |p| < 2^12), are unpacked once per
// panel as B tiles' bytes, p = 256 hi + lo (lo u8, hi s8), so q4_k / q5_k's sum_j sc_j dot_j (q6_k's
// sum_h sc_h dot_h - 32 sum_h sc_h sum_h) = x . lo + 256 x . hi: two tile products (tdpbsud, tdpbssd) per 64
// inputs, the VNNI tiles' exact int32 sums without a vpmulld per sub-block. The mins term sum_j m_j sum_j is a
// third, x . (m_j of each input's sub-block). The f32 steps per super-block are super_tile's, op for op, so the
// outputs are the same bits.
constexpr int64_t kAmxTileRows = 16;  // rows of an A (activation) and C (sum) tile
constexpr int64_t kAmxTaskBytes = 512 * 1024;  // B bytes a task unpacks: 4 panels of 2,048 inputs, 2 of 8,192

bool amx_permitted() {  // Linux hands a process the AMX tile state only when asked (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

void configure_tiles() {  // eight tiles of 16 rows of 64 bytes
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = kAmxTileRows;
  _tile_loadconfig(&c);
}

// Panel p as B rows (row k: inputs 4k .. 4k + 3 of the 16 columns, byte 4c + i): p = sc q (q6_k: sc (q - 32))
// split into lo (u8) and hi (s8) bytes.
template <int Fmt>
void scaled_codes(const Layer& w, int64_t p, __m512i* lo, __m512i* hi) {
  constexpr int Width = kHighBits[Fmt];
  const __m512i low_bytes = _mm512_set1_epi16(0x00FF);
  __m512i cur[2];
  for (int64_t u = 0; u < w.steps; ++u) {
    __m512i q[2];
    load_code_row<Width, 1>(w, p, u, static_cast<int>(u % 4), false, cur, &q[0], &q[1]);
    const int64_t j = 8 * u / kSub(Fmt);  // the sub-block of the row's 8 inputs
    const __m128i raw = load_16(w.scales + p * w.sub_scales * kPanel + j * kPanel);
    const __m512i sc32 = Fmt == kQ6K ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc32, 16));  // per 16-bit lane
    for (int h = 0; h < 2; ++h) {  // the low nibbles' inputs (B row 2u), the high nibbles' (2u + 1)
      __m512i even, odd;  // the bytes 2k and 2k + 1 as 16-bit lanes
      if constexpr (Fmt == kQ6K) {
        const __m512i v = _mm512_sub_epi8(q[h], _mm512_set1_epi8(32));
        even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8);
      } else {
        even = _mm512_and_si512(q[h], low_bytes), odd = _mm512_srli_epi16(q[h], 8);
      }
      even = _mm512_mullo_epi16(even, sc), odd = _mm512_mullo_epi16(odd, sc);
      lo[2 * u + h] = _mm512_or_si512(_mm512_and_si512(even, low_bytes), _mm512_slli_epi16(odd, 8));
      hi[2 * u + h] = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 8), low_bytes), _mm512_andnot_si512(low_bytes, odd));
    }
  }
}

// out[m0 + r, panel p] for r < rows, super-block g, from the tiles' sums lo + 256 hi: q4_k / q5_k's mins term
// (super_tile's vpdpwssd of the pairs of mins with the pairs of activation sums), then super_tile's f32 steps.
template <int Fmt>
void finish_rows(const Activations& a, const Layer& w, int64_t p, int64_t m0, int64_t rows, int64_t g, const int32_t (*lo)[kPanel],
                 const int32_t (*hi)[kPanel], float* out) {
  constexpr int64_t Pairs = kSuper / kSub(Fmt) / 2;
  const int64_t pairs_per_row = a.I / (2 * kSub(Fmt));
  __m512i pair[Pairs];
  if constexpr (Fmt != kQ6K) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t k = 0; k < Pairs; ++k) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + p * w.blocks * kPanel + (g * 2 * Pairs + 2 * k) * kPanel));
      pair[k] = _mm512_permutexvar_epi16(interleave, _mm512_cvtepu8_epi16(raw));
    }
  }
  const __m512 d = load_f16(w.super_scales + (p * w.supers + g) * kPanel);
  const __m512 dmin = Fmt == kQ6K ? d : load_f16(w.super_mins + (p * w.supers + g) * kPanel);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i sums = _mm512_add_epi32(_mm512_load_si512(lo[r]), _mm512_slli_epi32(_mm512_load_si512(hi[r]), 8));
    float* at = out + (m0 + r) * w.F + p * kPanel;
    const __m512 sx = _mm512_set1_ps(a.scale[(m0 + r) * a.groups + g]);
    __m512 acc = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(at);
    if constexpr (Fmt == kQ6K) {  // sums is super_tile's sums - 32 corr
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sx, d), acc);
    } else {
      __m512i corr = _mm512_setzero_si512();
      for (int64_t k = 0; k < Pairs; ++k) corr = _mm512_dpwssd_epi32(corr, pair[k], _mm512_set1_epi32(a.pair_sums[(m0 + r) * pairs_per_row + g * Pairs + k]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sx, d), acc);
      acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr), _mm512_mul_ps(sx, dmin), acc);
    }
    _mm512_storeu_ps(at, acc);
  }
}

// Super-block g of 16 rows from x into sum tiles 3-4 (Odd false) or 5-6 (zeroed first): tmm0 A, tmm1-2 B (lo,
// hi). The tile numbers are literals: GCC's tile intrinsics paste them into the assembly.
template <bool Odd>
inline void super_tiles(const int8_t* x, int64_t I, const __m512i* lo, const __m512i* hi, int64_t g) {
  if constexpr (Odd) {
    _tile_zero(5);
    _tile_zero(6);
  } else {
    _tile_zero(3);
    _tile_zero(4);
  }
  for (int64_t k0 = g * kSuper; k0 < (g + 1) * kSuper; k0 += 64) {
    _tile_loadd(0, x + k0, I);
    _tile_loadd(1, lo + k0 / 4, 64);
    _tile_loadd(2, hi + k0 / 4, 64);
    if constexpr (Odd) {
      _tile_dpbsud(5, 0, 1);
      _tile_dpbssd(6, 0, 2);
    } else {
      _tile_dpbsud(3, 0, 1);
      _tile_dpbssd(4, 0, 2);
    }
  }
}

// One row block (16 rows from m0) of panel p: super-block g's sums go to tiles 3-4 or 5-6 by its parity, and
// those of g - 1 are stored and finished (AVX-512) while the tiles of g compute.
template <int Fmt>
void amx_rows(const Activations& a, const Layer& w, int64_t p, int64_t m0, int64_t M, const __m512i* lo, const __m512i* hi, float* out) {
  alignas(64) int32_t sums[2][2][kAmxTileRows][kPanel];  // by parity of g: x . lo, x . hi
  const int8_t* x = a.codes.data() + m0 * a.I;
  const int64_t rows = std::min(kAmxTileRows, M - m0);
  for (int64_t g = 0; g < w.supers; ++g) {
    if (g % 2 == 0) {
      if (g > 0) {
        _tile_stored(5, sums[1][0], 64);
        _tile_stored(6, sums[1][1], 64);
      }
      super_tiles<false>(x, a.I, lo, hi, g);
    } else {
      _tile_stored(3, sums[0][0], 64);
      _tile_stored(4, sums[0][1], 64);
      super_tiles<true>(x, a.I, lo, hi, g);
    }
    if (g > 0) finish_rows<Fmt>(a, w, p, m0, rows, g - 1, sums[(g - 1) % 2][0], sums[(g - 1) % 2][1], out);
  }
  const int64_t last = w.supers - 1;
  if (last % 2 == 0) {
    _tile_stored(3, sums[0][0], 64);
    _tile_stored(4, sums[0][1], 64);
  } else {
    _tile_stored(5, sums[1][0], 64);
    _tile_stored(6, sums[1][1], 64);
  }
  finish_rows<Fmt>(a, w, p, m0, rows, last, sums[last % 2][0], sums[last % 2][1], out);
}

// out[:, panels p0 .. p0 + count) of a K-quant by AMX tiles: every panel's B bytes unpacked first, then each row
// block of 16 through every panel in turn, so its activation codes (16 I bytes) are read from L2 by all but the
// first. The activation codes hold whole tiles of rows (those past M are zeros, their sums never written).
template <int Fmt>
void amx_panels(const Activations& a, const Layer& w, int64_t p0, int64_t count, int64_t M, float* out) {
  thread_local std::vector<uint8_t> bytes;  // per panel lo, hi: I / 4 rows of 64 bytes each, from a 64-byte boundary
  bytes.resize(count * 32 * w.I + 64);
  __m512i* base = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
  for (int64_t v = 0; v < count; ++v) scaled_codes<Fmt>(w, p0 + v, base + v * w.I / 2, base + v * w.I / 2 + w.I / 4);
  for (int64_t m0 = 0; m0 < M; m0 += kAmxTileRows)
    for (int64_t v = 0; v < count; ++v) amx_rows<Fmt>(a, w, p0 + v, m0, M, base + v * w.I / 2, base + v * w.I / 2 + w.I / 4, out);
}

void amx_panels_of(int format, const Activations& a, const Layer& w, int64_t p0, int64_t count, int64_t M, float* out) {
  configure_tiles();
  switch (format) {
    case kQ4K: amx_panels<kQ4K>(a, w, p0, count, M, out); break;
    case kQ5K: amx_panels<kQ5K>(a, w, p0, count, M, out); break;
    default: amx_panels<kQ6K>(a, w, p0, count, M, out); break;
  }
  _tile_release();
}
#endif
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

// One group (a super-block, or q5_0 / q5_1's block) of column c of panel p times row m, added to acc.
float group_plain(int format, const Activations& a, const Layer& w, int64_t p, int64_t c, int64_t m, int64_t g, float acc) {
  const int64_t group = kGroup(format), sub = kSub(format);
  int32_t sums = 0, corr = 0;  // the integer sums of the module comment
  for (int64_t j = g * group / sub; j < (g + 1) * group / sub; ++j) {
    int32_t dot = 0, x_sum = 0;
    for (int64_t k = j * sub; k < (j + 1) * sub; ++k) {
      dot += static_cast<int32_t>(code_at(format, w, p, c, k)) * a.codes[m * a.I + k];
      x_sum += a.codes[m * a.I + k];
    }
    if (format == kQ6K || format == kQ4K || format == kQ5K) {
      const int32_t sc = format == kQ6K ? static_cast<int8_t>(w.scales[(p * w.sub_scales + j) * kPanel + c]) : w.scales[(p * w.sub_scales + j) * kPanel + c];
      sums += sc * dot;
      corr += (format == kQ6K ? sc : w.mins[(p * w.blocks + j) * kPanel + c]) * x_sum;
    } else {
      sums = dot;
    }
  }
  const float sx = a.scale[m * a.groups + g];
  if (kKQuant(format)) {
    const float d = half_to_float(w.super_scales[(p * w.supers + g) * kPanel + c]);
    if (format == kQ6K) return std::fma(static_cast<float>(sums - 32 * corr), sx * d, acc);
    const float dmin = half_to_float(w.super_mins[(p * w.supers + g) * kPanel + c]);
    return std::fma(-static_cast<float>(corr), sx * dmin, std::fma(static_cast<float>(sums), sx * d, acc));
  }
  const int64_t column = (p * w.blocks + g) * kPanel + c;
  if (format == kQ50) return std::fma(static_cast<float>(sums - a.zero_sum[m * a.groups + g]) * sx, f16_at(w.scales, column), acc);
  return std::fma(a.scaled_sum[m * a.groups + g], f16_at(w.mins, column), std::fma(static_cast<float>(sums) * sx, f16_at(w.scales, column), acc));
}

void column_tile_plain(int format, const Activations& a, const Layer& w, int64_t p0, int64_t M, float* out) {
  for (int64_t p = p0; p < p0 + kPanels; ++p)
    for (int64_t c = 0; c < kPanel; ++c)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t g = 0; g < a.groups; ++g) acc = group_plain(format, a, w, p, c, m, g, acc);
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
  const int64_t groups = I / kGroup(format), kquant = kKQuant(format) ? 1 : 0;
#ifdef JAXINFER_AMX
  const bool amx = vectorized == 2 && kquant && M >= kAmxMinRows && amx_permitted();
  const int64_t code_rows = amx ? (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows : M;  // whole A tiles
#else
  const int64_t code_rows = M;
#endif
  Activations a{std::vector<int8_t>(code_rows * I), std::vector<float>(M * groups), std::vector<float>(M * groups * (1 - kquant)),
                std::vector<int32_t>(M * groups * (1 - kquant)), std::vector<int32_t>(M * kquant * I / (2 * kSub(format))), I, groups};
  if (M == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  jaxinfer::parallel_for(pool, M, [&](int64_t row) { quantize_row(xp, row, format, a); });
  float* op = out->typed_data();
#ifdef JAXINFER_AMX
  if (amx) {
    const int64_t per_task = std::clamp<int64_t>(kAmxTaskBytes / (32 * I), 1, 4);  // panels a task (their B bytes in L2)
    jaxinfer::parallel_for(pool, (C + per_task - 1) / per_task,
                           [&](int64_t t) { amx_panels_of(format, a, w, t * per_task, std::min(per_task, C - t * per_task), M, op); });
    return ffi::Error::Success();
  }
#endif
  // Runs of kRun tiles at decode's few rows (the next tile's bytes prefetched while one computes), one tile a
  // task otherwise (quant_matmul.cc's rule for 4-bit codes; every format here is under 7 bits a weight).
  const int64_t tiles = C / kPanels, run = M <= 4 * kDecodeRows ? kRun : 1, chunks = (tiles + run - 1) / run;
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
