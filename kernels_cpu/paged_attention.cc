// Paged attention on the CPU, as an XLA FFI custom call: jaxinfer's CPU twin of kernels_pallas/.
//
// It reads each row's pages straight from the pool, in the pool's own layout (kv_pool.py), and keeps an
// online softmax per query, so no page is copied or transposed: the jnp path gathers every page of the
// step into a new array and transposes it for the dot, several passes over memory for one read.
// Axis letters: the table in kernels_cpu/__init__.py.
//
//   q        f32[B, T, H, K]     this step's queries (T = 1 in decode)
//   k_pool   f32[N, G, P, K, L]  every layer's keys, K transposed per page
//   v_pool   f32[N, G, P, L, K]
//   layer    s32[]               which layer of the pool
//   tables   s32[B, E]           each row's pages: every id in [0, P), checked (kInvalidArgument otherwise)
//   page_pos s32[B, E]           position of entry e's first slot
//   page_seg s32[B, E]           sequence of the row that entry e belongs to
//   q_pos    s32[B, T]           each query's position
//   q_seg    s32[B, T]           each query's sequence within its row
//   window   s32[]               sliding window W (>= 1); no window is W = 2^31 - 1
//   softcap  f32 attribute       attention soft-cap c > 0: a scaled score s becomes c * tanh(s / c) (Gemma 2); 0: none
//   out      f32[B, T, H, K]
//
// Slot l of entry e is visible to query t iff page_seg[e] == q_seg[t] and
// q_pos[t] - W < page_pos[e] + l <= q_pos[t]: causal by position, within the last W positions (HF
// transformers' sliding-window rule), and in a packed row (several sequences back to back) block-diagonal
// by sequence, so a query skips other sequences' pages and pages wholly before its window entirely (their
// table entries may name the null page once the host has released them). A query that sees nothing (a
// padding lane) gets zeros.
// kernels_cpu/paged_attention.py's `reference` is the same rule in jnp.
//
// Work is split into tasks of (row, kv head, tile of queries) and run on XLA's intra-op thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryTile = 16;  // queries per task: a page is read once per tile (it stays in L1)

struct Geometry {
  int64_t B, T, H, K, G, P, L, E, N;
  int64_t group() const { return H / G; }
};

struct Inputs {
  const float* q;
  const float* k_pool;
  const float* v_pool;
  int64_t layer;
  const int32_t* tables;
  const int32_t* page_pos;
  const int32_t* page_seg;
  const int32_t* q_pos;
  const int32_t* q_seg;
  int64_t window;
  float softcap;  // 0: scores as they are
  float* out;
};

// Scores of `group` query heads against one page's keys: s[h][l] = sum_k q[h][k] * kp[k][l].
// LT and KT are the page size and head dim when known at compile time (0: use g.L, g.K).
template <int LT, int KT>
inline void page_scores(const float* __restrict q, const float* __restrict kp, float* __restrict s, int64_t group, const Geometry& g) {
  const int64_t L = LT ? LT : g.L, K = KT ? KT : g.K;
  for (int64_t h = 0; h < group; ++h) {
    float* __restrict sh = s + h * L;
    const float* __restrict qh = q + h * K;
    for (int64_t l = 0; l < L; ++l) sh[l] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float qk = qh[k];
      const float* __restrict row = kp + k * L;
      for (int64_t l = 0; l < L; ++l) sh[l] += qk * row[l];
    }
  }
}

// Soft-cap slots [a, n) of each head's scores in place: s = c * tanh(s / c).
inline void cap_scores(float* __restrict s, int64_t a, int64_t n, int64_t group, int64_t L, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t h = 0; h < group; ++h)
    for (int64_t l = a; l < n; ++l) s[h * L + l] = cap * std::tanh(s[h * L + l] * inv);
}

// Fold slots [a, n) of a page into one query's running softmax (max m, sum d, output acc).
template <int LT, int KT>
inline void page_update(const float* __restrict s, const float* __restrict vp, int64_t a, int64_t n, float* __restrict m, float* __restrict d,
                        float* __restrict acc, int64_t group, const Geometry& g) {
  const int64_t L = LT ? LT : g.L, K = KT ? KT : g.K;
  float e[LT ? LT : 256];
  for (int64_t h = 0; h < group; ++h) {
    const float* sh = s + h * L;
    float top = m[h];
    for (int64_t l = a; l < n; ++l) top = std::max(top, sh[l]);
    const float rescale = std::exp(m[h] - top);
    float sum = 0.0f;
    for (int64_t l = a; l < n; ++l) {
      e[l] = std::exp(sh[l] - top);
      sum += e[l];
    }
    m[h] = top;
    d[h] = d[h] * rescale + sum;
    float* __restrict ah = acc + h * K;
    for (int64_t k = 0; k < K; ++k) ah[k] *= rescale;
    for (int64_t l = a; l < n; ++l) {
      const float el = e[l];
      const float* __restrict row = vp + l * K;
      for (int64_t k = 0; k < K; ++k) ah[k] += el * row[k];
    }
  }
}

// Prefetches a page's keys and values ([K, L] and [L, K] floats) into L2 while the page before is computed:
// the pages of a block table lie anywhere in the pool, so the hardware prefetcher cannot run ahead to them.
inline void prefetch_page(const float* kp, const float* vp, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) {
    __builtin_prefetch(kp + i, 0, 2);
    __builtin_prefetch(vp + i, 0, 2);
  }
}

// One task: row b, kv head kv, queries [t0, t1).
template <int LT, int KT>
void run_task(const Inputs& in, const Geometry& g, int64_t b, int64_t kv, int64_t t0, int64_t t1) {
  const int64_t L = LT ? LT : g.L, K = KT ? KT : g.K, group = g.group(), tiles = t1 - t0;
  const float neg = -0.5f * 3.0e38f;  // finite: a query that sees nothing keeps m here and d = 0
  // One allocation each per task. A per-thread scratch holding all five (tried) changed outputs by up to 7e-7
  // at pages of 64 (the -ffast-math sums round differently with the buffers placed otherwise), and with them
  // a sampled token of the example job; the allocations cost nothing measurable against a 2-4 ms step.
  std::vector<float> qs(tiles * group * K), acc(tiles * group * K, 0.0f), m(tiles * group, neg), d(tiles * group, 0.0f), s(group * L);
  const float scale = 1.0f / std::sqrt(static_cast<float>(K));
  int32_t last = -1;  // the latest position among the tile's queries
  int64_t lowest = INT64_MAX;  // the earliest position any of the tile's windows reaches
  for (int64_t t = 0; t < tiles; ++t) {
    const float* src = in.q + (((b * g.T + t0 + t) * g.H) + kv * group) * K;
    for (int64_t i = 0; i < group * K; ++i) qs[t * group * K + i] = src[i] * scale;
    last = std::max(last, in.q_pos[b * g.T + t0 + t]);
    lowest = std::min(lowest, static_cast<int64_t>(in.q_pos[b * g.T + t0 + t]) - in.window + 1);
  }
  const int64_t head_pages = (in.layer * g.G + kv) * g.P;
  const int32_t seg_low = in.q_seg[b * g.T + t0], seg_high = in.q_seg[b * g.T + t1 - 1];  // the tile's sequences (a packed row's are in order)
  const auto read = [&](int64_t e) {  // whether the tile reads entry e: its page can matter to one of the queries
    const int32_t first = in.page_pos[b * g.E + e], seg = in.page_seg[b * g.E + e];
    return first <= last && first + L > lowest && std::min(seg_low, seg_high) <= seg && seg <= std::max(seg_low, seg_high);
  };
  for (int64_t e = 0; e < g.E; ++e) {
    const int32_t first = in.page_pos[b * g.E + e], seg = in.page_seg[b * g.E + e];
    if (first > last || first + L <= lowest) continue;  // after every query, or before every window
    const int64_t page = in.tables[b * g.E + e];  // in [0, P): check_pages ran before any task
    const float* kp = in.k_pool + (head_pages + page) * K * L;  // [K, L]
    const float* vp = in.v_pool + (head_pages + page) * L * K;  // [L, K]
    for (int64_t next = e + 1; next < g.E; ++next) {
      if (!read(next)) continue;
      const int64_t ahead = head_pages + in.tables[b * g.E + next];
      prefetch_page(in.k_pool + ahead * K * L, in.v_pool + ahead * L * K, K * L);
      break;
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t qi = b * g.T + t0 + t;
      const int64_t n = std::min<int64_t>(L, static_cast<int64_t>(in.q_pos[qi]) - first + 1);
      const int64_t a = std::max<int64_t>(0, static_cast<int64_t>(in.q_pos[qi]) - in.window + 1 - first);  // first slot in the window
      if (in.q_seg[qi] != seg || n <= a) continue;
      page_scores<LT, KT>(&qs[t * group * K], kp, s.data(), group, g);
      if (in.softcap > 0.0f) cap_scores(s.data(), a, n, group, L, in.softcap);
      page_update<LT, KT>(s.data(), vp, a, n, &m[t * group], &d[t * group], &acc[t * group * K], group, g);
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    float* dst = in.out + (((b * g.T + t0 + t) * g.H) + kv * group) * K;
    for (int64_t h = 0; h < group; ++h) {
      const float inv = d[t * group + h] > 0.0f ? 1.0f / d[t * group + h] : 0.0f;
      for (int64_t k = 0; k < K; ++k) dst[h * K + k] = acc[(t * group + h) * K + k] * inv;
    }
  }
}

template <int LT, int KT>
void run_all(ffi::ThreadPool& pool, const Inputs& in, const Geometry& g) {
  const int64_t tiles = (g.T + kQueryTile - 1) / kQueryTile, tasks = g.B * g.G * tiles;
  jaxinfer::parallel_for(pool, tasks, [&in, &g, tiles](int64_t i) {
    const int64_t tile = i % tiles, kv = (i / tiles) % g.G, b = i / (tiles * g.G);
    run_task<LT, KT>(in, g, b, kv, tile * kQueryTile, std::min(g.T, (tile + 1) * kQueryTile));
  });
}

// Every id of the block tables in [0, P), or an error naming the first one that is not: the pool is
// indexed with these ids, and one out of range would read another layer's pages or outside the pool.
ffi::Error check_pages(const int32_t* tables, const Geometry& g) {
  for (int64_t i = 0; i < g.B * g.E; ++i) {
    const int32_t page = tables[i];
    if (page < 0 || page >= g.P)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "paged_attention_cpu: page id " + std::to_string(page) + " at row " + std::to_string(i / g.E) + ", entry " +
                            std::to_string(i % g.E) + " of block_tables is outside the pool of " + std::to_string(g.P) + " pages");
  }
  return ffi::Error::Success();
}

template <typename A>
bool dims_are(const A& dims, std::initializer_list<int64_t> expected) {
  return dims.size() == expected.size() && std::equal(dims.begin(), dims.end(), expected.begin());
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> page_pos,
                              ffi::Buffer<ffi::S32> page_seg, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_seg,
                              ffi::Buffer<ffi::S32> window, float softcap, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = tables.dimensions();
  if (auto e = jaxinfer::check(qd.size() == 4 && kd.size() == 5 && td.size() == 2, "paged_attention_cpu: q must be [B,T,H,K], k_pool [N,G,P,K,L], tables [B,E]"); e.failure()) return e;
  const Geometry g{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[4], td[1], kd[0]};
  if (auto e = jaxinfer::check(kd[3] == g.K && td[0] == g.B && g.H % g.G == 0, "paged_attention_cpu: head dims, batch or head groups disagree"); e.failure()) return e;
  const bool shapes = dims_are(v_pool.dimensions(), {g.N, g.G, g.P, g.L, g.K}) && dims_are(page_pos.dimensions(), {g.B, g.E}) &&
                      dims_are(page_seg.dimensions(), {g.B, g.E}) && dims_are(q_pos.dimensions(), {g.B, g.T}) && dims_are(q_seg.dimensions(), {g.B, g.T});
  if (auto e = jaxinfer::check(shapes, "paged_attention_cpu: v_pool must be [N,G,P,L,K], page_pos and page_seg [B,E], q_pos and q_seg [B,T]"); e.failure()) return e;
  if (auto e = jaxinfer::check(g.L <= 256, "paged_attention_cpu: page_size above 256"); e.failure()) return e;
  const int64_t index = layer.typed_data()[0];
  if (auto e = jaxinfer::check(0 <= index && index < g.N, "paged_attention_cpu: layer out of range"); e.failure()) return e;
  if (auto e = check_pages(tables.typed_data(), g); e.failure()) return e;
  const int64_t window_size = window.typed_data()[0];
  if (auto e = jaxinfer::check(window_size >= 1, "paged_attention_cpu: the sliding window must be >= 1 token"); e.failure()) return e;
  if (auto e = jaxinfer::check(softcap >= 0.0f && std::isfinite(softcap), "paged_attention_cpu: softcap must be finite and >= 0 (0: none)"); e.failure()) return e;
  const Inputs in{q.typed_data(), k_pool.typed_data(), v_pool.typed_data(), index, tables.typed_data(), page_pos.typed_data(),
                  page_seg.typed_data(), q_pos.typed_data(), q_seg.typed_data(), window_size, softcap, out->typed_data()};
  if (g.L == 64 && g.K == 64) {
    run_all<64, 64>(pool, in, g);
  } else if (g.L == 16 && g.K == 64) {
    run_all<16, 64>(pool, in, g);
  } else if (g.L == 64 && g.K == 128) {
    run_all<64, 128>(pool, in, g);
  } else {
    run_all<0, 0>(pool, in, g);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttentionF32, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("softcap")        // 0: no soft-cap
                                  .Ret<ffi::Buffer<ffi::F32>>());
