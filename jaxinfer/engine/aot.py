"""Compile GPU programs for an H200 on a machine without one (deviceless ahead-of-time compilation).

jax compiles for a GPU it does not have through a topology description: the CUDA plugin's PJRT topology
built from a `GpuTargetConfigProto` text (compute capability, SMs, shared memory, memory size and bandwidth),
whose compile-only devices form a mesh that `jit(...).lower(...).compile()` targets. XLA's GPU passes run, and
so do the Mosaic GPU compiler and ptxas for every Pallas kernel in the program (sm_90a), exactly as they would
at warm-up on the device. Nothing runs. The serialized executables load on a real H200 with the same jax.

Needs the CUDA plugin wheels of the pinned jax (`pip install -e '.[cuda13]'`, which `make gpu-aot` does in
.venv-gpu), and JAX_PLATFORMS=cpu: the plugin then registers its topology without looking for a driver.
`topology_mesh` says clearly why it cannot work where it cannot.

Used by experiments/gpu_aot.py (the report) and tests/engine/test_gpu_aot.py.
"""

import dataclasses
import functools
import importlib.util
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig, from_hf_config
from jaxinfer.engine import engine as eng, pool_size
from jaxinfer.engine.backends import resolve_impl
from jaxinfer import geometries
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model import params as mp

# An H200 SXM (141 GB HBM3e), from NVIDIA's published figures: sm_90, 132 SMs, 228 KiB of shared memory per
# SM (227 KiB opt-in per block), 64K registers per SM, 50 MiB of L2, 4.8 TB/s. Written for jaxinfer.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 patch: 0 }
device_description_str: "NVIDIA H200"
"""
H200_MEMORY_BYTES = 150_754_820_096  # device_memory_size above (140.4 GiB)
XLA_MEMORY_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default: what jax preallocates on a GPU

# The geometries compiled (weights are never needed: shapes only).
GEOMETRIES = {"smollm2-135m": geometries.SMOLLM2_135M, "llama3.2-1b": geometries.LLAMA_3_2_1B}


class AotUnavailable(RuntimeError):
    """Deviceless GPU compilation cannot run in this environment (the message says why and what to do)."""


def unavailable_reason() -> str | None:
    """Why `topology_mesh` cannot work here, or None if it should."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        return ("the CUDA plugin for jax is not installed (jax-cuda13-plugin and jax-cuda13-pjrt 0.11.2); "
                "`make gpu-aot` installs them in .venv-gpu (pip install -e '.[gpu-aot]')")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "cpu" not in platforms.split(",") and not os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        return ("JAX_PLATFORMS must name cpu (e.g. JAX_PLATFORMS=cpu) before jax starts: without a GPU, the plugin's start-up "
                "check of the CUDA driver fails and the plugin never registers its topology")
    return None


@functools.cache
def topology_mesh(target_config: str = H200_TARGET_CONFIG) -> jax.sharding.Mesh:
    """A one-device mesh of the compile-only GPU that `target_config` describes."""
    from jax.experimental import topologies  # noqa: PLC0415  (jax's AOT API, needed here only)

    if (reason := unavailable_reason()) is not None:
        raise AotUnavailable(reason)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config, topology="1x1x1")
    except NotImplementedError as e:
        raise AotUnavailable(f"the CUDA plugin registered no topology ({e}); see the plugin's start-up error above") from e
    return topologies.make_mesh(topology, (1,), ("device",))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


# ------------------------------------------------------------------ what a compiled program reports


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program: what it is, how long it took, and its memory as the compiler planned it."""

    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated inputs
    temp_bytes: int
    generated_code_bytes: int
    aliased_params: tuple[int, ...] = ()  # entry parameters the executable aliases to an output
    kernels: tuple[dict, ...] = ()  # per Mosaic GPU kernel: registers, spills, shared memory (ptxas and Mosaic)
    error: str | None = None

    @property
    def peak_bytes(self) -> int:
        """Device bytes while it runs: arguments, outputs not written in place, temporaries and code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.generated_code_bytes

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"peak_bytes": self.peak_bytes}


def aliased_parameters(hlo_text: str) -> tuple[int, ...]:
    """Entry parameter numbers that the compiled module's input_output_alias maps to an output."""
    header = hlo_text.split("\n", 1)[0]  # input_output_alias={ {5}: (11, {}, may-alias), ... }
    return tuple(sorted({int(p) for p in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", header)}))


def compile_program(name: str, lowered_fn, *, dump_kernels: bool = False) -> tuple[ProgramReport, jax.stages.Compiled | None]:
    """Compile `lowered_fn()` (a jax.stages.Lowered) and report it; a compiler error is reported, not raised.
    `dump_kernels`: read each Mosaic GPU kernel's registers and shared memory from Mosaic's dumps (their folder is
    a process-wide environment setting, so never from two threads at once)."""
    with tempfile.TemporaryDirectory(prefix="mosaic-dump-") as dump:
        env = {"MOSAIC_GPU_DUMP_TO": dump, "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_RESOURCES": "1"} if dump_kernels else {}
        start = time.perf_counter()
        try:
            with _environment(env):
                compiled = lowered_fn().compile()
        except Exception as e:  # the compiler's message is the finding
            return ProgramReport(name, time.perf_counter() - start, 0, 0, 0, 0, 0, error=f"{type(e).__name__}: {str(e)[:2000]}"), None
        seconds = time.perf_counter() - start
        kernels = kernel_resources(Path(dump))
    stats = compiled.memory_analysis()
    report = ProgramReport(
        name, seconds, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.alias_size_in_bytes, stats.temp_size_in_bytes,
        stats.generated_code_size_in_bytes, aliased_parameters(compiled.as_text() or ""), kernels,
    )
    return report, compiled


class _environment:
    """Set environment variables for a block (Mosaic GPU reads its dump settings when it compiles)."""

    def __init__(self, values: dict[str, str]):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def kernel_resources(dump: Path) -> tuple[dict, ...]:
    """Registers, spills and shared memory of each Mosaic GPU kernel compiled, from ptxas's report and Mosaic's
    resource summary in `dump` (one pair of files per kernel)."""
    kernels = []
    for ptxas in sorted(dump.glob("*.ptxas")):
        text = ptxas.read_text()
        entry = {"kernel": ptxas.stem, "arch": _first(r"for '(sm_\w+)'", text)}
        entry["registers"] = _int(r"Used (\d+) registers", text)
        entry["spill_store_bytes"] = _int(r"(\d+) bytes spill stores", text)
        entry["spill_load_bytes"] = _int(r"(\d+) bytes spill loads", text)
        resources = ptxas.with_suffix(".resources.txt")
        if resources.exists():
            entry["smem_bytes"] = _int(r"smem_scratch_bytes=(\d+)", resources.read_text())
        kernels.append(entry)
    return tuple(kernels)


def _first(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None


def _int(pattern: str, text: str) -> int | None:
    value = _first(pattern, text)
    return None if value is None else int(value)


# ------------------------------------------------------------------ the engine's programs


def model_config(geometry: str, *, max_context: int = 2048) -> ModelConfig:
    """A GEOMETRIES model in bf16, its context capped at `max_context`."""
    return from_hf_config(GEOMETRIES[geometry], dtype="bfloat16", max_context=max_context)


def pool_pages(cfg: ModelConfig, engine_cfg: EngineConfig, *, memory_bytes: int = H200_MEMORY_BYTES) -> int:
    """The pages the engine would give its pool on a device of `memory_bytes`: jax preallocates
    XLA_MEMORY_FRACTION of it, the params take their share, and the engine's own rule sizes the pool from the rest."""
    params_bytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(mp.abstract(cfg)))
    free = int(memory_bytes * XLA_MEMORY_FRACTION) - params_bytes
    page_bytes = kvp.pool_bytes(cfg, 1, engine_cfg.page_size, engine_cfg.kv_cache_dtype)
    return pool_size.num_pages_for(engine_cfg, free, page_bytes)


def engine_programs(cfg: ModelConfig, engine_cfg: EngineConfig, mesh: jax.sharding.Mesh, *, num_pages: int) -> list[tuple[str, object]]:
    """(name, lower) for every program the engine compiles at warm-up, as Engine builds them (step_functions,
    program_keys, the donated pool and history), over abstract params and pool on `mesh`'s device."""
    impl = resolve_impl(engine_cfg.attention_impl, deterministic=engine_cfg.deterministic, dtype=cfg.dtype, kv_cache_dtype=engine_cfg.kv_cache_dtype,
                        page_size=engine_cfg.page_size, head_dim=cfg.head_dim, group_size=cfg.num_heads // cfg.num_kv_heads)
    keep_raw = engine_cfg.logprobs_mode == "raw"
    forward, draw = eng.step_functions(cfg, engine_cfg, impl, keep_raw=keep_raw)
    rep = replicated(mesh)
    on_device = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tree)  # noqa: E731
    params = on_device(mp.abstract(cfg))
    pool = on_device(jax.eval_shape(functools.partial(kvp.init_pool, cfg, num_pages, engine_cfg.page_size, engine_cfg.kv_cache_dtype)))
    history = jax.ShapeDtypeStruct((num_pages, engine_cfg.page_size), jnp.int32, sharding=rep)
    jitted = jax.jit(forward, in_shardings=rep, out_shardings=rep, donate_argnames=("pool", "history"))
    jitted_draw = jax.jit(draw, in_shardings=rep, out_shardings=rep)
    programs = []
    for key in eng.program_keys(engine_cfg):
        if isinstance(key, int):
            inputs = eng.abstract_draw_inputs(key, engine_cfg, cfg.vocab_size, keep_raw=keep_raw)
            programs.append((f"draw[{key}]", functools.partial(jitted_draw.lower, *inputs)))
        else:
            inputs = eng.abstract_step_inputs(key, engine_cfg, cfg.vocab_size)
            programs.append((f"{key.phase}[rows={key.num_rows},tokens={key.num_tokens},pages={key.num_pages}]",
                             functools.partial(jitted.lower, params, pool, history, inputs)))
    return programs


def pool_parameters(cfg: ModelConfig, num_pages: int, engine_cfg: EngineConfig) -> tuple[int, int]:
    """(first, count): the entry parameters of a forward program that are the pool's arrays (they follow the params)."""
    first = len(jax.tree.leaves(mp.abstract(cfg)))
    pool = jax.eval_shape(functools.partial(kvp.init_pool, cfg, num_pages, engine_cfg.page_size, engine_cfg.kv_cache_dtype))
    return first, len(jax.tree.leaves(pool)) + 1  # the pool's arrays, then the token history (donated too)
