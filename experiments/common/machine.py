"""The machine a result was measured on: its measured matmul and read-bandwidth peaks, and the
"machine" block every result JSON carries (commit, platform, CPU model and flags, device, load, peak
RSS). numpy at import; jax only inside the measurements and where the caller already imported it.

The CPU model and flags come from /proc/cpuinfo through `cpu_info`, the experiments' one reader. The
library's `jaxinfer.engine.tuning.machine_fingerprint` reads the same file, but inline and only on the
CPU backend (on a GPU it reports the device instead), so it has no reader to reuse here.
"""

import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys

import numpy as np

from common.paths import REPO_ROOT
from common.timing import load_average, peak_rss_bytes, time_calls

MATMUL_SIZE = 2048  # the matmul peak is an f32 [n, n] @ [n, n] matmul
BANDWIDTH_BYTES = 512 * 2**20  # the read-bandwidth probe sums an f32 array of this size


def measure_matmul_peak(repeats: int) -> dict:
    """f32 matmul FLOP/s of this machine: best and median of `repeats` timed runs after 2 untimed."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    times = time_calls(lambda: matmul(a, b).block_until_ready(), repeats, warmup=2)
    flops = 2 * MATMUL_SIZE**3
    return {"size": MATMUL_SIZE, "best_flops_per_s": flops / min(times), "median_flops_per_s": flops / statistics.median(times)}


def measure_bandwidth_peak(repeats: int, num_bytes: int = BANDWIDTH_BYTES, warmup: int = 2) -> dict:
    """Read bandwidth: bytes/s of the faster of two full reads of an f32 array of `num_bytes`, a jitted
    sum and numpy sums of one slice per usable core on threads (numpy drops the GIL): XLA:CPU's reduction
    alone left a kernel's decode step reading at 111% of it (bench_1b, Q8_0, 2026-12-04)."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    probes = {"xla_sum": time_calls(lambda: total(x).block_until_ready(), repeats, warmup=warmup)}
    host = np.ones((num_bytes // 4,), np.float32)
    slices = np.array_split(host, len(os.sched_getaffinity(0)))
    with concurrent.futures.ThreadPoolExecutor(len(slices)) as pool:
        probes["numpy_threads"] = time_calls(lambda: list(pool.map(np.sum, slices)), repeats, warmup=warmup)
    best = min(probes, key=lambda name: min(probes[name]))
    return {"bytes": num_bytes, "probe": best, "best_bytes_per_s": num_bytes / min(probes[best]),
            "median_bytes_per_s": num_bytes / statistics.median(probes[best]),
            "best_bytes_per_s_by_probe": {name: num_bytes / min(times) for name, times in probes.items()}}


def measure_peaks(repeats: int) -> dict:
    """The matmul and read-bandwidth peaks, and their balance (FLOP per byte)."""
    peaks = {"matmul": measure_matmul_peak(repeats), "bandwidth": measure_bandwidth_peak(repeats)}
    return peaks | {"flops_per_byte": peaks["matmul"]["best_flops_per_s"] / peaks["bandwidth"]["best_bytes_per_s"]}


def _git(*command: str) -> str | None:
    try:
        completed = subprocess.run(["git", *command], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return None
    return completed.stdout.rstrip() if completed.returncode == 0 else None  # porcelain lines may start with a space


_COMMIT_AT_START = _git("rev-parse", "HEAD")


def cpu_info() -> dict:
    """Model name and feature flags of the first CPU (/proc/cpuinfo), the core count and usable cores."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"model": fields.get("model name") or platform.processor() or None, "flags": fields.get("flags"),
            "count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))}


def device_info() -> dict:
    """JAX's backend and devices, and the first device's peak bytes in use where it reports them. Only
    in a process that has imported jax (a parent that only spawns workers stays without it)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return {"backend": None, "note": "jax not imported in this process", "jax_platforms_env": os.environ.get("JAX_PLATFORMS")}
    devices = jax.devices()
    stats = (devices[0].memory_stats() or {}) if devices and hasattr(devices[0], "memory_stats") else {}
    return {"backend": jax.default_backend(), "kind": devices[0].device_kind if devices else None, "count": len(devices),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(peaks: dict | None = None) -> dict:
    """The block every result JSON carries: commit (and uncommitted source files), platform, CPU model and
    flags, device, load average, and peak figures: this process's VmHWM and the measured `peaks`. The
    commit is read when the JSON is written; `commit_at_start`, when the script started (the code it ran,
    if a commit landed while a long benchmark was running)."""
    dirty = _git("status", "--porcelain", "--", "jaxinfer", "kernels_cpu", "kernels_pallas")
    return {"commit": _git("rev-parse", "HEAD"), "commit_at_start": _COMMIT_AT_START, "uncommitted_source_files": None if dirty is None else dirty.splitlines(),
            "platform": platform.platform(), "python": platform.python_version(), "jax": _version("jax"), "cpu": cpu_info(), "device": device_info(),
            "load_average": load_average(), "peak_rss_bytes": peak_rss_bytes(), "peaks": peaks or {}}
