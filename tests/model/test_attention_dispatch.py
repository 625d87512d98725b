"""attention.py's back ends against each other: the Pallas decode kernel (GPU interpreter on CPU) and
the jnp reference inside the real model forward over the paged pool, and so is the CPU kernel; the impl rule (`resolve_impl`) and
deterministic mode's dispatch (kernel in decode, blockwise jnp in prefill); and the two jnp references,
the engine's `attention_over_pages` and the kernel's `paged_attention_reference`, on the same paged pools."""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from beartype import beartype
from jaxtyping import jaxtyped

from jaxinfer.model import sharding
from jaxinfer.model import kv_pool as kvp
from jaxinfer.engine.backends import resolve_impl
from jaxinfer.model.attention import DETERMINISTIC_IMPL, DETERMINISTIC_PALLAS_IMPL, attention_over_pages
from jaxinfer.config import ModelConfig
from jaxinfer.model.forward import forward
from jaxinfer.model.panels import pack_panels
from jaxinfer.model.params import init_random
from kernel_interpret import gpu_interpreter, races_found
from kernels_cpu import layer_matmul as cpu_layer_matmul
from kernels_cpu import paged_attention as cpu_kernel
from kernels_pallas.paged_attention import paged_attention_reference
from tolerances import KERNEL_BF16, KERNEL_F32, assert_close

PAGE = 64
# SmolLM2's attention geometry (9 query heads over 3 kv heads, head_dim 64), two layers, bf16.
CFG = ModelConfig(vocab_size=256, num_layers=2, embed_dim=192, ffn_dim=256, num_heads=9, num_kv_heads=3, head_dim=64, dtype="bfloat16", max_context=256)


def prefill_then_decode(impl: str, params, prompt_lengths, prefill_impl: str = "reference", cfg: ModelConfig = CFG):
    """Prefill two sequences with `prefill_impl`, then one decode step with `impl`."""
    pool = kvp.init_pool(cfg, 8, PAGE)
    tables = np.array([[3, 5, 0, 0], [6, 1, 2, 0]], np.int32)  # shuffled pages, null-padded
    rng = np.random.default_rng(0)
    for row, length in enumerate(prompt_lengths):
        positions = np.arange(length, dtype=np.int32)[None]
        meta = kvp.PageMeta(tables[row : row + 1], tables[row][positions // PAGE], positions % PAGE)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, length)), jnp.int32)
        _, pool = forward(params, pool, tokens, jnp.asarray(positions), cfg=cfg, pages=meta, attention_impl=prefill_impl)
    positions = np.array([[n] for n in prompt_lengths], np.int32)
    meta = kvp.PageMeta(tables, np.take_along_axis(tables, positions // PAGE, 1), positions % PAGE)
    logits, _ = forward(params, pool, jnp.array([[7], [9]], jnp.int32), jnp.asarray(positions), cfg=cfg, pages=meta, attention_impl=impl)
    return np.asarray(logits[:, 0], np.float32)


@pytest.mark.slow
def test_pallas_decode_matches_reference_inside_model_forward():
    params = init_random(jax.random.key(0), CFG, scale=0.3)
    reference = prefill_then_decode("reference", params, (70, 129))
    with gpu_interpreter() as interpret:
        with jax.sharding.use_abstract_mesh(_h100_mesh()), _force_interpret(interpret):
            kernel = prefill_then_decode("pallas", params, (70, 129))
        assert not races_found()
    assert_close(kernel, reference, KERNEL_BF16, "pallas vs reference decode logits")


@pytest.mark.usefixtures("cpu_kernels")  # skipped without a compiler; under CI=true, failed
def test_cpu_kernel_matches_reference_inside_model_forward():
    """Chunked prefill across pages and a decode step, both through the CPU kernels (attention, and the
    layer matmuls over the packed weights), against the jnp path."""
    cfg = dataclasses.replace(CFG, dtype="float32")
    params = init_random(jax.random.key(0), cfg, scale=0.3)
    reference = prefill_then_decode("reference", params, (70, 129), cfg=cfg)
    kernel = prefill_then_decode("cpu", pack_panels(params), (70, 129), prefill_impl="cpu", cfg=cfg)  # as the Engine packs them
    assert_close(kernel, reference, KERNEL_F32, "cpu kernel vs reference logits")


def test_resolve_impl_on_a_cpu_picks_the_cpu_kernel_only_where_it_can_run(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(cpu_kernel, "available", lambda: True)
    monkeypatch.setattr(cpu_layer_matmul, "available", lambda: True)
    assert resolve_impl("auto", dtype="float32") == "cpu"
    assert resolve_impl("auto", dtype="float32", deterministic=True) == DETERMINISTIC_IMPL
    for kwargs in (dict(dtype="bfloat16"), dict(dtype="float32", kv_cache_dtype="int8"), dict(dtype="float32", tensor_parallel=2)):
        assert resolve_impl("auto", **kwargs) == "reference", kwargs
    with pytest.raises(ValueError, match="needs a float32 model"):
        resolve_impl("cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        resolve_impl("cpu", dtype="float32", kv_cache_dtype="int8")
    monkeypatch.setattr(cpu_layer_matmul, "available", lambda: False)  # either kernel missing: no CPU kernels
    assert resolve_impl("auto", dtype="float32") == "reference"
    monkeypatch.setattr(cpu_layer_matmul, "available", lambda: True)
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    assert resolve_impl("auto", dtype="float32") == "reference"
    with pytest.raises(ValueError, match="could not be built"):
        resolve_impl("cpu", dtype="float32")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="CPU backend only"):
        resolve_impl("cpu", dtype="float32")


def test_missing_cpu_kernels_skip_the_tests_that_need_them_but_fail_them_under_ci(monkeypatch):
    from conftest import require_cpu_kernels

    monkeypatch.setattr(cpu_layer_matmul, "available", lambda: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="could not be built"):
        require_cpu_kernels()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: .*layer_matmul.* could not be built"):
        require_cpu_kernels()
    monkeypatch.setattr(cpu_layer_matmul, "available", lambda: True)
    monkeypatch.setattr(cpu_kernel, "available", lambda: True)
    require_cpu_kernels()  # both built: the test runs, in CI too


def test_explicit_pallas_refuses_float32():
    cfg = dataclasses.replace(CFG, dtype="float32")
    params = init_random(jax.random.key(0), cfg)
    pool = kvp.init_pool(cfg, 4, PAGE)
    meta = kvp.PageMeta(jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        forward(params, pool, jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cfg=cfg, pages=meta, attention_impl="pallas")


GEOMETRY = dict(page_size=PAGE, head_dim=CFG.head_dim, group_size=3)  # CFG's, on pages the kernel serves


def test_resolve_impl_picks_the_kernel_for_16_bit_on_a_gpu_in_both_modes_where_it_serves_the_geometry(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    expected = {  # (attention_impl, dtype, page_size) -> (normal mode, deterministic mode)
        ("auto", "bfloat16", PAGE): ("pallas", DETERMINISTIC_PALLAS_IMPL),
        ("auto", "bfloat16", 16): ("reference", DETERMINISTIC_IMPL),  # the kernel takes pages of 64 or 128
        ("auto", "float32", PAGE): ("reference", DETERMINISTIC_IMPL),
        ("pallas", "float16", PAGE): ("pallas", DETERMINISTIC_PALLAS_IMPL),
        ("reference", "bfloat16", PAGE): ("reference", DETERMINISTIC_IMPL),
        ("reference", "bfloat16", 16): ("reference", DETERMINISTIC_IMPL),
    }
    for (impl, dtype, page_size), modes in expected.items():
        geometry = GEOMETRY | dict(page_size=page_size)
        assert tuple(resolve_impl(impl, deterministic=d, dtype=dtype, **geometry) for d in (False, True)) == modes, (impl, dtype, page_size)
    for geometry in (dict(head_dim=96), dict(group_size=65)):  # the kernel's other limits: head_dim, wgmma rows
        assert resolve_impl("auto", dtype="bfloat16", **(GEOMETRY | geometry)) == "reference", geometry
    assert resolve_impl("auto", dtype="bfloat16", kv_cache_dtype="int8", **GEOMETRY) == "pallas"  # codes are served
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_impl("auto", deterministic=True, dtype="bfloat16", **GEOMETRY) == DETERMINISTIC_IMPL


@pytest.mark.parametrize(("geometry", "reason"), [
    (dict(page_size=16), "page_size=16"), (dict(head_dim=96), "head_dim=96"), (dict(group_size=65), "group_size=65"),
])
def test_explicit_pallas_fails_at_config_time_naming_what_the_kernel_does_not_serve(monkeypatch, geometry, reason):
    for backend in ("gpu", "cpu"):  # the rule is the kernel's geometry, whatever the backend (the interpreter runs on a CPU)
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        for deterministic in (False, True):
            with pytest.raises(ValueError, match=f"attention_impl='pallas'.*{reason}"):
                resolve_impl("pallas", deterministic=deterministic, dtype="bfloat16", **(GEOMETRY | geometry))
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        resolve_impl("pallas", dtype="float32", **GEOMETRY)
    with pytest.raises(ValueError, match="needs page_size and head_dim"):  # the kernel cannot be asked without them
        resolve_impl("pallas", dtype="bfloat16")


def test_engine_with_explicit_pallas_on_pages_of_16_fails_when_built():
    """At construction (resolve_impl is its first step), not at warm-up's first kernel trace."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import Engine

    params = init_random(jax.random.key(0), CFG)
    engine_cfg = EngineConfig(page_size=16, max_context=128, num_pages=9, attention_impl="pallas", compilation_cache_dir=None)
    with pytest.raises(ValueError, match="page_size=16"):
        Engine(CFG, params, engine_cfg)


def test_deterministic_pallas_sends_decode_to_the_fixed_split_kernel_and_keeps_prefill_blockwise(monkeypatch):
    """The kernel replaced by a spy that runs its reference: prefill (T > 1) never calls it, decode calls
    it once per traced layer scan with the deterministic config, and the logits match the jnp-only
    deterministic path."""
    from kernels_pallas import paged_attention as pa

    calls = []

    def spy(q, k_pages, v_pages, block_tables, lengths, *, layer=None, config=None):
        calls.append((q.shape, config))
        return pa.paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, layer=layer)

    params = init_random(jax.random.key(0), CFG, scale=0.3)
    jnp_only = prefill_then_decode(DETERMINISTIC_IMPL, params, (70, 129), prefill_impl=DETERMINISTIC_IMPL)
    monkeypatch.setattr(pa, "paged_attention", spy)
    with_kernel = prefill_then_decode(DETERMINISTIC_PALLAS_IMPL, params, (70, 129), prefill_impl=DETERMINISTIC_PALLAS_IMPL)
    assert calls == [((2, CFG.num_heads, CFG.head_dim), pa.deterministic_config(CFG.head_dim, PAGE, 3))]
    assert_close(with_kernel, jnp_only, KERNEL_BF16, "deterministic decode: kernel (its reference) vs blockwise jnp")


# ---------------------------------------------------------------- the kernel reads the pool in place

def _lowered_decode_step(cfg: ModelConfig = CFG, mesh=None, num_pages: int = 9, batch: int = 4, max_pages: int = 4) -> tuple[str, kvp.KVPool]:
    """The StableHLO text of one decode step of the engine's model forward (pallas, pool donated) lowered
    for CUDA on abstract shapes, under `mesh` if given (an abstract one: no devices needed), and the
    abstract pool."""
    from jax import export

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_random(jax.random.key(0), cfg))
    pool = jax.eval_shape(lambda: kvp.init_pool(cfg, num_pages, PAGE))
    rows = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    meta = kvp.PageMeta(jax.ShapeDtypeStruct((batch, max_pages), jnp.int32), rows, rows)

    def decode(params, pool, tokens, positions, pages):
        return forward(params, pool, tokens, positions, cfg=cfg, pages=pages, attention_impl="pallas")

    with contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(jax.jit(decode, donate_argnames=("pool",)), platforms=("cuda",), disabled_checks=[
            export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(params, pool, rows, rows, meta)
    return exported.mlir_module(), pool


def _pool_copies(module: str, pool: kvp.KVPool, num_shards: int = 1) -> list[str]:
    """What in the lowered module shows a copy of a layer of the pool on its way to the kernel: any value of
    one layer's shape ([G, P, K, L] or [1, G, P, K, L], made by a dynamic_slice, a reshape or a copy; whole
    or one device's G / num_shards heads), or a kernel call (custom_call @mosaic_gpu_v2) whose operands are
    not the whole pools k and v (each device's [N, G / num_shards, P, ...] under a head-split mesh)."""
    element = {"bfloat16": "bf16", "float16": "f16"}[pool.k.dtype.name]

    def mlir_type(shape):
        return f"tensor<{'x'.join(map(str, shape))}x{element}>"

    def local(shape):  # one device's share: the kv-head axis (1) split num_shards ways
        return (shape[0], shape[1] // num_shards, *shape[2:])

    shapes = {x.shape for x in (pool.k, pool.v)} | {local(x.shape) for x in (pool.k, pool.v)}
    layer_types = {mlir_type(shape[1:]) for shape in shapes} | {mlir_type((1, *shape[1:])) for shape in shapes}
    problems = [f"a value of one layer's shape {t}" for t in sorted(layer_types) if t in module]
    calls = [line for line in module.splitlines() if "stablehlo.custom_call @mosaic_gpu_v2" in line]
    if not calls:
        problems.append("no kernel call")
    whole = {mlir_type(local(pool.k.shape)), mlir_type(local(pool.v.shape))}
    for call in calls:
        operands = re.findall(r"\}\s*:\s*\(([^()]*)\)\s*->", call)[-1].split(", ")
        if sum(operand in whole for operand in operands) != 2:  # k and v
            problems.append(f"a kernel call on {operands}, not on the whole pools {sorted(whole)}")
    return problems


def _slicing_kernel(monkeypatch):
    """The control: the kernel called through the slicing interface (`pool.k[layer]`, one layer's pages,
    no layer index), which the checks must catch."""
    from kernels_pallas import paged_attention as pa

    real = pa.paged_attention

    def sliced(q, k_pages, v_pages, block_tables, lengths, *, layer=None, k_scales=None, v_scales=None, **knobs):
        pick = lambda x: None if x is None else x[layer]  # noqa: E731
        return real(q, pick(k_pages), pick(v_pages), block_tables, lengths, k_scales=pick(k_scales), v_scales=pick(v_scales), **knobs)

    monkeypatch.setattr(pa, "paged_attention", sliced)


# name -> (config, mesh size or None, kv-head shards per device): SmolLM2's 3 kv heads do not divide 2 devices
# (replicated: each device reads the whole pool); 2 kv heads do (each device reads its own head of every layer).
NO_COPY_CASES = {
    "one_device": (CFG, None, 1),
    "kv_heads_replicated_over_2": (CFG, 2, 1),
    "kv_heads_split_over_2": (dataclasses.replace(CFG, num_heads=8, num_kv_heads=2), 2, 2),
}


@pytest.mark.parametrize("name", list(NO_COPY_CASES))
def test_lowered_decode_step_passes_the_whole_pool_to_the_kernel_with_no_copy_of_a_layer(monkeypatch, name):
    """The kernel gets the pool [N, G, P, ...] and the layer index and reads the layer's pages in place, so
    the CUDA lowering of a decode step holds no [G, P, ...] slice of it (XLA may copy a dynamic slice fed to a
    custom call every layer of every step); under tensor parallelism (a 2-device mesh, sharding.on_local_heads'
    shard_map) each device's call gets its whole share of the pool. The control lowers the slicing interface
    (`pool.k[layer]`, one layer's pages) and must be caught."""
    cfg, size, num_shards = NO_COPY_CASES[name]
    mesh = None if size is None else _h100_mesh(size)
    module, pool = _lowered_decode_step(cfg, mesh)
    assert _pool_copies(module, pool, num_shards) == []
    _slicing_kernel(monkeypatch)
    sliced, _ = _lowered_decode_step(cfg, mesh)
    problems = _pool_copies(sliced, pool, num_shards)
    assert any("one layer's shape" in p for p in problems) and any("not on the whole pools" in p for p in problems), problems


def _h100_mesh(size: int | None = None):
    """An abstract H100 mesh: no axes, or a `size`-device `model` axis in Auto mode (as sharding.make_mesh's)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=8)
    if size is None:
        return AbstractMesh((), (), abstract_device=device)
    return AbstractMesh((size,), (sharding.MODEL_AXIS,), axis_types=(AxisType.Auto,), abstract_device=device)


def _force_interpret(params):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.force_gpu_interpret_mode(params)


# ---------------------------------------------------------------- the engine's path == the kernel's reference

GARBAGE = 1e30  # large but finite: NaN or inf past the length would break attention_over_pages (0 * inf)
TABLE_WIDTH = 4  # pages per block table (M)


def _awkward_lengths(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1, TABLE_WIDTH * page_size]


def _random_paged_pools(lengths, page_size, num_kv_heads, head_dim, seed=0):
    """f32 pools with distinct, shuffled pages per sequence, null-padded tables, and GARBAGE (of random
    sign) in every slot past each length: the unfilled part of the last page, the unused pages and the
    null page."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + TABLE_WIDTH * len(lengths)
    shuffled = rng.permutation(np.arange(1, num_pages, dtype=np.int32)).reshape(len(lengths), TABLE_WIDTH)
    needed = np.arange(TABLE_WIDTH)[None, :] < -(-np.asarray(lengths)[:, None] // page_size)
    tables = np.where(needed, shuffled, 0).astype(np.int32)
    k_pool = rng.standard_normal((num_kv_heads, num_pages, head_dim, page_size)).astype(np.float32)
    v_pool = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    valid = np.zeros((num_pages, page_size), bool)  # slot (page, offset) holds a token below its length
    for table, length in zip(tables, lengths):
        slots = np.arange(length)
        valid[table[slots // page_size], slots % page_size] = True
    sign = rng.choice(np.float32([-GARBAGE, GARBAGE]), (num_pages, page_size))
    k_pool = np.where(valid[None, :, None, :], k_pool, sign[None, :, None, :])
    v_pool = np.where(valid[None, :, :, None], v_pool, sign[None, :, :, None])
    return jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(tables), valid


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_attention_over_pages_matches_kernel_reference_in_decode(page_size, group_size):
    """The engine's CPU path (gather_pages, then attention_over_pages, masking slot <= position) and the
    kernel's reference (masking slot < length and zeroing V there) agree for one decode token per
    sequence at position length - 1. Lengths are >= 1: a padding row (length 0) is zeros in the kernel's
    contract only, and the engine discards those rows."""
    num_kv_heads, head_dim = 2, 32
    lengths = _awkward_lengths(page_size)
    k_pool, v_pool, tables, valid = _random_paged_pools(lengths, page_size, num_kv_heads, head_dim)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((len(lengths), num_kv_heads * group_size, head_dim)), jnp.float32)
    k_pages, v_pages = kvp.gather_pages(kvp.KVPool(k_pool[None], v_pool[None]), 0, tables)  # [G, B, M, K, L], [G, B, M, L, K]
    positions = jnp.asarray(lengths, jnp.int32)[:, None] - 1  # [B, 1]: the decode token, already written
    with jax.default_matmul_precision("highest"):  # both are f32 references; no tf32 on a GPU
        engine = jaxtyped(typechecker=beartype)(attention_over_pages)(q[:, None], k_pages, v_pages, positions)[:, 0]
        kernel = jaxtyped(typechecker=beartype)(paged_attention_reference)(q, k_pool, v_pool, tables, jnp.asarray(lengths, jnp.int32))
    # Each output row is a convex combination of its valid V rows, so garbage that leaked would show.
    bound = float(np.abs(np.asarray(v_pool)[:, valid]).max())
    assert float(np.abs(np.asarray(engine)).max()) <= bound * (1 + 1e-6), "attention_over_pages read past a length"
    assert_close(engine, kernel, KERNEL_F32, f"attention_over_pages vs paged_attention_reference, lengths {lengths}")
