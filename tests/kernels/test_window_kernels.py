"""Sliding-window attention in the kernels: the CPU FFI kernel (kernels_cpu/paged_attention) and its jnp
reference, and the Pallas Mosaic GPU decode kernel (kernels_pallas/paged_attention) in the GPU
interpreter, its reference and its lowering for cuda; each against a float64 numpy masked softmax written
from Hugging Face's rule (key p visible to query t iff t - W < p <= t).

Pages wholly before a row's window are the null page in these tables, as after the host released them,
and the null page holds NaN: a kernel that read one would return NaN. The window is traced in the CPU
kernel's jitted call and the Pallas lowering, as the engine's layer scan passes it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kernel_interpret
import tolerances
from kernels_cpu import paged_attention as cpu
from kernels_pallas import paged_attention as pa


def window_f64(q, keys, values, q_pos, k_pos, window, sm_scale):
    """q [B, T, H, K], keys/values [B, S, G, K] (slot s at position k_pos[b, s]) -> float64 [B, T, H, K]."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    b, t, h, k = q.shape
    g = keys.shape[2]
    out = np.zeros((b, t, h, k))
    for row in range(b):
        for i in range(t):
            visible = (k_pos[row] <= q_pos[row, i]) & (k_pos[row] > q_pos[row, i] - window)
            for head in range(h):
                s = keys[row, visible, head // (h // g)] @ q[row, i, head] * sm_scale
                if s.size:
                    w = np.exp(s - s.max())
                    out[row, i, head] = w @ values[row, visible, head // (h // g)] / w.sum()
    return out


def unpage(k_pages, v_pages, tables):
    """One layer's pages [G, P, K, L] / [G, P, L, K] through tables [B, E] -> keys, values [B, E*L, G, K]."""
    k_pages, v_pages, tables = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64), np.asarray(tables)
    b, e = tables.shape
    keys = k_pages[:, tables].transpose(1, 2, 4, 0, 3)  # [B, E, L, G, K]
    values = v_pages[:, tables].transpose(1, 2, 3, 0, 4)  # [B, E, L, G, K]
    return keys.reshape(b, -1, *keys.shape[3:]), values.reshape(b, -1, *values.shape[3:])


def null_before_window(tables, first_visible, page_size):
    """The tables with every entry wholly before each row's first visible position set to the null page."""
    tables = np.array(tables)
    for row, first in enumerate(first_visible):
        tables[row, : max(0, first) // page_size] = 0
    return tables


# ------------------------------------------------------------------ CPU kernel


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("page_size,head_dim", [(4, 8), (16, 64)])  # the generic path and a compiled-in geometry
def test_cpu_kernel_and_its_reference_mask_outside_a_traced_window(page_size, head_dim):
    rng = np.random.default_rng(page_size)
    b, h, g, e, layers = 2, 4, 2, 6, 2
    num_pages = 1 + b * e
    k_pool = rng.standard_normal((layers, g, num_pages, head_dim, page_size)).astype(np.float32)
    v_pool = rng.standard_normal((layers, g, num_pages, page_size, head_dim)).astype(np.float32)
    tables = np.arange(1, num_pages, dtype=np.int32).reshape(b, e)
    last = e * page_size - 1
    q_pos = np.array([[last - 2, last - 1, last], [9, 10, 11]], np.int32)  # a chunk of 3 per row
    q = rng.standard_normal((b, 3, h, head_dim)).astype(np.float32)
    keys, values = unpage(k_pool[1], v_pool[1], tables)
    k_pos = np.broadcast_to(np.arange(e * page_size), (b, e * page_size))
    call = jax.jit(cpu.paged_attention)
    for window in (1, page_size + 1, 2 * page_size + 3):
        expected = window_f64(q, keys, values, q_pos, k_pos, window, head_dim**-0.5)
        released = null_before_window(tables, q_pos[:, 0] - window + 1, page_size)
        poisoned_k, poisoned_v = k_pool.copy(), v_pool.copy()
        poisoned_k[:, :, 0], poisoned_v[:, :, 0] = np.nan, np.nan  # the null page: never read
        out = call(q, poisoned_k, poisoned_v, jnp.int32(1), released, q_pos, window=jnp.int32(window))
        tolerances.assert_close(out, expected, tolerances.KERNEL_F32, f"kernel, window {window}")
        ref = cpu.reference(q, k_pool, v_pool, 1, released, q_pos, window=window)
        tolerances.assert_close(ref, expected, tolerances.KERNEL_F32, f"reference, window {window}")
    full = cpu.paged_attention(q, k_pool, v_pool, 1, tables, q_pos)
    assert np.abs(np.asarray(full) - expected).max() > 1e-2  # no window: a different result


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_kernel_refuses_a_window_under_one_token():
    q = jnp.zeros((1, 1, 2, 8))
    pool = jnp.zeros((1, 1, 3, 8, 4))
    with pytest.raises(Exception, match="sliding window must be >= 1"):
        jax.block_until_ready(cpu.paged_attention(q, pool, pool.swapaxes(-1, -2), 0, jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32), window=0))


# ------------------------------------------------------------------ Pallas decode kernel


def _decode_case(lengths, num_kv_heads, group_size, head_dim, page_size, window, seed=0, dtype=jnp.bfloat16):
    """q [B, H, K], one layer's pages, block tables with the pages before each row's window nulled,
    lengths; page 0 (the null page) holds NaN."""
    rng = np.random.default_rng(seed)
    batch, max_pages = len(lengths), max(-(-n // page_size) for n in lengths)
    num_pages = batch * max_pages + 1
    tables = np.zeros((batch, max_pages), np.int32)
    ids = rng.permutation(np.arange(1, num_pages))
    for row, n in enumerate(lengths):
        tables[row, : -(-n // page_size)] = ids[row * max_pages : row * max_pages - (-n // page_size)]
    q = rng.standard_normal((batch, num_kv_heads * group_size, head_dim))
    k = rng.standard_normal((num_kv_heads, num_pages, head_dim, page_size))
    v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
    lengths = np.asarray(lengths, np.int32)
    released = null_before_window(tables, lengths - window, page_size)
    keys, values = unpage(k, v, tables)
    k_pos = np.broadcast_to(np.arange(max_pages * page_size), (batch, max_pages * page_size))
    k_pos = np.where(k_pos < lengths[:, None], k_pos, 10**9)  # slots past the length: never visible
    expected = window_f64(q[:, None], keys, values, (lengths - 1)[:, None], k_pos, window, head_dim**-0.5)[:, 0]
    k[:, 0], v[:, 0] = np.nan, np.nan
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (as_dtype(q), as_dtype(k), as_dtype(v), jnp.asarray(released), jnp.asarray(lengths)), expected


def test_pallas_reference_masks_outside_the_window():
    args, expected = _decode_case((1, 70, 200, 333), 2, 3, 64, 64, window=100, dtype=jnp.float32)
    q, k, v, tables, lengths = args
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)  # the reference gathers every entry (and zeroes masked V)
    out = pa.paged_attention_reference(q, k, v, tables, lengths, window=jnp.int32(100))
    tolerances.assert_close(out, expected, tolerances.KERNEL_F32, "reference")


# (lengths, kv heads, group, head_dim, page, window, config): splits wholly before the window are empty,
# a window inside one page, across a split boundary, and deterministic mode's fixed splits.
INTERPRETER_CASES = {
    "splits3_window100": ((1, 63, 130, 300, 449), 2, 3, 64, 64, 100, pa.PagedAttentionConfig(num_splits=3, pipeline_depth=2)),
    "deterministic_2pages_window_inside_a_page": ((5, 600, 1100), 1, 4, 64, 64, 40, pa.deterministic_config(64, 64, 4)),
}


@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_pallas_kernel_masks_outside_the_window_and_never_reads_released_pages_in_interpreter(name):
    lengths, g, group, head_dim, page_size, window, config = INTERPRETER_CASES[name]
    args, expected = _decode_case(lengths, g, group, head_dim, page_size, window, seed=len(name))
    with kernel_interpret.gpu_interpreter() as params:
        out = pa.paged_attention(*args, window=jnp.int32(window), config=config, interpret=params)
        out = jax.block_until_ready(out)
        assert not kernel_interpret.races_found(), "race detector fired"
    assert np.isfinite(np.asarray(out, np.float32)).all(), "a released (NaN) page was read"
    tolerances.assert_close(out, expected, tolerances.KERNEL_BF16, name)


@pytest.mark.parametrize("head_dim,page_size,deterministic", [(64, 64, False), (128, 128, True)])
def test_pallas_kernel_with_a_traced_window_lowers_for_cuda(head_dim, page_size, deterministic):
    batch, max_pages, g, group = 8, 16, 2, 4
    config = pa.deterministic_config(head_dim, page_size, group) if deterministic else pa.config_for(batch, max_pages, g, group, head_dim, page_size)
    num_pages = batch * max_pages + 1
    shapes = (
        jax.ShapeDtypeStruct((batch, g * group, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((3, g, num_pages, head_dim, page_size), jnp.bfloat16),
        jax.ShapeDtypeStruct((3, g, num_pages, page_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),  # layer
        jax.ShapeDtypeStruct((), jnp.int32),  # window
    )
    fn = jax.jit(lambda q, k, v, t, n, layer, window: pa.paged_attention(q, k, v, t, n, layer=layer, window=window, config=config))
    exported = export.export(fn, platforms=("cuda",), disabled_checks=[export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*shapes)
    assert "mosaic_gpu" in exported.mlir_module()

