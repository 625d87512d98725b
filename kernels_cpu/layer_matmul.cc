// One layer's matmul straight from the stacked weights, as an XLA FFI custom call: out = x @ w[layer].
// Axis letters: the table in kernels_cpu/__init__.py; layer_matmul.py's `reference` is the same product in jnp.
//
//   x      f32[M, I]           activations
//   w      f32[N, C, I, 64]    every layer's weight in C panels of 64 output columns (panels.PanelTensor,
//                              packed once by the engine), so each panel is one contiguous run of memory
//   layer  s32[]               which layer
//   out    f32[M, F]           F = 64 C
//
// Inside the model's lax.scan, XLA:CPU copies each layer's slice of a stacked weight out before its dot
// (a dynamic-slice it cannot fuse into the dot); at a few rows those copies cost more than the dots. This
// kernel reads w[layer] in place, once from memory: column blocks of kCols are split across XLA's
// intra-op threads, and each block is multiplied by kRows rows of x at a time in registers, with the
// next rows of the block prefetched.

#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kVec = 16, kRows = 6;  // 24 accumulators of the 32 vector registers
#else
constexpr int kVec = 8, kRows = 3;  // AVX2: 12 of 16
#endif
constexpr int kVecs = 4, kCols = kVec * kVecs;  // columns per block
constexpr int kPrefetchRows = 16;
using Panels = ffi::Buffer<ffi::F32, 4>;  // w: [N, C, I, kPanel] (an alias: the handler macro splits on commas)
constexpr int64_t kPanel = 64;  // columns per panel of the packed layout (panels.PANEL_WIDTH)
static_assert(kPanel % kCols == 0, "a column block must lie inside one panel");
typedef float vf __attribute__((vector_size(kVec * 4), aligned(4)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}

inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }

// A column block of the weight: its first row (rows lie kPanel floats apart), and its first output column.
struct Block {
  const float* w;
  int64_t n0;
};

// out[m0 : m0 + R, n0 : n0 + kCols] = x[m0 : m0 + R, :] @ block (R rows of x: one register tile)
template <int R>
void tile(const float* __restrict x, const Block& b, float* __restrict out, int64_t I, int64_t F, int64_t m0) {
  vf acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = vf{};
  const float* __restrict wp = b.w;
  const int64_t stride = kPanel, n0 = b.n0;
  const float* __restrict xp = x + m0 * I;
  for (int64_t k = 0; k < I; ++k) {
    if (k + kPrefetchRows < I)
      for (int j = 0; j < kCols; j += 16) __builtin_prefetch(wp + (k + kPrefetchRows) * stride + j);
    vf wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = load(wp + k * stride + j * kVec);
    for (int i = 0; i < R; ++i) {
      const float xs = xp[i * I + k];
      for (int j = 0; j < kVecs; ++j) acc[i][j] += xs * wv[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kVecs; ++j) store(out + (m0 + i) * F + n0 + j * kVec, acc[i][j]);
}

// All rows of one column block.
void column_block(const float* x, const Block& b, float* out, int64_t M, int64_t I, int64_t F) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows>(x, b, out, I, F, m);
  switch (M - m) {  // the rows left over, fewer than kRows
    case 1: tile<1>(x, b, out, I, F, m); break;
    case 2: tile<2>(x, b, out, I, F, m); break;
    case 3: if constexpr (kRows > 3) tile<3>(x, b, out, I, F, m); break;
    case 4: if constexpr (kRows > 4) tile<4>(x, b, out, I, F, m); break;
    case 5: if constexpr (kRows > 5) tile<5>(x, b, out, I, F, m); break;
    default: break;
  }
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (auto e = jaxinfer::check(xd.size() == 2 && wd[2] == xd[1] && wd[3] == kPanel, "layer_matmul: x must be [M, I] and w [N, C, I, 64]"); e.failure()) return e;
  const int64_t M = xd[0], I = xd[1], F = wd[1] * kPanel, index = layer.typed_data()[0];
  if (auto e = jaxinfer::check(0 <= index && index < wd[0], "layer_matmul: layer out of range"); e.failure()) return e;
  const float* xp = x.typed_data();
  const float* wl = w.typed_data() + index * I * F;
  float* op = out->typed_data();
  jaxinfer::parallel_for(pool, F / kCols, [=](int64_t b) {
    const int64_t n0 = b * kCols;
    column_block(xp, Block{wl + (n0 / kPanel) * I * kPanel + n0 % kPanel, n0}, op, M, I, F);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferLayerMatmulF32, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<Panels>()                    // w
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());
