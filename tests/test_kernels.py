"""kernels_pallas.paged_attention on CPU: the reference against float64 numpy, the Mosaic GPU
kernel in the GPU interpreter (race detection, NaN-poisoned outputs) against the reference,
host validation, deterministic mode (splits of a fixed size; bitwise invariance to the batch, the
row and the table width), and a lowering sweep for cuda over the tuned and deterministic configs.

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
        jax.ShapeDtypeStruct((num_kv_heads, 8, head_dim, page_size), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_kv_heads, 8, page_size, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
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
    with kernel_interpret.gpu_interpreter() as params:
        out, lse = partials(q, k, v, bt, lens, sm_scale=sm_scale, config=config, interpret=params)
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


# ---------------------------------------------------------------- lowering for cuda


def _lower(config, *, batch, max_pages, num_kv_heads, group_size, head_dim, page_size, dtype):
    shapes = (
        jax.ShapeDtypeStruct((batch, num_kv_heads * group_size, head_dim), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, batch * max_pages + 1, head_dim, page_size), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, batch * max_pages + 1, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    fn = jax.jit(lambda *args: pa.paged_attention(*args, config=config))
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
    return list(cases.values())


def test_lowering_sweep_for_cuda():
    failures = []
    for kwargs in _lowering_cases():
        try:
            _lower(**kwargs)
        except Exception as e:  # collect them all, then fail once with the list
            failures.append(f"{kwargs}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)


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
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_plan_is_valid():
    """The GPU-only branches of experiments/device_check.py, planned on CPU: every correctness
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
    assert len(shapes) == 2 * (len(dc.BATCHES) * len(dc.CONTEXTS) + 1)
    for shape in shapes:
        pa.config_for(shape.batch, shape.max_pages, shape.num_kv_heads, shape.group_size,
                      shape.head_dim, shape.page_size)
    assert shapes[0].kv_bytes([4096] * 64) == 2 * 64 * 4096 * 8 * 128 * 2


def test_device_check_dry_run(tmp_path):
    """`device_check.py --dry-run` end to end, from the source tree, without jaxtyping (the GPU
    box has only jax, numpy and absl-py)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import runpy, sys; sys.modules['jaxtyping'] = None; "
            "sys.argv = ['device_check.py', '--dry-run']; "
            "runpy.run_path('experiments/device_check.py', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(root), OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] and not doc["errors"], doc["errors"]
    assert doc["correctness"][0]["ok"] and doc["correctness"][0]["races"] is False
    assert all("reference_us" in row for row in doc["timing"])
    assert json.loads((tmp_path / "device_check_dry_run.json").read_text())["ok"]
