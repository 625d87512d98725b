// One layer's matmul straight from the stacked weights, as an XLA FFI custom call: out = x @ w[layer].
//
//   x      f32[M, K]           activations (a decode step's rows)
//   w      f32[N, K, F]        every layer's weight, contraction dimension first (model.py's Params layout)
//          or f32[N, P, K, 64] the same in panels of 64 columns (attribute panel = 1; F = 64 P)
//   layer  s32[]               which layer
//   out    f32[M, F]
//
// The panel layout (quant.PanelTensor, packed once by the engine) makes each column block one
// contiguous run of memory: in the row layout a block's rows lie F floats apart, a new page every row.
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
constexpr int64_t kPanel = 64;  // columns per panel of the packed layout (quant.PANEL_WIDTH)
static_assert(kPanel % kCols == 0, "a column block must lie inside one panel");
typedef float vf __attribute__((vector_size(kVec * 4), aligned(4)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}

inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }

// A column block of the weight: its first row, and the distance between its rows (F or kPanel).
struct Block {
  const float* w;
  int64_t stride;
  int64_t n0;  // its first output column
};

// out[m0 : m0 + R, n0 : n0 + kCols] = x[m0 : m0 + R, :] @ block
template <int R>
void tile(const float* __restrict x, const Block& b, float* __restrict out, int64_t K, int64_t F, int64_t m0) {
  vf acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = vf{};
  const float* __restrict wp = b.w;
  const int64_t stride = b.stride, n0 = b.n0;
  const float* __restrict xp = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    if (k + kPrefetchRows < K)
      for (int j = 0; j < kCols; j += 16) __builtin_prefetch(wp + (k + kPrefetchRows) * stride + j);
    vf wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = load(wp + k * stride + j * kVec);
    for (int i = 0; i < R; ++i) {
      const float xs = xp[i * K + k];
      for (int j = 0; j < kVecs; ++j) acc[i][j] += xs * wv[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kVecs; ++j) store(out + (m0 + i) * F + n0 + j * kVec, acc[i][j]);
}

// All rows of one column block.
void column_block(const float* x, const Block& b, float* out, int64_t M, int64_t K, int64_t F) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows>(x, b, out, K, F, m);
  switch (M - m) {  // the rows left over, fewer than kRows
    case 1: tile<1>(x, b, out, K, F, m); break;
    case 2: tile<2>(x, b, out, K, F, m); break;
    case 3: if constexpr (kRows > 3) tile<3>(x, b, out, K, F, m); break;
    case 4: if constexpr (kRows > 4) tile<4>(x, b, out, K, F, m); break;
    case 5: if constexpr (kRows > 5) tile<5>(x, b, out, K, F, m); break;
    default: break;
  }
}

// The columns past the last full block (F not a multiple of kCols), plainly.
void column_tail(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t F, int64_t n0) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < F; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[k * F + n];
      out[m * F + n] = s;
    }
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out, int32_t panel) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const bool panels = panel != 0;
  if (auto e = jaxinfer::check(w.element_type() == ffi::DataType::F32, "layer_matmul: w must be float32"); e.failure()) return e;
  if (auto e = jaxinfer::check(xd.size() == 2 && wd.size() == (panels ? 4u : 3u), "layer_matmul: x must be [M, K] and w [N, K, F] or [N, P, K, 64]"); e.failure()) return e;
  const int64_t M = xd[0], K = xd[1], F = panels ? wd[1] * kPanel : wd[2], index = layer.typed_data()[0];
  if (auto e = jaxinfer::check(wd[panels ? 2 : 1] == K && (!panels || wd[3] == kPanel), "layer_matmul: x and w disagree on K, or panels are not 64 wide"); e.failure()) return e;
  if (auto e = jaxinfer::check(0 <= index && index < wd[0], "layer_matmul: layer out of range"); e.failure()) return e;
  const float* xp = x.typed_data();
  const float* wl = static_cast<const float*>(w.untyped_data()) + index * K * F;
  float* op = out->typed_data();
  const int64_t blocks = F / kCols, tasks = blocks + (blocks * kCols < F ? 1 : 0);
  jaxinfer::parallel_for(pool, tasks, [=](int64_t b) {
    if (b >= blocks) return column_tail(xp, wl, op, M, K, F, blocks * kCols);  // row layout only: panels are whole
    const int64_t n0 = b * kCols;
    const Block block = panels ? Block{wl + (n0 / kPanel) * K * kPanel + n0 % kPanel, kPanel, n0} : Block{wl + n0, F, n0};
    column_block(xp, block, op, M, K, F);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferLayerMatmulF32, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w, rank 3 or 4
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("panel"));
