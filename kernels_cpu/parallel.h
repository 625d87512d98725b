// Shared by the kernels of kernels_cpu/: run tasks on XLA's intra-op thread pool from an FFI handler.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Runs fn(0 .. total-1) on the calling thread and on the pool's other threads. Tasks are claimed from a
// shared counter; the caller waits for every task to finish, not for every helper to start, so a busy
// pool costs parallelism, never progress. The state is shared so that a helper starting late is safe.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t total;
    std::function<void(int64_t)> fn;
  };
  auto state = std::make_shared<State>();
  state->total = total;
  state->fn = std::move(fn);
  auto worker = [state]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < state->total;) {
      state->fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));  // Schedule takes its task by value
  worker();
  while (state->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

inline xla::ffi::Error check(bool ok, const char* what) {
  return ok ? xla::ffi::Error::Success() : xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, what);
}

}  // namespace jaxinfer
