"""Handing freed host memory back to the system. Host only, no jax.

XLA:CPU's buffers and its compiler's working memory come from the C heap (glibc malloc). Freed pages stay
resident until the heap is trimmed, so every compile and every first run of a program would otherwise leave
its transients under the next one's peak. Warming up a Llama-3.2-1B-shaped Q4_K_M's 50 programs (2 compile
threads, then 2 timed runs each) raised the peak RSS by 0.71 GiB untrimmed and by 0.50 GiB with the heap
trimmed after each program; the load, the tuner's stages and warm-up's programs each trim (Engine.warmup,
Engine.time_programs). Served steps do not trim: on a Llama-3.2-1B-shaped Q4_K_M (bench_kquant's engine config) the
RSS rises ~0.09 GiB over the post-warm-up level in the first ~15 steps and stays flat; a trim after the run gives it
back, but it is the steps' own working memory (XLA's per-run temporaries), which the next step takes again, and a
trim costs ~20 ms (loaded 2-core machine): trimming after each program's first run left the run's peak unchanged
(2714 -> 2715 MiB).
"""

import ctypes
import gc
import functools


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc `malloc_trim`; a no-op elsewhere). Cheap: no
    garbage collection."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def release_freed_memory() -> None:
    """Collect garbage (a freed engine's or reference's arrays), then trim the heap: what the tuner and the
    loader call between stages (Llama-3.2-1B Q4_K_M: 0.1 GB after the load, 0.3 GB after a candidate's engine)."""
    gc.collect()
    trim_heap()
