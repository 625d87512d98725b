"""Deviceless compilation for an H200 (jaxinfer/engine/aot.py).

The parsing and the pool sizing are checked everywhere. The compiles need the CUDA plugin wheels and
JAX_PLATFORMS=cpu, which `make gpu-aot` provides in .venv-gpu; elsewhere they skip, saying why.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import aot
from jaxinfer.engine import engine as eng, pool_size

PTXAS_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'bound_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for bound_mosaic_gpu_kernel
    0 bytes stack frame, 156 bytes spill stores, 160 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
"""


def test_aliased_parameters_are_read_from_the_module_header():
    header = ("HloModule jit__forward_step, is_scheduled=true, input_output_alias={ {5}: (11, {}, may-alias), "
              "{6}: (12, {}, may-alias), {7, 1}: (13, {}, must-alias) }, entry_computation_layout={(bf16[2]{0})->bf16[2]{0}}\n\nENTRY")
    assert aot.aliased_parameters(header) == (11, 12, 13)
    assert aot.aliased_parameters("HloModule jit_f, entry_computation_layout={(f32[2]{0})->f32[2]{0}}") == ()


def test_kernel_resources_read_ptxas_and_mosaic_reports(tmp_path):
    (tmp_path / "bound_0.ptxas").write_text(PTXAS_REPORT)
    (tmp_path / "bound_0.resources.txt").write_text("Resources(smem_scratch_bytes=168960, tmem_scratch_cols=0)")
    (kernel,) = aot.kernel_resources(tmp_path)
    assert kernel == {"kernel": "bound_0", "arch": "sm_90a", "registers": 255, "spill_store_bytes": 156, "spill_load_bytes": 160,
                      "smem_bytes": 168960}


def test_the_h200_pool_is_sized_by_the_engine_rule():
    # SmolLM2 in bf16: a page holds 30 layers x (K + V) x 3 kv heads x 64 dims x 64 tokens x 2 bytes = 1,474,560 bytes.
    # 0.75 of an H200 less the params holds far more than 32 full contexts of 2,048 tokens: 32 x 32 pages + the null page.
    cfg = aot.model_config("smollm2-135m")
    assert aot.pool_pages(cfg, EngineConfig()) == 32 * 32 + 1
    # On a 4 GiB device the share left after 0.27 GB of params fits fewer, rounded down on the ladder.
    fitted = int((int(4 * 2**30 * 0.75) - 269_030_016) * EngineConfig().kv_memory_fraction) // 1_474_560
    assert aot.pool_pages(cfg, EngineConfig(), memory_bytes=4 * 2**30) == pool_size.pages_on_ladder(fitted) < 1025


def test_the_reason_names_the_plugin_or_the_platform_setting():
    reason = aot.unavailable_reason()
    if reason is not None:
        assert "make gpu-aot" in reason or "JAX_PLATFORMS" in reason


# ------------------------------------------------------------------ compiled for an H200 (needs the plugin)


@pytest.fixture(scope="module")
def h200():
    reason = aot.unavailable_reason()
    if reason is not None:
        pytest.skip(f"deviceless H200 compilation cannot run here: {reason}")
    return aot.topology_mesh()


def test_the_headline_kernel_compiles_for_sm90a_within_the_register_and_smem_limits(h200):
    from kernels_pallas import paged_attention as pa

    b, kv_heads, group, k, page, max_pages = 64, 8, 4, 128, 64, 64
    rep = aot.replicated(h200)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    args = (spec((b, kv_heads * group, k), jnp.bfloat16), spec((kv_heads, b * max_pages + 1, k, page), jnp.bfloat16),
            spec((kv_heads, b * max_pages + 1, page, k), jnp.bfloat16), spec((b, max_pages), jnp.int32), spec((b,), jnp.int32))
    report, compiled = aot.compile_program("kernel", functools.partial(jax.jit(pa.paged_attention).lower, *args), dump_kernels=True)
    assert report.error is None and compiled is not None
    (kernel,) = report.kernels
    assert kernel["arch"] == "sm_90a" and kernel["registers"] <= 255 and kernel["spill_store_bytes"] == 0
    assert kernel["smem_bytes"] <= pa.SMEM_LIMIT_BYTES


def test_the_decode_program_writes_the_donated_pool_in_place_and_a_copy_is_caught(h200):
    cfg = aot.model_config("smollm2-135m")
    engine_cfg = EngineConfig(attention_impl="pallas", compilation_cache_dir=None)
    num_pages = aot.pool_pages(cfg, engine_cfg)
    programs = dict(aot.engine_programs(cfg, engine_cfg, h200, num_pages=num_pages))
    first, count = aot.pool_parameters(cfg, num_pages, engine_cfg)
    report, _ = aot.compile_program("decode", programs["decode[rows=1,tokens=1,pages=1]"])
    assert report.error is None
    assert set(range(first, first + count)) <= set(report.aliased_params)
    assert report.peak_bytes < aot.H200_MEMORY_BYTES
    # The control: the same program without donation aliases nothing, so the check above can fail.
    forward, _ = eng.step_functions(cfg, engine_cfg, "pallas", keep_raw=False)
    args = programs["decode[rows=1,tokens=1,pages=1]"].args
    rep = aot.replicated(h200)
    copy, _ = aot.compile_program("decode, no donation", functools.partial(jax.jit(forward, in_shardings=rep, out_shardings=rep).lower, *args))
    assert copy.error is None and not set(range(first, first + count)) & set(copy.aliased_params)
