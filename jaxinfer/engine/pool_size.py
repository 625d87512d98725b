"""How many pages the KV pool gets: as configured, or a share of the device's free memory on a fixed ladder,
so that program shapes do not follow free memory from run to run. The engine sizes its pool here, and the
deviceless GPU compile (aot.py) sizes an H200's."""

import jax

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model import sharding as shd
from jaxinfer.scheduling.runloop import pool_pages


class PoolTooLargeError(ValueError):
    """The requested KV pool does not fit the available memory."""


def available_bytes(device: jax.Device) -> int:
    """Free memory of the device; host MemAvailable for CPU devices."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemFree"])


def pages_on_ladder(fitted: int) -> int:
    """The largest page count <= `fitted` of the form m * 2**e with m in {4, 5, 6, 7}: a pool sized from
    free memory keeps one shape (and so hits the persistent compile cache) while free memory moves by up
    to a fifth, and never gives up more than a fifth of what fits. Counts under 4 stay as they are."""
    if fitted < 4:
        return fitted
    exponent = fitted.bit_length() - 3  # fitted = m * 2**exponent + rest, with 4 <= m < 8
    return (fitted >> exponent) << exponent


def resolve_num_pages(cfg: ModelConfig, engine_cfg: EngineConfig, device: jax.Device, *, mesh=None) -> int:
    """Pages of the pool: as configured, or a share of free memory rounded down to a fixed ladder (so
    program shapes do not follow free memory from run to run); fails if it cannot fit.

    On a mesh, a page costs each device its share (all of it when kv heads are replicated); simulated
    CPU devices share the host's memory, so there a page costs that share on every device."""
    page_bytes = kvp.pool_bytes(cfg, 1, engine_cfg.page_size, engine_cfg.kv_cache_dtype)
    if mesh is not None:
        size = shd.mesh_size(mesh)
        page_bytes = -(-page_bytes // shd.kv_shards(cfg, size)) * (size if device.platform == "cpu" else 1)
    free = available_bytes(device)
    num_pages = num_pages_for(engine_cfg, free, page_bytes)
    needed = num_pages * page_bytes
    if num_pages < 2 or needed > free:
        raise PoolTooLargeError(
            f"KV pool ({engine_cfg.kv_cache_dtype or cfg.dtype}{', scales included' if engine_cfg.kv_cache_dtype else ''}) of {num_pages} pages x {page_bytes} bytes needs {needed} bytes "
            f"({needed / 2**30:.2f} GiB); {free} bytes ({free / 2**30:.2f} GiB) are available on {device}"
        )
    return num_pages


def num_pages_for(engine_cfg: EngineConfig, free: int, page_bytes: int) -> int:
    """The pool's pages given `free` bytes: as configured, else enough for max_num_seqs full contexts where
    kv_memory_fraction of free memory holds them, else what fits on the ladder (`pages_on_ladder`)."""
    if engine_cfg.num_pages is not None:
        return engine_cfg.num_pages
    wanted = pool_pages(engine_cfg)  # max_num_seqs full contexts and the null page
    fitted = int(free * engine_cfg.kv_memory_fraction) // page_bytes
    return wanted if fitted >= wanted else pages_on_ladder(fitted)
