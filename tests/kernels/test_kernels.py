"""kernels_pallas.paged_attention on CPU: the reference against float64 numpy, the Mosaic GPU
kernel in the GPU interpreter (race detection, NaN-poisoned outputs) against the reference,
host validation, deterministic mode (splits of a fixed size; bitwise invariance to the batch, the
row and the table width), quantized pages (int8 and fp8 e4m3 codes with per-token scales: the
reference against float64 numpy on the dequantized pools, the kernel against the reference, with
negative controls on the scales, argument errors, SMEM accounting), and a lowering sweep for cuda
over the tuned and deterministic configs, bf16/f16 and quantized pages.

Interpreter cases are few and each combines several properties (awkward lengths, split
boundaries, shuffled tables, GQA ratio, head_dim, page size, peaked or flat softmax), because
each costs seconds on 2 cores.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jax import export
from jaxtyping import jaxtyped

import kernel_interpret
import tolerances
from kernels_pallas import paged_attention as pa  # the module (nothing is re-exported)

# Relative error norm per input dtype, from tests/tolerances.py. The kernel takes bf16/f16 only:
# an f32 wgmma runs in tf32, so f32 is served by the reference and checked there at KERNEL_F32.
REL_ERR = {jnp.bfloat16: tolerances.KERNEL_BF16, jnp.float16: tolerances.KERNEL_BF16,
           jnp.float32: tolerances.KERNEL_F32}
assert_close = tolerances.assert_close


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]  # one per sequence; max_pages = max over them, rounded up
    num_kv_heads: int
    group_size: int
    head_dim: int
    page_size: int
    dtype: object = jnp.bfloat16
    q_scale: float = 1.0  # 5-10 for peaked softmax, << 1 for near-uniform
    max_pages: int | None = None
    seed: int = 0

    def arrays(self):
        """Random pool with shuffled, partly shared block tables; padding entries are page 0."""
        rng = np.random.default_rng(self.seed)
        batch, page = len(self.lengths), self.page_size
        max_pages = self.max_pages or max(-(-n // page) for n in self.lengths)
        num_pages = batch * max_pages + 3
        ids = rng.permutation(np.arange(1, num_pages))  # page ids in a random order
        tables = np.zeros((batch, max_pages), np.int32)
        for b, n in enumerate(self.lengths):
            used = -(-n // page)
            tables[b, :used] = ids[b * max_pages: b * max_pages + used]
        if batch > 1 and self.lengths[0] >= page and self.lengths[1] >= page:
            tables[1, 0] = tables[0, 0]  # a shared prefix page
        num_q_heads = self.num_kv_heads * self.group_size
        q = rng.standard_normal((batch, num_q_heads, self.head_dim)) * self.q_scale
        k = rng.standard_normal((self.num_kv_heads, num_pages, self.head_dim, page))
        v = rng.standard_normal((self.num_kv_heads, num_pages, page, self.head_dim))
        return (jnp.asarray(q, self.dtype), jnp.asarray(k, self.dtype), jnp.asarray(v, self.dtype),
                jnp.asarray(tables), jnp.asarray(np.asarray(self.lengths, np.int32)))


def in_pool(*pages, layer: int = 1):
    """Each page array [G, P, ...] as layer `layer` of a 2-layer pool [2, G, P, ...] whose other layer
    holds the same pages in reverse order, so a kernel that read the wrong layer would show; and the
    layer as `_paged_attention_partials` takes it (int32 [1])."""
    pools = tuple(jnp.stack([x, jnp.flip(x, 1)][:: 1 if layer == 0 else -1]) for x in pages)
    return pools, jnp.full((1,), layer, jnp.int32)


def dense_attention_f64(q, k_pages, v_pages, tables, lengths, sm_scale):
    """Independent float64 numpy: un-page K/V per sequence, then plain softmax attention."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    out = np.zeros_like(q)
    for b in range(batch):
        n = int(lengths[b])
        if n == 0:
            continue
        pages = tables[b, : -(-n // k_pages.shape[-1])]
        k = np.concatenate([k_pages[:, p].swapaxes(-1, -2) for p in pages], axis=1)[:, :n]  # [G,S,K]
        v = np.concatenate([v_pages[:, p] for p in pages], axis=1)[:, :n]  # [G, S, K]
        for h in range(num_q_heads):
            g = h // (num_q_heads // num_kv_heads)
            s = k[g] @ q[b, h] * sm_scale
            w = np.exp(s - s.max())
            out[b, h] = w @ v[g] / w.sum()
    return out


# ---------------------------------------------------------------- reference vs float64 numpy


def _hand_built(batch_tables, lengths, num_kv_heads, group_size, head_dim, page_size, dtype):
    rng = np.random.default_rng(1)
    num_pages = int(np.max(batch_tables)) + 2
    q = rng.standard_normal((len(lengths), num_kv_heads * group_size, head_dim))
    k = rng.standard_normal((num_kv_heads, num_pages, head_dim, page_size))
    v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(np.asarray(batch_tables, np.int32)), jnp.asarray(np.asarray(lengths, np.int32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tables,lengths,num_kv_heads,group_size,head_dim,page_size", [
    ([[3, 1, 0], [2, 5, 4], [0, 0, 0]], [5, 12, 0], 2, 3, 8, 4),  # GQA 3, padding row
    ([[1, 2], [2, 1]], [1, 8], 1, 4, 16, 4),  # shared pages in swapped order, GQA 4
    ([[6, 0, 0, 0], [1, 3, 5, 2]], [3, 13], 3, 1, 8, 4),  # MHA
    ([[4, 7], [5, 0]], [16, 7], 1, 8, 16, 8),  # GQA 8, one full table
])
def test_reference_matches_float64_dense(tables, lengths, num_kv_heads, group_size, head_dim,
                                         page_size, dtype):
    q, k, v, bt, lens = _hand_built(tables, lengths, num_kv_heads, group_size, head_dim,
                                    page_size, dtype)
    sm_scale = 0.7 / math.sqrt(head_dim)
    checked = jaxtyped(typechecker=beartype)(pa.paged_attention_reference)
    out = checked(q, k, v, bt, lens, sm_scale=sm_scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = dense_attention_f64(q, k, v, bt, lens, sm_scale)  # from the same rounded inputs
    assert_close(out, expected, REL_ERR[dtype], "reference vs f64")
    assert not np.asarray(out, np.float32)[np.asarray(lens) == 0].any(), "padding row not zero"


def test_reference_ignores_pages_past_length():
    """Garbage, even NaN, in the null page and past a sequence's length must not leak."""
    q, k, v, bt, lens = _hand_built([[1, 2], [3, 0]], [5, 3], 1, 2, 8, 4, jnp.float32)
    out = pa.paged_attention_reference(q, k, v, bt, lens)
    k_bad = k.at[:, 2, :, 1:].set(jnp.nan).at[:, 0].set(jnp.inf)
    v_bad = v.at[:, 2, 1:].set(jnp.nan).at[:, 0].set(jnp.nan)
    out_bad = pa.paged_attention_reference(q, k_bad, v_bad, bt, lens)
    np.testing.assert_array_equal(np.asarray(out_bad), np.asarray(out))


# ---------------------------------------------------------------- host validation and config


def test_out_of_range_page_id_is_rejected():
    case = Case(lengths=(5, 64), num_kv_heads=1, group_size=4, head_dim=64, page_size=64)
    q, k, v, bt, lens = case.arrays()
    num_pages = k.shape[1]
    for bad in (num_pages, -1):
        with pytest.raises(ValueError, match=r"block_tables\[1, 0\].*out of range"):
            pa.paged_attention(q, k, v, bt.at[1, 0].set(bad), lens)
        with pytest.raises(ValueError, match="out of range"):
            pa.validate_block_tables(np.asarray(bt.at[1, 0].set(bad)), num_pages)
    pa.validate_block_tables(np.asarray(bt), num_pages)  # the good table passes
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        pa.paged_attention(q, k, v, bt, lens.at[0].set(bt.shape[1] * 64 + 1))


def test_shape_and_dtype_errors():
    q, k, v, bt, lens = Case(lengths=(3,), num_kv_heads=2, group_size=2, head_dim=64,
                             page_size=128).arrays()
    with pytest.raises(ValueError, match="f32"):
        pa.paged_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           bt, lens)
    with pytest.raises(ValueError, match="K transposed"):
        pa.paged_attention(q, k.swapaxes(2, 3), v, bt, lens)
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_attention(q[:, :3], k, v, bt, lens)
    with pytest.raises(ValueError, match="int32"):
        pa.paged_attention(q, k, v, bt.astype(jnp.int16), lens)
    with pytest.raises(ValueError, match="head_dim"):
        pa.paged_attention(q[..., :32], k[:, :, :32], v[..., :32], bt, lens,
                           config=pa.PagedAttentionConfig())


@pytest.mark.parametrize("kwargs", [
    dict(num_splits=0), dict(pages_per_block=3), dict(pipeline_depth=1), dict(block_h=128),
    dict(num_splits=1.5), dict(pages_per_split=0), dict(pages_per_split=3, pages_per_block=2),
    dict(pages_per_split=8, num_splits=2),
])
def test_config_rejects_bad_knobs(kwargs):
    with pytest.raises(ValueError):
        pa.PagedAttentionConfig(**kwargs)


def test_config_shape_checks_and_table():
    with pytest.raises(ValueError, match="wgmma"):
        pa.PagedAttentionConfig(pages_per_block=4).check_shapes(128, 128, 4)
    with pytest.raises(ValueError, match="SMEM"):
        pa.PagedAttentionConfig(pages_per_block=2, pipeline_depth=6).check_shapes(128, 128, 4)
    with pytest.raises(ValueError, match="group_size"):
        pa.PagedAttentionConfig().check_shapes(128, 64, 65)
    for entry in pa.TUNED_TABLE:
        entry.config.check_shapes(entry.head_dim, entry.page_size, 8)
    config = pa.config_for(batch=64, max_pages=64, num_kv_heads=8, group_size=4, head_dim=128,
                           page_size=64)  # the milestone shape, 64 x 4096
    assert config.num_splits * 64 * 8 >= 2 * pa.NUM_SMS
    tiny = pa.config_for(batch=1, max_pages=2, num_kv_heads=1, group_size=1, head_dim=64,
                         page_size=64)
    assert tiny.num_splits <= 2  # never more splits than KV blocks
    with pytest.raises(ValueError):
        pa.config_for(batch=1, max_pages=2, num_kv_heads=1, group_size=1, head_dim=96, page_size=64)


def _num_splits_run(config, batch, max_pages, head_dim=64, page_size=64, group_size=4):
    """The split count the kernel's grid really has (its partial outputs' split axis), from
    jax.eval_shape: no lowering, no interpreter."""
    num_kv_heads = 2
    shapes = (
        jax.ShapeDtypeStruct((batch, num_kv_heads * group_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, num_kv_heads, 8, head_dim, page_size), jnp.bfloat16),  # a pool of one layer
        jax.ShapeDtypeStruct((1, num_kv_heads, 8, page_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),  # the layer
    )
    out, lse = jax.eval_shape(functools.partial(
        pa._paged_attention_partials, sm_scale=0.1, config=config, interpret=False), *shapes)
    assert lse is not None or not config.deterministic, "deterministic mode always merges"
    return out.shape[2]


def test_deterministic_splits_follow_the_table_width_not_the_batch():
    """The deterministic config has a fixed pages_per_split at every (head_dim, page_size), and
    the kernel's grid has ceil(width / pages_per_split) splits at every batch size; the tuned
    config, the control, changes its split count with the batch at the same width."""
    for head_dim in pa.SUPPORTED_HEAD_DIMS:
        for page_size in pa.SUPPORTED_PAGE_SIZES:
            config = pa.deterministic_config(head_dim, page_size, 8)
            assert config.pages_per_split * page_size == pa.DETERMINISTIC_SPLIT_TOKENS
            config.check_shapes(head_dim, page_size, 8)
    config = pa.deterministic_config(64, 64, 4)
    batches, widths = (1, 3, 64, 512), (1, 8, 9, 64)
    runs = {(b, m): _num_splits_run(config, b, m) for b in batches for m in widths}
    assert all(runs[b, m] == -(-m // 8) for b, m in runs), runs
    tuned = {b: _num_splits_run(pa.config_for(b, 64, 2, 4, 64, 64), b, 64) for b in batches}
    assert len(set(tuned.values())) > 1, f"the control should depend on the batch: {tuned}"
    with pytest.raises(ValueError, match="splits"):
        config.split_layout(8 * pa.MAX_SPLITS + 1)


# ---------------------------------------------------------------- kernel in the GPU interpreter

INTERPRETER_CASES = {
    # The default model's GQA (9 query heads over 3 kv heads, head_dim 64); lengths 1, L-1,
    # L, L+1, both sides of a split boundary (4 pages per split = 256 tokens), and the max.
    "gqa3_d64_l64_splits3": (
        Case(lengths=(1, 63, 64, 65, 255, 256, 257, 704), num_kv_heads=3, group_size=3,
             head_dim=64, page_size=64),
        pa.PagedAttentionConfig(num_splits=3, pipeline_depth=2)),
    # f16, peaked softmax, 2-page blocks (the last split holds a partial block), a padding row
    # (length 0), boundaries at 256 tokens (2 blocks per split).
    "gqa4_d128_l64_f16_peaked_2pages": (
        Case(lengths=(0, 1, 129, 255, 256, 257, 383, 448), num_kv_heads=2, group_size=4,
             head_dim=128, page_size=64, dtype=jnp.float16, q_scale=8.0, seed=1),
        pa.PagedAttentionConfig(num_splits=2, pages_per_block=2, pipeline_depth=3)),
    # One split: the kernel writes q.dtype directly. GQA 8, page 128, near-uniform softmax,
    # 7 blocks through a 2-slot ring (the page ids read a step ahead are all used).
    "gqa8_d128_l128_one_split_flat": (
        Case(lengths=(1, 127, 128, 129, 896), num_kv_heads=1, group_size=8, head_dim=128,
             page_size=128, q_scale=0.05, seed=2),
        pa.PagedAttentionConfig(num_splits=1, pipeline_depth=2)),
    # MHA, page 128, config from the tuned table: 4 splits of 2 pages over 5 pages, so the
    # last split is always empty; split boundaries at 256 and 512 tokens. q scaled 5x.
    "mha_d64_l128_tuned": (
        Case(lengths=(1, 255, 256, 257, 513, 640), num_kv_heads=4, group_size=1, head_dim=64,
             page_size=128, q_scale=5.0, max_pages=5, seed=3),
        None),
}


@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_kernel_matches_reference_in_interpreter(name):
    case, config = INTERPRETER_CASES[name]
    q, k, v, bt, lens = case.arrays()
    num_kv_heads, group_size = case.num_kv_heads, case.group_size
    if config is None:
        config = pa.config_for(len(case.lengths), bt.shape[1], num_kv_heads, group_size,
                               case.head_dim, case.page_size)
        assert config.num_splits > 1
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    partials = jax.jit(pa._paged_attention_partials, static_argnames=(
        "sm_scale", "config", "interpret"))
    (k_pool, v_pool), layer = in_pool(k, v)  # the kernel reads one layer of a pool in place
    with kernel_interpret.gpu_interpreter() as params:
        out, lse = partials(q, k_pool, v_pool, bt, lens, layer, sm_scale=sm_scale, config=config,
                            interpret=params)
        out, lse = jax.block_until_ready((out, lse))
        assert not kernel_interpret.races_found(), "race detector fired"
    # Outputs start as NaN in the interpreter, so finiteness means every element was written.
    assert np.isfinite(np.asarray(out, np.float32)).all(), "unwritten or NaN partial output"
    if lse is not None:
        assert np.isfinite(np.asarray(lse)).all(), "unwritten or NaN log-sum-exp"
        out = pa._merge_splits(out, lse)
    out = out.reshape(q.shape).astype(q.dtype)
    ref = pa.paged_attention_reference(q, k, v, bt, lens, sm_scale=sm_scale)
    assert_close(out, ref, REL_ERR[case.dtype], name)
    assert not np.asarray(out, np.float32)[np.asarray(lens) == 0].any(), "padding row not zero"


def test_public_wrapper_in_interpreter():
    """The jitted public entry point (packing, merge, cast) on one small case."""
    case = Case(lengths=(70, 3), num_kv_heads=2, group_size=2, head_dim=64, page_size=64, seed=4)
    q, k, v, bt, lens = case.arrays()
    config = pa.PagedAttentionConfig(num_splits=2)
    with kernel_interpret.gpu_interpreter() as params:
        out = pa.paged_attention(q, k, v, bt, lens, sm_scale=0.3, config=config, interpret=params)
        out = out.block_until_ready()
        assert not kernel_interpret.races_found()
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = dense_attention_f64(q, k, v, bt, lens, 0.3)
    assert_close(out, expected, REL_ERR[jnp.bfloat16], "wrapper vs f64")


def _needle_arrays():
    """One sequence (the needle, 600 tokens = 5 pages of 128, across two 4-page splits) in a pool
    shared by two block tables: alone, 5 pages wide; and at row 1 of 3 between sequences of 1
    and 1030 tokens (9 pages: 3 splits), 9 pages wide. The null page holds NaN, so a read of a
    padding entry would show in the output."""
    rng = np.random.default_rng(5)
    num_kv_heads, group_size, head_dim, page_size = 2, 4, 64, 128
    lengths = (1, 600, 1030)
    pages = [-(-n // page_size) for n in lengths]
    ids = rng.permutation(np.arange(1, 1 + sum(pages) + 2))
    starts = np.cumsum([0] + pages)
    wide = np.zeros((3, 9), np.int32)
    for row, (start, n) in enumerate(zip(starts, pages)):
        wide[row, :n] = ids[start: start + n]
    q = rng.standard_normal((3, num_kv_heads * group_size, head_dim)) * 5.0  # peaked softmax
    k = rng.standard_normal((num_kv_heads, len(ids) + 1, head_dim, page_size))
    v = rng.standard_normal((num_kv_heads, len(ids) + 1, page_size, head_dim))
    k[:, 0], v[:, 0] = np.nan, np.nan
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    batch = (q, k, v, jnp.asarray(wide), jnp.asarray(np.int32(lengths)))
    alone = (q[1:2], k, v, jnp.asarray(wide[1:2, :5]), jnp.asarray(np.int32(lengths[1:2])))
    return alone, batch


def test_deterministic_kernel_is_bitwise_invariant_to_batch_row_and_width_in_interpreter():
    alone, batch = _needle_arrays()
    config = pa.deterministic_config(64, 128, 4)
    assert (config.split_layout(5)[0], config.split_layout(9)[0]) == (2, 3)
    outs = []
    for args in (alone, batch):
        with kernel_interpret.gpu_interpreter() as params:
            outs.append(jax.block_until_ready(
                pa.paged_attention(*args, config=config, interpret=params)))
            assert not kernel_interpret.races_found(), "race detector fired"
    out_alone, out_batch = (np.asarray(o) for o in outs)
    assert np.isfinite(out_batch.astype(np.float32)).all(), "a NaN from the null page leaked"
    assert np.array_equal(out_alone[0].view(np.uint16), out_batch[1].view(np.uint16)), (
        f"not bitwise equal: max |diff| "
        f"{np.abs(out_alone[0].astype(np.float32) - out_batch[1].astype(np.float32)).max()}")
    assert_close(out_batch, pa.paged_attention_reference(*batch), REL_ERR[jnp.bfloat16],
                 "deterministic kernel vs reference")


# ---------------------------------------------------------------- quantized KV pages (int8, fp8)

QUANTIZED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_CODE_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize_per_token(x, kv_dtype, head_dim_axis):
    """Codes and f32 scales of one pool, per (kv head, page, token slot): scale = max |x| over the
    head dim / 127 (int8, codes rounded) or / 448 (float8_e4m3fn, codes cast)."""
    x = np.asarray(x, np.float32)
    code_max = _CODE_MAX[jnp.dtype(kv_dtype)]
    scales = np.abs(x).max(axis=head_dim_axis) / code_max  # [G, P, L]
    y = np.clip(x / np.expand_dims(np.where(scales > 0, scales, 1.0), head_dim_axis),
                -code_max, code_max)
    codes = np.rint(y).astype(np.int8) if kv_dtype == jnp.int8 else jnp.asarray(y).astype(kv_dtype)
    return jnp.asarray(codes), jnp.asarray(scales, jnp.float32)


def dequantize_f64(k_codes, v_codes, k_scales, v_scales):
    """The dequantized pools in float64, written independently of the reference's jnp."""
    k_codes, v_codes = (np.asarray(jnp.asarray(c).astype(jnp.float32), np.float64)
                        for c in (k_codes, v_codes))
    k_scales, v_scales = np.asarray(k_scales, np.float64), np.asarray(v_scales, np.float64)
    return k_codes * k_scales[:, :, None, :], v_codes * v_scales[..., None]


def quantized_arrays(case: Case, kv_dtype):
    """`case.arrays()` with K/V quantized per token, plus `read` [P, L]: whether some sequence
    reads the slot as valid. Token magnitudes vary about 20x (log-normal gains), so each token's
    own scale matters."""
    q, k, v, bt, lens = case.arrays()
    rng = np.random.default_rng(case.seed + 100)
    gain = np.exp(rng.normal(0.0, 0.75, (k.shape[0], k.shape[1], k.shape[3])))  # [G, P, L]
    k = np.asarray(k, np.float32) * gain[:, :, None, :]
    v = np.asarray(v, np.float32) * gain[..., None]
    k_codes, k_scales = quantize_per_token(k, kv_dtype, head_dim_axis=2)
    v_codes, v_scales = quantize_per_token(v, kv_dtype, head_dim_axis=3)
    page, tables = case.page_size, np.asarray(bt)
    read = np.zeros(k_scales.shape[1:], bool)  # [P, L]
    for b, n in enumerate(np.asarray(lens)):
        for j in range(-(-int(n) // page)):
            read[tables[b, j], : min(page, int(n) - j * page)] = True
    return q, k_codes, v_codes, bt, lens, k_scales, v_scales, read


def poison_unread(scales, read):
    """NaN scales at every slot no sequence reads: the kernel may load them (masked), and must
    not let them through."""
    return jnp.where(read, scales, jnp.nan)


@pytest.mark.parametrize("kv,tables,lengths,num_kv_heads,group_size,head_dim,page_size", [
    ("int8", [[3, 1, 0], [2, 5, 4], [0, 0, 0]], [5, 12, 0], 2, 3, 8, 4),  # GQA 3, padding row
    ("fp8", [[4, 7], [5, 0]], [16, 7], 1, 8, 16, 8),  # GQA 8, one full table
])
def test_quantized_reference_matches_float64_dense(kv, tables, lengths, num_kv_heads, group_size,
                                                   head_dim, page_size):
    q, k, v, bt, lens = _hand_built(tables, lengths, num_kv_heads, group_size, head_dim,
                                    page_size, jnp.float32)
    k_codes, k_scales = quantize_per_token(k * 3.0, QUANTIZED[kv], head_dim_axis=2)
    v_codes, v_scales = quantize_per_token(v * 0.5, QUANTIZED[kv], head_dim_axis=3)
    k_scales = k_scales.at[:, 0].set(jnp.nan)  # the null page: never valid
    sm_scale = 0.7 / math.sqrt(head_dim)
    checked = jaxtyped(typechecker=beartype)(pa.paged_attention_reference)
    out = checked(q, k_codes, v_codes, bt, lens, k_scales=k_scales, v_scales=v_scales,
                  sm_scale=sm_scale)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    k_f64, v_f64 = dequantize_f64(k_codes, v_codes, k_scales, v_scales)
    expected = dense_attention_f64(q, k_f64, v_f64, bt, lens, sm_scale)
    assert_close(out, expected, REL_ERR[jnp.float32], f"{kv} reference vs f64 on dequantized K/V")
    # Negative control: the same codes read without their scales.
    ones = jnp.ones_like(k_scales)
    k_raw, v_raw = dequantize_f64(k_codes, v_codes, ones, ones)
    with pytest.raises(AssertionError):
        assert_close(out, dense_attention_f64(q, k_raw, v_raw, bt, lens, sm_scale),
                     REL_ERR[jnp.float32])


QUANTIZED_INTERPRETER_CASES = {  # (case, codes, config (None: deterministic), public wrapper)
    # int8 under bf16 q: 3 splits of 2-page blocks over 10 pages (the last split holds one
    # block); lengths 1, L+1, both sides of the split boundary (256 tokens), the max.
    "int8_gqa4_d64_l64_splits3_2pages": (
        Case(lengths=(1, 65, 255, 257, 640), num_kv_heads=1, group_size=4, head_dim=64,
             page_size=64, seed=11),
        "int8", pa.PagedAttentionConfig(num_splits=3, pages_per_block=2, pipeline_depth=2), False),
    # fp8 under bf16 q (the e4m3 -> f16 -> bf16 conversion), deterministic mode: 512-token
    # splits of 2-page blocks through a 3-slot ring (4 blocks: the ring wraps), peaked softmax,
    # 9 pages = 2 splits, lengths at 512 +- 1.
    "fp8_gqa4_d64_l64_deterministic": (
        Case(lengths=(1, 511, 513), num_kv_heads=1, group_size=4, head_dim=64, page_size=64,
             q_scale=5.0, seed=12),
        "fp8", None, False),
    # int8 under f16 q through the public wrapper, one split (the kernel writes f16 itself),
    # GQA 8, head_dim and page 128, 3 blocks through 2 slots, a padding row.
    "int8_gqa8_d128_l128_f16_one_split_public": (
        Case(lengths=(0, 129, 300), num_kv_heads=1, group_size=8, head_dim=128, page_size=128,
             dtype=jnp.float16, seed=13),
        "int8", pa.PagedAttentionConfig(num_splits=1, pipeline_depth=2), True),
}


@pytest.mark.parametrize("name", list(QUANTIZED_INTERPRETER_CASES))
def test_quantized_kernel_matches_reference_in_interpreter(name):
    case, kv, config, public = QUANTIZED_INTERPRETER_CASES[name]
    q, k, v, bt, lens, clean_k_scales, clean_v_scales, read = quantized_arrays(case, QUANTIZED[kv])
    k_scales, v_scales = poison_unread(clean_k_scales, read), poison_unread(clean_v_scales, read)
    if config is None:
        config = pa.deterministic_config(case.head_dim, case.page_size, case.group_size)
        assert config.split_layout(bt.shape[1])[0] == 2
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    partials = jax.jit(pa._paged_attention_partials, static_argnames=(
        "sm_scale", "config", "interpret"))
    # The kernel reads one layer of a pool in place (codes and scales alike).
    (k_pool, v_pool, k_scale_pool, v_scale_pool), layer = in_pool(k, v, k_scales, v_scales)
    with kernel_interpret.gpu_interpreter() as params:
        if public:  # one split: the wrapper returns the kernel's own (NaN-initialized) output
            assert config.split_layout(bt.shape[1])[0] == 1 and not config.deterministic
            out = pa.paged_attention(q, k_pool, v_pool, bt, lens, layer=layer[0],
                                     k_scales=k_scale_pool, v_scales=v_scale_pool,
                                     sm_scale=sm_scale, config=config, interpret=params)
            out, lse = jax.block_until_ready(out), None
            assert out.dtype == q.dtype
        else:
            out, lse = partials(q, k_pool, v_pool, bt, lens, layer, k_scale_pool, v_scale_pool,
                                sm_scale=sm_scale, config=config, interpret=params)
            out, lse = jax.block_until_ready((out, lse))
        assert not kernel_interpret.races_found(), "race detector fired"
    # Outputs start as NaN in the interpreter; stale slots hold NaN scales.
    assert np.isfinite(np.asarray(out, np.float32)).all(), "unwritten or NaN partial output"
    if lse is not None:
        assert np.isfinite(np.asarray(lse)).all(), "unwritten or NaN log-sum-exp"
        merge = pa._merge_splits_in_order if config.deterministic else pa._merge_splits
        out = merge(out, lse)
    out = out.reshape(q.shape).astype(q.dtype)
    reference = functools.partial(pa.paged_attention_reference, q, k, v, bt, lens,
                                  sm_scale=sm_scale)
    assert_close(out, reference(k_scales=k_scales, v_scales=v_scales), REL_ERR[case.dtype], name)
    assert not np.asarray(out, np.float32)[np.asarray(lens) == 0].any(), "padding row not zero"
    # Negative controls: the comparison fails against the same codes without their scales, or
    # with either scale row shifted one token (right magnitudes, wrong tokens; finite wherever
    # read, so the failure is a real mismatch, not a NaN).
    ones = jnp.ones_like(k_scales)
    shifted_k, shifted_v = (poison_unread(jnp.roll(s, 1, axis=2), read)
                            for s in (clean_k_scales, clean_v_scales))
    for wrong_k, wrong_v in ((ones, ones), (shifted_k, v_scales), (k_scales, shifted_v)):
        wrong = reference(k_scales=wrong_k, v_scales=wrong_v)
        assert np.isfinite(np.asarray(wrong, np.float32)).all()
        with pytest.raises(AssertionError):
            assert_close(out, wrong, REL_ERR[case.dtype])


def test_quantized_argument_errors():
    case = Case(lengths=(3, 70), num_kv_heads=2, group_size=2, head_dim=64, page_size=64)
    q, k, v, bt, lens = case.arrays()
    _, k8, v8, _, _, ks, vs, _ = quantized_arrays(case, jnp.int8)
    for fn in (pa.paged_attention, pa.paged_attention_reference):
        with pytest.raises(ValueError, match="k_scales must be None"):  # float pages
            fn(q, k, v, bt, lens, k_scales=ks, v_scales=vs)
        with pytest.raises(ValueError, match="v_scales must be None"):
            fn(q, k, v, bt, lens, v_scales=vs)
        with pytest.raises(ValueError, match="k_scales is required"):
            fn(q, k8, v8, bt, lens)
        with pytest.raises(ValueError, match="v_scales is required"):  # missing v_scales
            fn(q, k8, v8, bt, lens, k_scales=ks)
        with pytest.raises(ValueError, match="k_scales must be float32"):  # wrong shape
            fn(q, k8, v8, bt, lens, k_scales=ks[:, :, :32], v_scales=vs)
        with pytest.raises(ValueError, match="v_scales must be float32"):  # [G, P] per page
            fn(q, k8, v8, bt, lens, k_scales=ks, v_scales=vs[..., 0])
        with pytest.raises(ValueError, match="v_scales must be float32"):  # wrong dtype
            fn(q, k8, v8, bt, lens, k_scales=ks, v_scales=vs.astype(jnp.bfloat16))
        with pytest.raises(ValueError, match="must match"):  # int8 K with fp8 V
            fn(q, k8, v8.astype(jnp.float8_e4m3fn), bt, lens, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="f32"):  # the kernel still needs a bf16/f16 q
        pa.paged_attention(q.astype(jnp.float32), k8, v8, bt, lens, k_scales=ks, v_scales=vs)
    pa.paged_attention_reference(q.astype(jnp.float32), k8, v8, bt, lens, k_scales=ks,
                                 v_scales=vs)  # the reference takes an f32 q


def test_quantized_smem_accounting():
    """Code rings hold half the bytes: a block/ring too big in bf16 fits with 1-byte codes, the
    converted tiles and scale rows still count, and every tuned and deterministic config fits."""
    wide = pa.PagedAttentionConfig(pages_per_block=4, pipeline_depth=3)
    with pytest.raises(ValueError, match="SMEM"):
        wide.check_shapes(64, 64, 4)
    wide.check_shapes(64, 64, 4, kv_itemsize=1)
    deep = pa.PagedAttentionConfig(pipeline_depth=4)
    assert deep.smem_bytes(128, 128, kv_itemsize=1) < deep.smem_bytes(128, 128)
    with pytest.raises(ValueError, match="SMEM"):  # 4 slots of 128 x 128 codes: 230 KiB
        deep.check_shapes(128, 128, 4, kv_itemsize=1)
    for entry in pa.TUNED_TABLE:
        entry.config.check_shapes(entry.head_dim, entry.page_size, 8, kv_itemsize=1)
    for head_dim in pa.SUPPORTED_HEAD_DIMS:
        for page_size in pa.SUPPORTED_PAGE_SIZES:
            pa.deterministic_config(head_dim, page_size, 8).check_shapes(
                head_dim, page_size, 8, kv_itemsize=1)



# ---------------------------------------------------------------- lowering for cuda


def _lower(config, *, batch, max_pages, num_kv_heads, group_size, head_dim, page_size, dtype,
           kv_dtype=None):
    """Lowers the public wrapper for cuda; `kv_dtype` (int8 / fp8) quantizes the pages."""
    num_pages = batch * max_pages + 1
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    shapes = (
        jax.ShapeDtypeStruct((batch, num_kv_heads * group_size, head_dim), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, num_pages, head_dim, page_size), kv_dtype),
        jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), kv_dtype),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    if kv_dtype == dtype:
        fn = jax.jit(lambda *args: pa.paged_attention(*args, config=config))
    else:
        shapes += (jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size), jnp.float32),) * 2
        fn = jax.jit(lambda *args: pa.paged_attention(
            *args[:5], k_scales=args[5], v_scales=args[6], config=config))
    export.export(fn, platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*shapes)


def _lowering_cases():
    """Every tuned-table entry at a shape inside its bucket (bf16), plus every dtype, group size
    and the boundary knobs at each (head_dim, page_size). Identical lowerings are deduplicated."""
    cases = {}
    for e in pa.TUNED_TABLE:
        num_kv_heads = 8
        batch = max(1, min(e.max_rows, 1024) // num_kv_heads)
        max_pages = max(1, min(e.max_context, 32768) // e.page_size)
        key = (e.config, e.head_dim, e.page_size, "bfloat16", 4)
        cases.setdefault(key, dict(batch=batch, max_pages=max_pages, num_kv_heads=num_kv_heads,
                                   group_size=4, head_dim=e.head_dim, page_size=e.page_size,
                                   dtype=jnp.bfloat16, config=e.config))
    for head_dim in pa.SUPPORTED_HEAD_DIMS:
        for page_size in pa.SUPPORTED_PAGE_SIZES:
            for dtype, group_size in (("float16", 3), ("bfloat16", 1), ("bfloat16", 8)):
                config = pa.config_for(4, 8, 3, group_size, head_dim, page_size)
                cases[(config, head_dim, page_size, dtype, group_size)] = dict(
                    batch=4, max_pages=8, num_kv_heads=3, group_size=group_size, head_dim=head_dim,
                    page_size=page_size, dtype=jnp.dtype(dtype), config=config)
            # The largest block (wgmma K <= 256) and the deepest ring that fit the SMEM limit.
            fitting = [pa.PagedAttentionConfig(num_splits=2, pages_per_block=b, pipeline_depth=d)
                       for b in (1, 2, 4) for d in range(2, 7) if b * page_size <= 256]
            fitting = [c for c in fitting if c.smem_bytes(head_dim, page_size) <= pa.SMEM_LIMIT_BYTES]
            widest = max(fitting, key=lambda c: (c.pages_per_block, -c.pipeline_depth))
            deepest = max(fitting, key=lambda c: (c.pipeline_depth, -c.pages_per_block))
            for config in (widest, deepest):
                cases[(config, head_dim, page_size, "bfloat16", 4)] = dict(
                    batch=2, max_pages=16, num_kv_heads=2, group_size=4, head_dim=head_dim,
                    page_size=page_size, dtype=jnp.bfloat16, config=config)
            # Deterministic mode: one split (still merged) and 4 splits, the last one partial.
            config = pa.deterministic_config(head_dim, page_size, 8)
            for max_pages, dtype in ((config.pages_per_split, "float16"),
                                     (3 * config.pages_per_split + 1, "bfloat16")):
                cases[(config, head_dim, page_size, dtype, 8, max_pages)] = dict(
                    batch=3, max_pages=max_pages, num_kv_heads=2, group_size=8,
                    head_dim=head_dim, page_size=page_size, dtype=jnp.dtype(dtype), config=config)
            cases.update(_quantized_lowering_cases(head_dim, page_size))
    return list(cases.values())


def _quantized_lowering_cases(head_dim, page_size):
    """int8 and fp8 pages at one (head_dim, page_size), two lowerings (each about 2 s): bf16 q
    under the tuned config (head_dim 64) or the deterministic config over 4 splits (head_dim
    128), and f16 q under the widest block with the largest code ring that fits the SMEM
    limit. The codes swap roles with the page size, so each code meets both q dtypes."""
    if head_dim == 64:
        config, max_pages = pa.config_for(4, 8, 3, 4, head_dim, page_size), 8
    else:
        config = pa.deterministic_config(head_dim, page_size, 8)
        max_pages = 3 * config.pages_per_split + 1
    fitting = [pa.PagedAttentionConfig(num_splits=2, pages_per_block=b, pipeline_depth=d)
               for b in (1, 2, 4) for d in range(2, 7) if b * page_size <= 256]
    smem = {c: c.smem_bytes(head_dim, page_size, kv_itemsize=1) for c in fitting}
    largest = max((c for c in fitting if smem[c] <= pa.SMEM_LIMIT_BYTES),
                  key=lambda c: (c.pages_per_block, smem[c]))
    first, second = ("int8", "fp8") if page_size == 64 else ("fp8", "int8")
    plan = [(first, "bfloat16", config, max_pages), (second, "float16", largest, 16)]
    return {(config, head_dim, page_size, dtype, 4, max_pages, kv): dict(
                batch=3, max_pages=max_pages, num_kv_heads=2, group_size=4, head_dim=head_dim,
                page_size=page_size, dtype=jnp.dtype(dtype), config=config,
                kv_dtype=QUANTIZED[kv])
            for kv, dtype, config, max_pages in plan}


def test_lowering_sweep_for_cuda(monkeypatch):
    """Every case lowers. With quantized pages the lowering's own SMEM bound is set to the
    config's `smem_bytes`, so an undercount there fails here too (private jax knob)."""
    from jax.experimental.mosaic.gpu import core as mosaic_core
    failures, quantized = [], set()
    for kwargs in _lowering_cases():
        if kwargs.get("kv_dtype") is not None:
            quantized.add((kwargs["head_dim"], kwargs["page_size"], jnp.dtype(kwargs["kv_dtype"])))
            estimate = kwargs["config"].smem_bytes(kwargs["head_dim"], kwargs["page_size"],
                                                   kv_itemsize=1)
            monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", estimate)
        try:
            _lower(**kwargs)
        except Exception as e:  # collect them all, then fail once with the list
            failures.append(f"{kwargs}: {type(e).__name__}: {str(e)[:300]}")
        monkeypatch.undo()
    assert not failures, "\n".join(failures)
    assert quantized == {(head_dim, page_size, dtype) for head_dim in pa.SUPPORTED_HEAD_DIMS
                         for page_size in pa.SUPPORTED_PAGE_SIZES for dtype in pa.QUANTIZED_DTYPES}


# ---------------------------------------------------------------- the one geometry rule; the whole pool


@pytest.mark.parametrize(("geometry", "reason"), [
    (dict(head_dim=64, page_size=16), "page_size=16"),
    (dict(head_dim=96, page_size=64), "head_dim=96"),
    (dict(head_dim=64, page_size=64, group_size=65), "group_size=65"),
])
def test_supports_is_the_rule_config_for_and_deterministic_config_enforce(geometry, reason):
    """One owner: the reason `supports` gives is the error both config builders raise."""
    got = pa.supports(**geometry)
    assert got is not None and reason in got
    sizes = dict(group_size=1) | geometry
    with pytest.raises(ValueError, match=reason) as tuned:
        pa.config_for(batch=2, max_pages=4, num_kv_heads=2, **sizes)
    with pytest.raises(ValueError, match=reason) as deterministic:
        pa.deterministic_config(**sizes)
    assert str(tuned.value) == str(deterministic.value) == got


def test_supports_every_tuned_geometry_and_names_dtypes_it_does_not_take():
    for head_dim in pa.SUPPORTED_HEAD_DIMS:
        for page_size in pa.SUPPORTED_PAGE_SIZES:
            for kv_dtype in (None, *pa.QUANTIZED_DTYPES):
                assert pa.supports(head_dim, page_size, 8, dtype=jnp.bfloat16, kv_dtype=kv_dtype) is None
    assert "needs bfloat16 or float16" in pa.supports(64, 64, dtype=jnp.float32)
    assert "int16" in pa.supports(64, 64, dtype=jnp.bfloat16, kv_dtype=jnp.int16)


def test_whole_pool_argument_errors():
    q, k, v, bt, lens = Case(lengths=(70, 3), num_kv_heads=2, group_size=2, head_dim=64,
                             page_size=64).arrays()
    (k_pool, v_pool), _ = in_pool(k, v)
    with pytest.raises(ValueError, match="must be 4-D.*or the whole pool"):  # a pool needs its layer
        pa.paged_attention(q, k_pool, v_pool, bt, lens)
    with pytest.raises(ValueError, match="must be 5-D.*when a layer is given"):  # one layer's: none
        pa.paged_attention(q, k, v, bt, lens, layer=0)
    with pytest.raises(ValueError, match="out of range"):
        pa.paged_attention(q, k_pool, v_pool, bt, lens, layer=2)
    with pytest.raises(ValueError, match="integer scalar"):
        pa.paged_attention(q, k_pool, v_pool, bt, lens, layer=jnp.zeros((1,), jnp.int32))


def test_reference_over_a_whole_pool_reads_the_layer():
    q, k, v, bt, lens = Case(lengths=(70, 3, 130), num_kv_heads=2, group_size=2, head_dim=64,
                             page_size=64, dtype=jnp.float32).arrays()
    for layer in (0, 1):
        (k_pool, v_pool), _ = in_pool(k, v, layer=layer)
        got = jax.jit(pa.paged_attention_reference)(q, k_pool, v_pool, bt, lens, layer=jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(pa.paged_attention_reference(q, k, v, bt, lens)))
    other = pa.paged_attention_reference(q, k_pool, v_pool, bt, lens, layer=0)
    assert not np.allclose(np.asarray(other), np.asarray(got)), "the pool's two layers must differ"


def test_public_wrapper_reads_a_traced_layer_of_the_whole_pool_in_interpreter():
    """The layer index traced (as in the model's layer scan): each layer's output matches float64 over
    that layer's pages, and the two differ (the kernel does read the layer it is given)."""
    case = Case(lengths=(70, 3), num_kv_heads=2, group_size=2, head_dim=64, page_size=64, seed=5)
    q, k, v, bt, lens = case.arrays()
    (k_pool, v_pool), _ = in_pool(k, v)  # layer 1 holds k, v; layer 0 their pages reversed
    config = pa.PagedAttentionConfig(num_splits=2)
    with kernel_interpret.gpu_interpreter() as params:
        attend = jax.jit(lambda layer: pa.paged_attention(q, k_pool, v_pool, bt, lens, layer=layer,
                                                          config=config, interpret=params))
        outs = [jax.block_until_ready(attend(jnp.int32(layer))) for layer in (0, 1)]
        assert not kernel_interpret.races_found()
    for layer, out in enumerate(outs):
        expected = dense_attention_f64(q, k_pool[layer], v_pool[layer], bt, lens, 1 / math.sqrt(64))
        assert_close(out, expected, REL_ERR[jnp.bfloat16], f"layer {layer} vs f64")
    assert not np.allclose(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))


@pytest.mark.parametrize("kv", [None, "int8"])
def test_whole_pool_with_a_traced_layer_lowers_for_cuda(kv):
    """The kernel's operands are the whole pools (and scales), not a layer's slice of them."""
    batch, max_pages, num_layers, num_pages, num_kv_heads, head_dim, page = 3, 8, 4, 25, 2, 128, 64
    kv_dtype = jnp.bfloat16 if kv is None else QUANTIZED[kv]
    shapes = [
        jax.ShapeDtypeStruct((batch, num_kv_heads * 4, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_layers, num_kv_heads, num_pages, head_dim, page), kv_dtype),
        jax.ShapeDtypeStruct((num_layers, num_kv_heads, num_pages, page, head_dim), kv_dtype),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    ]
    if kv is not None:
        shapes += [jax.ShapeDtypeStruct((num_layers, num_kv_heads, num_pages, page), jnp.float32)] * 2

    def attend(q, k, v, bt, lens, layer, *scales):
        return pa.paged_attention(q, k, v, bt, lens, layer=layer,
                                  **dict(zip(("k_scales", "v_scales"), scales)))

    module = export.export(jax.jit(attend), platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*shapes).mlir_module()
    call = next(line for line in module.splitlines() if "custom_call @mosaic_gpu_v2" in line)
    element = "bf16" if kv is None else "i8"
    whole = f"tensor<{num_layers}x{num_kv_heads}x{num_pages}x"
    operands = call.rsplit("->", 1)[0]
    assert operands.count(f"{whole}{head_dim}x{page}x{element}>") == 1, operands[-400:]
    assert operands.count(f"{whole}{page}x{head_dim}x{element}>") == 1, operands[-400:]
    assert operands.count(f"{whole}{page}xf32>") == (0 if kv is None else 2), operands[-400:]


# ---------------------------------------------------------------- harness and device check


def test_race_detector_is_live():
    """A negative control: the harness must see a race the interpreter can detect (a register
    store read by a TMA without `commit_smem`), or 'no races' above would mean nothing."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref, smem):
        smem[...] = x_ref[...] + 1.0
        plgpu.copy_smem_to_gmem(smem, o_ref)  # missing plgpu.commit_smem()
        plgpu.wait_smem_to_gmem(0)

    with kernel_interpret.gpu_interpreter() as params:
        kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                              scratch_types=[plgpu.SMEM((128,), jnp.float32)], interpret=params)
        jax.block_until_ready(jax.jit(kernel)(jnp.zeros((128,), jnp.float32)))
        assert kernel_interpret.races_found()


def _device_check_module():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_plan_is_valid():
    """The GPU-only branches of scripts/device_check.py, planned on CPU: every correctness
    case and timing shape has a valid config, and lengths stay in range."""
    dc = _device_check_module()
    rng = np.random.default_rng(0)
    cases = dc.correctness_cases(dry_run=False)
    assert len(cases) >= len({(e.head_dim, e.page_size, e.config) for e in pa.TUNED_TABLE})
    for shape, config in cases:
        config.check_shapes(shape.head_dim, shape.page_size, shape.group_size)
        lengths = dc.awkward_lengths(shape, config, rng)
        assert lengths.shape == (shape.batch,) and 1 <= lengths.min() and lengths.max() <= shape.context
    shapes = dc.timing_shapes(dry_run=False)
    assert (shapes[0].batch, shapes[0].context) == dc.MILESTONE
    assert len(shapes) == 2 * (len(dc.BATCHES) * len(dc.CONTEXTS) + 1) + 2  # + int8, fp8
    for shape in shapes:
        pa.config_for(shape.batch, shape.max_pages, shape.num_kv_heads, shape.group_size,
                      shape.head_dim, shape.page_size)
    assert shapes[0].kv_bytes([4096] * 64) == 2 * 64 * 4096 * 8 * 128 * 2
    assert [s.kv_dtype for s in shapes[2:4]] == ["int8", "float8_e4m3fn"]
    assert shapes[2].kv_bytes([4096] * 64) == 2 * 64 * 4096 * 8 * (128 + 4)  # codes + scales
    assert {shape.kv_dtype for shape, _ in cases} >= {None, "int8", "float8_e4m3fn"}


def test_device_check_dry_run(tmp_path):
    """`device_check.py --dry-run` end to end, from the source tree, without jaxtyping (the GPU
    box has only jax, numpy and absl-py)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    code = ("import runpy, sys; sys.modules['jaxtyping'] = None; "
            "sys.argv = ['device_check.py', '--dry-run']; "
            "runpy.run_path('scripts/device_check.py', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(root), OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] and not doc["errors"], doc["errors"]
    assert all(row["ok"] and row["races"] is False for row in doc["correctness"])
    assert [row["shape"]["kv_dtype"] for row in doc["correctness"]] == [None, "int8"]
    assert all("reference_us" in row for row in doc["timing"])
    assert json.loads((tmp_path / "device_check_dry_run.json").read_text())["ok"]
