"""The CPU kernels (kernels_cpu/). Paged attention against a float64 numpy reference written from the
visibility rule, against its own jnp `reference` (itself checked against the float64 one), and against the
jnp path it replaces: decode, chunked prefill and packed rows, on the compiled-in geometries and the
generic one; a page id outside the pool is refused, naming it. The layer matmul against float64 numpy and
its own `reference`, directly and through panels.einsum on the model's einsum specs."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.model import attention
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model import panels
from kernels_cpu import layer_matmul
from kernels_cpu import paged_attention as cpu
from tolerances import KERNEL_F32, assert_close

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # skipped without a compiler; under CI=true, failed


def reference_f64(q, k_pool, v_pool, layer, tables, q_pos, page_pos, page_seg, q_seg):
    """Every query's keys listed one by one from the rule (same sequence, position <= the query's)."""
    b, t, h, k = q.shape
    g, page_size = k_pool.shape[1], k_pool.shape[-1]
    out = np.zeros((b, t, h, k))
    for row in range(b):
        for tok in range(t):
            slots = [(page, l) for e, page in enumerate(tables[row]) for l in range(page_size)
                     if page_seg[row, e] == q_seg[row, tok] and page_pos[row, e] + l <= q_pos[row, tok]]
            if not slots:
                continue
            for head in range(h):
                kv = head // (h // g)
                keys = np.array([k_pool[layer, kv, page, :, l] for page, l in slots], np.float64)
                values = np.array([v_pool[layer, kv, page, l, :] for page, l in slots], np.float64)
                scores = keys @ q[row, tok, head].astype(np.float64) / np.sqrt(k)
                weights = np.exp(scores - scores.max())
                out[row, tok, head] = weights @ values / weights.sum()
    return out


def random_case(rng, *, b, t, h, g, k, page_size, width, layers=2, pages=24):
    q = rng.standard_normal((b, t, h, k)).astype(np.float32)
    k_pool = rng.standard_normal((layers, g, pages, k, page_size)).astype(np.float32)
    v_pool = rng.standard_normal((layers, g, pages, page_size, k)).astype(np.float32)
    tables = rng.integers(1, pages, (b, width)).astype(np.int32)
    return q, k_pool, v_pool, tables


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16), b=st.integers(1, 3), t=st.sampled_from([1, 3, 17]), g=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]), geometry=st.sampled_from([(64, 64), (16, 64), (4, 8), (8, 16)]),
)
def test_one_sequence_per_row_matches_float64(seed, b, t, g, group, geometry):
    """Rows of one sequence each: chunked prefill (t > 1) or decode (t == 1) at random positions."""
    page_size, k = geometry
    rng = np.random.default_rng(seed)
    width = max(3, -(-t // page_size) + 1)
    q, k_pool, v_pool, tables = random_case(rng, b=b, t=t, h=g * group, g=g, k=k, page_size=page_size, width=width)
    starts = rng.integers(0, width * page_size - t + 1, b)
    q_pos = (starts[:, None] + np.arange(t)).astype(np.int32)
    out = cpu.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(1), jnp.asarray(tables), jnp.asarray(q_pos))
    page_pos = np.broadcast_to(np.arange(width) * page_size, (b, width))
    expected = reference_f64(q, k_pool, v_pool, 1, tables, q_pos, page_pos, np.zeros((b, width), int), np.zeros((b, t), int))
    assert_close(np.asarray(out), expected, KERNEL_F32, "kernel vs float64")
    jnp_reference = cpu.reference(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(1), jnp.asarray(tables), jnp.asarray(q_pos))
    assert_close(np.asarray(jnp_reference), expected, KERNEL_F32, "reference vs float64")
    assert_close(np.asarray(out), np.asarray(jnp_reference), KERNEL_F32, "kernel vs its reference")


def test_packed_row_sees_only_its_own_sequence():
    """One row holding three sequences' chunks, with a padding tail (segment -1, the null page)."""
    rng = np.random.default_rng(0)
    page_size, k = 16, 64
    q, k_pool, v_pool, _ = random_case(rng, b=1, t=40, h=6, g=2, k=k, page_size=page_size, width=6)
    # entries: seq 0 at positions 0, 16; seq 1 at 0; seq 2 at 32, 48 (its earlier pages too: 0, 16)
    page_seg = np.array([[0, 0, 1, 2, 2, 2, 2, -1]], np.int32)
    page_pos = np.array([[0, 16, 0, 0, 16, 32, 48, 0]], np.int32)
    tables = np.array([[3, 5, 7, 9, 11, 13, 15, 0]], np.int32)
    q_seg = np.array([[0] * 10 + [1] * 12 + [2] * 14 + [-1] * 4], np.int32)
    q_pos = np.array([list(range(22, 32)) + list(range(12)) + list(range(50, 64)) + [0] * 4], np.int32)
    args = [jnp.asarray(x) for x in (q, k_pool, v_pool, np.int32(0), tables, q_pos, page_pos, page_seg, q_seg)]
    out = np.asarray(cpu.paged_attention(*args))
    expected = reference_f64(q, k_pool, v_pool, 0, tables, q_pos, page_pos, page_seg, q_seg)
    real = q_seg[0] >= 0
    assert_close(out[:, real], expected[:, real], KERNEL_F32, "packed row vs float64")
    jnp_reference = np.asarray(cpu.reference(*args))
    assert_close(jnp_reference[:, real], expected[:, real], KERNEL_F32, "packed row: reference vs float64")
    assert_close(out, jnp_reference, KERNEL_F32, "packed row: kernel vs its reference, padding lanes included")
    # the padding queries' segment (-1) owns the null entry: they see it, finitely
    assert np.isfinite(out).all()


def test_matches_the_jnp_path_it_replaces():
    """Decode at 32 rows over 8 pages of 64: the kernel and attention_over_pages on the same pool."""
    rng = np.random.default_rng(1)
    q, k_pool, v_pool, tables = random_case(rng, b=32, t=1, h=9, g=3, k=64, page_size=64, width=8, pages=260)
    q_pos = rng.integers(0, 8 * 64, (32, 1)).astype(np.int32)
    pool = kvp.KVPool(jnp.asarray(k_pool), jnp.asarray(v_pool))
    k_pages, v_pages = kvp.gather_pages(pool, 1, jnp.asarray(tables))
    expected = attention.attention_over_pages(jnp.asarray(q), k_pages, v_pages, jnp.asarray(q_pos))
    out = cpu.paged_attention(jnp.asarray(q), pool.k, pool.v, jnp.int32(1), jnp.asarray(tables), jnp.asarray(q_pos))
    assert_close(np.asarray(out), np.asarray(expected), KERNEL_F32, "kernel vs attention_over_pages")


def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math turns on flush-to-zero for the whole process (it broke
    hypothesis's float strategies in another test); the kernel is compiled fast-math but linked without."""
    assert cpu.available()
    tiny = sys.float_info.min
    assert tiny / 2 > 0.0 and np.float32(1e-38) / np.float32(10) > 0


def test_a_query_that_sees_nothing_gets_zeros_in_kernel_and_reference():
    """A query whose segment owns no entry of its row (a padding lane) sees no key: zeros, not NaN."""
    rng = np.random.default_rng(3)
    q, k_pool, v_pool, tables = random_case(rng, b=1, t=2, h=2, g=1, k=8, page_size=4, width=2)
    args = [jnp.asarray(x) for x in (q, k_pool, v_pool, np.int32(0), tables, np.array([[5, 5]], np.int32),
                                     np.array([[0, 4]], np.int32), np.array([[0, 0]], np.int32), np.array([[0, 1]], np.int32))]
    for out in (cpu.paged_attention(*args), cpu.reference(*args)):
        out = np.asarray(out)
        assert np.isfinite(out).all() and not out[0, 1].any() and np.abs(out[0, 0]).max() > 0


# In jax 0.11 an FFI error with kInvalidArgument reaches Python as a ValueError; other versions raise
# JaxRuntimeError. Either way the message is the kernel's.
FFI_ERRORS = (ValueError, jax.errors.JaxRuntimeError)


@pytest.mark.parametrize("bad_page", [24, 1000, -1])  # the pool holds 24 pages: one past the end, far past, negative
def test_rejects_a_page_id_outside_the_pool_naming_it(bad_page):
    """Called directly (no engine, no host check in front), the kernel refuses an id outside [0, P) before it
    reads the pool, and says which id, where, and how many pages there are; valid ids are the control."""
    rng = np.random.default_rng(5)
    q, k_pool, v_pool, tables = random_case(rng, b=2, t=3, h=4, g=2, k=16, page_size=8, width=3, pages=24)
    q_pos = np.array([[20, 21, 22], [5, 6, 7]], np.int32)
    call = lambda tables: cpu.paged_attention(*map(jnp.asarray, (q, k_pool, v_pool, np.int32(1), tables, q_pos))).block_until_ready()  # noqa: E731
    page_pos = np.broadcast_to(np.arange(3) * 8, (2, 3))
    expected = reference_f64(q, k_pool, v_pool, 1, tables, q_pos, page_pos, np.zeros((2, 3), int), np.zeros((2, 3), int))
    assert_close(np.asarray(call(tables)), expected, KERNEL_F32, "valid ids: kernel vs float64")
    jnp_reference = cpu.reference(*map(jnp.asarray, (q, k_pool, v_pool, np.int32(1), tables, q_pos)))
    assert_close(np.asarray(call(tables)), np.asarray(jnp_reference), KERNEL_F32, "valid ids: kernel vs its reference")
    bad = tables.copy()
    bad[1, 2] = bad_page
    with pytest.raises(FFI_ERRORS, match=rf"page id {bad_page} at row 1, entry 2 of block_tables is outside the pool of 24 pages"):
        call(bad)


def test_rejects_a_page_id_in_an_entry_no_query_reads():
    """Every entry is checked, not only those a query reaches: entry 2 of a row whose queries see only
    entry 0 still names its bad id."""
    rng = np.random.default_rng(6)
    q, k_pool, v_pool, tables = random_case(rng, b=1, t=1, h=2, g=1, k=8, page_size=4, width=3, pages=6)
    tables[0, 2] = 6
    with pytest.raises(FFI_ERRORS, match="page id 6 at row 0, entry 2"):
        cpu.paged_attention(*map(jnp.asarray, (q, k_pool, v_pool, np.int32(0), tables, np.zeros((1, 1), np.int32)))).block_until_ready()


def test_rejects_a_layer_outside_the_pool():
    rng = np.random.default_rng(2)
    q, k_pool, v_pool, tables = random_case(rng, b=1, t=1, h=2, g=1, k=8, page_size=4, width=2)
    with pytest.raises(Exception, match="layer out of range"):
        cpu.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(5), jnp.asarray(tables), jnp.zeros((1, 1), jnp.int32)).block_until_ready()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), depth=st.sampled_from([1, 7, 64, 576]), width=st.sampled_from([1, 63, 64, 130, 192]))
def test_layer_matmul_matches_float64(seed, rows, depth, width):
    """Row counts around the register tile (6 or 3) and widths around the panel (64, zero-padded)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = rng.standard_normal((3, depth, width)).astype(np.float32)
    packed = panels.to_panels(jnp.asarray(w), 1, 1).panels
    out = layer_matmul.layer_matmul(jnp.asarray(x), packed, jnp.int32(2))
    assert_close(np.asarray(out)[:, :width], x.astype(np.float64) @ w[2].astype(np.float64), KERNEL_F32, "layer_matmul vs float64")
    jnp_reference = np.asarray(layer_matmul.reference(jnp.asarray(x), packed, jnp.int32(2)))
    assert_close(jnp_reference[:, :width], x.astype(np.float64) @ w[2].astype(np.float64), KERNEL_F32, "reference vs float64")
    assert_close(np.asarray(out), jnp_reference, KERNEL_F32, "layer_matmul vs its reference, padding columns included")


@pytest.mark.parametrize("spec,num_in,x_shape,w_shape", [
    ("btd,dhk->bthk", 1, (4, 1, 32), (32, 3, 8)),  # wq: 24 columns, one padded panel
    ("bthk,hkd->btd", 2, (2, 5, 3, 8), (3, 8, 130)),  # wo-like: 130 columns, three panels
    ("btd,dv->btv", 1, (1, 70, 16), (16, 64)),  # a head, over a prefill chunk's worth of rows
    ("btf,fd->btd", 1, (2, 3, 48), (48, 32)),  # w_down
])
def test_panel_tensor_einsum_equals_the_dense_matrix(spec, num_in, x_shape, w_shape):
    """panels.to_panels packs a stack into the kernel's panel layout; panels.einsum on a layer of it (as the
    in-place scan passes it) and on one slice (as a plain scan passes it) equals einsum on the matrix."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal(x_shape).astype(np.float32))
    stack = rng.standard_normal((3, *w_shape)).astype(np.float32)
    packed = panels.to_panels(jnp.asarray(stack), 1, num_in)
    assert packed.shape == stack.shape and packed.panels.shape[-1] == panels.PANEL_WIDTH
    expected = np.einsum(spec, np.asarray(x, np.float64), stack[1].astype(np.float64))
    in_place = panels.einsum(spec, x, panels.StackedWeight(packed, jnp.int32(1)))
    one = panels.einsum(spec, x, jax.tree.map(lambda leaf: leaf[1], packed))
    for out in (in_place, one):
        assert out.shape == expected.shape
        assert_close(np.asarray(out), expected, KERNEL_F32, f"PanelTensor {spec}")
