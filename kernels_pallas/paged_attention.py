"""Paged-attention decode on the Pallas Mosaic GPU backend (Hopper), beside its jnp reference.

Owns the decode kernel (one query token per sequence over a paged KV cache), its config and
tuned-config table, the one rule of which geometries it serves (`supports`), the host-side
block-table check, and `paged_attention_reference`, the kernel's f32 oracle. The engine's CPU
path is jaxinfer.model.attention.attention_over_pages, not this reference; the two are proven equal in decode (lengths >= 1, finite pools) by tests/test_attention_dispatch.py.
Must not import jaxinfer: experiments/device_check.py runs this file from a bare source tree (jax,
numpy, absl-py only).

Layout (axis letters as in model.py: B batch, H query heads, G kv heads, K head dim, P pages,
L page length; M is the block-table width, max pages per sequence):
  q             [B, H, K]     query head h reads kv head h // group_size (HF/Llama GQA)
  k_pages       [G, P, K, L]  K transposed per page: the QK^T operand needs no transpose
  v_pages       [G, P, L, K]  (either pool may be the whole [N, G, P, ...] with a `layer` index:
                              the kernel then reads that layer's pages in place, as TMA boxes)
  block_tables  [B, M] int32  padded with page 0, the null page
  lengths       [B] int32     valid tokens; 0 marks a padding row, whose output is zeros
  window        int32 scalar  optional sliding window W: only the last W of a sequence's `lengths`
                              tokens are visible (positions in [length - W, length), HF's rule for
                              a query at length - 1); pages wholly before them are never read, so
                              their table entries may be the null page. The kernel gets it as
                              starts [B] = max(length - W, 0), the first visible position per row.
  k_scales, v_scales [G, P, L] f32, only with quantized pages (int8 / float8_e4m3fn codes):
                one scale per (kv head, page, token slot); key = codes[:, l] * k_scales[l]
  softcap       static float, optional attention soft-cap c (Gemma 2's attn_logit_softcapping):
                each scaled score s becomes c * tanh(s / c) before the mask

Dataflow: grid (G, B, num_splits). A program loads the group's query rows, zero-padded to the
64-row wgmma tile, then streams its split's KV blocks through a ring of SMEM slots filled by TMA,
runs an online softmax in f32, and writes a normalized partial output with its log2-sum-exp.
XLA merges the splits. Quantized pages stream as codes (half the bytes), are converted exactly to
q's dtype in SMEM for the wgmmas, and their scales are applied in f32: K's to the score columns,
V's to p before it is staged. Deterministic mode (`deterministic_config`) fixes the pages per split,
so a split's work depends only on its own sequence, and merges the splits in a fixed order: a
sequence's output is then bitwise the same whatever the batch, its row and the table width.
Invariants: masked scores use the finite MASK_VALUE, never -inf; a program whose split starts
past the sequence loads nothing and writes zeros with lse = MASK_VALUE; only pages below the
sequence length are ever read, so padding entries are not. Slots past the length inside a read
page may hold any scale, but must hold finite codes or values (a NaN times p = 0 is NaN).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:
    from jaxtyping import Array, Float, Int, Num
except ImportError:  # a bare GPU box (jax, numpy, absl-py) running experiments/device_check.py
    Array = jax.Array

    class Float:  # Float[Array, "B H K"] -> jax.Array: the annotation is kept, unchecked
        def __class_getitem__(cls, _):
            return jax.Array

    Int = Num = Float

# Finite stand-in for -inf: exp2(MASK_VALUE - m) underflows to 0 without NaN from inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Quantized K/V codes (both pools alike), dequantized with f32 scales per (kv head, page, slot).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (64, 128)
SMEM_LIMIT_BYTES = 227 * 1024  # per-block opt-in shared memory on H100/H200 (sm_90)
NUM_SMS = 132  # H100/H200 SXM; the split table aims for >= 2 programs per SM
MAX_SPLITS = 256  # splits per (sequence, kv head)
DETERMINISTIC_SPLIT_TOKENS = 512  # tokens per split of `deterministic_config` (4 blocks of 128)
_LOG2E = math.log2(math.e)
_WGMMA_ROWS = 64  # one warpgroup's wgmma M
_SWIZZLE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# 1-byte codes: a 128-byte swizzle would need 128-code tile rows, longer than a K page's 64-slot
# rows at page_size 64, so the code rings use 64-code (64-byte) tile rows and the 64-byte swizzle.
_SWIZZLE_8BIT = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def _paged_attention_kernel(
    q_ref, k_ref, v_ref, block_tables_ref, lengths_ref, starts_ref, layer_ref, k_scales_ref, v_scales_ref,  # in
    out_ref, lse_ref,  # outputs, GMEM
    q_smem, v_smem, p_smem, ring_union, q_barrier, k_barriers, v_barriers, dequant,  # scratch
    *, group_size, pages_per_split, pages_per_block, pipeline_depth, sm_scale, softcap=None,
):
    """One (kv head, sequence, split) program. Shapes (R = 64 rows, Gp = group padded to 8):

    q_ref [B, G, Gp, K] · k_ref [layers, G, P, K, L] · v_ref [layers, G, P, L, K] (the whole pool,
    read in place at layer layer_ref[0], int32 [1]) · block_tables_ref [B, M] · lengths_ref [B] ·
    starts_ref [B] (first visible position: 0, or length - window) · out_ref
    [B, G, S, group, K] (f32; q.dtype when lse_ref is None) · lse_ref [B, G, S, R] f32 (None: one
    split, not deterministic) · q_smem [R, K] · v_smem [depth, N, K]
    · p_smem [R, N], with N = pages_per_block * L · ring_union = (k_smem [depth, ppb, K, L],
    (o_smem [R, K], lse_smem [R])): the output buffers reuse the K ring, which is dead once the
    loop has ended.

    Quantized pages (int8 / fp8 codes; the rings hold codes): k_scales_ref, v_scales_ref
    [layers, G, P, L] f32 and dequant = (k_scale_smem [depth, ppb, L], v_scale_smem [depth, N] f32, both
    filled with the K pages on the K barrier; k_mma [ppb, K, L], v_mma [N, K]: the block
    converted to q.dtype, the wgmma operands, one slot each). Otherwise the three are None.
    """
    k_smem, (o_smem, lse_smem) = ring_union
    num_rows, head_dim = q_smem.shape
    page_size = k_ref.shape[-1]
    max_pages = block_tables_ref.shape[1]
    dtype = q_smem.dtype
    kv_head, seq, split = (lax.axis_index(n) for n in ("kv_head", "seq", "split"))
    layer = layer_ref[0]

    length = jnp.minimum(lengths_ref[seq], max_pages * page_size)
    start = jnp.clip(starts_ref[seq], 0, length)  # first visible position (a sliding window's)
    seq_pages = lax.div(length + (page_size - 1), jnp.int32(page_size))
    start_page = lax.div(start, jnp.int32(page_size))  # pages before it are never read
    # A split covers table entries [split * pages_per_split, + pages_per_split); it starts at the
    # window's first page when that lies inside it, and is empty when wholly before the window.
    split_first = split * pages_per_split
    first_page = jnp.maximum(split_first, start_page)
    split_pages = jnp.clip(jnp.minimum(seq_pages, split_first + pages_per_split) - first_page, 0,
                           pages_per_split)
    num_blocks = lax.div(split_pages + (pages_per_block - 1), jnp.int32(pages_per_block))

    def block_pages(block):
        # Page ids of a block. Pages past the sequence re-read its last page: always a real,
        # finite page of this sequence, and the arrival count of the slot barrier stays fixed.
        first = first_page + block * pages_per_block
        return tuple(block_tables_ref[seq, jnp.clip(first + j, start_page, seq_pages - 1)]
                     for j in range(pages_per_block))

    def fetch(pages, slot):
        for j, page in enumerate(pages):
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, kv_head, page], k_smem.at[slot, j],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, kv_head, page], v_smem.at[slot, rows],
                                    v_barriers.at[slot])
            if dequant is not None:  # both scale rows ride on the K barrier: p needs v's early
                k_scale_smem, v_scale_smem, _, _ = dequant
                plgpu.copy_gmem_to_smem(k_scales_ref.at[layer, kv_head, page],
                                        k_scale_smem.at[slot, j], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_scales_ref.at[layer, kv_head, page],
                                        v_scale_smem.at[slot, rows], k_barriers.at[slot])

    @pl.when(num_blocks > 0)  # empty splits exit early: no loads, zeros out
    def _prologue():
        padded_group = q_ref.shape[2]
        if padded_group < num_rows:  # rows past the group must be finite: they share the wgmma
            q_smem[...] = jnp.zeros((num_rows, head_dim), dtype)
            plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head], q_smem.at[pl.ds(0, padded_group)], q_barrier)
        for slot in range(pipeline_depth):
            pl.when(slot < num_blocks)(lambda slot=slot: fetch(block_pages(slot), slot))
        plgpu.barrier_wait(q_barrier)

    def kv_step(block, carry):
        acc, m_i, l_i, pages = carry  # [R, K], [R], [R]; m_i and scores are in log2 units
        slot = lax.rem(block, jnp.int32(pipeline_depth))
        # Page ids for the next step's refill, read a whole step ahead so that the global-memory
        # latency hides behind this step's compute (`pages` was read by the previous step).
        following = block_pages(block + pipeline_depth + 1)
        plgpu.barrier_wait(k_barriers.at[slot])
        if dequant is not None:  # codes -> q.dtype, through registers, for the QK wgmma
            k_scale_smem, v_scale_smem, k_mma, v_mma = dequant
            for j in range(pages_per_block):
                k_mma.at[j][...] = _codes_to(k_smem.at[slot, j][...], dtype)  # [K, L]
            plgpu.commit_smem()

        def qk(page, acc_ref):
            k_tile = k_smem.at[slot, page] if dequant is None else k_mma.at[page]  # [K, L]
            plgpu.wgmma(acc_ref, q_smem, k_tile)
            return acc_ref[...]

        # One QK wgmma per page (a K block spanning pages is not contiguous for TMA), one softmax
        # update and one PV wgmma per block.
        scores, valid = [], []
        # Without a cap the scores go straight to log2 units; with one, tanh(s * sm_scale / c) first, then
        # times c * log2(e): c * tanh(s / c) in log2 units.
        score_scale = sm_scale * _LOG2E if softcap is None else sm_scale / softcap
        for j in range(pages_per_block):
            s = pl.run_scoped(functools.partial(qk, j), plgpu.ACC((num_rows, page_size), jnp.float32))
            if dequant is None:
                s = s * score_scale  # [R, L]
            else:  # a key's scale is a column scale of the scores of its page
                column_scale = k_scale_smem.at[slot, j][...] * score_scale  # [L]
                s = s * lax.broadcast_in_dim(column_scale, s.shape, [1])  # [R, L]
            if softcap is not None:
                s = jnp.tanh(s) * (softcap * _LOG2E)  # [R, L], before the mask
            col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            position = (first_page + block * pages_per_block + j) * page_size + col
            valid.append((position < length) & (position >= start))
            scores.append(jnp.where(valid[j], s, MASK_VALUE))
        # Every block holds >= 1 valid token (the first starts at the window's first page, which
        # holds `start`), so m_new is a real score and masked p is exactly 0.
        m_new = functools.reduce(jnp.maximum, [s.max(axis=1) for s in scores], m_i)
        alpha = jnp.exp2(m_i - m_new)
        l_i = l_i * alpha
        for j, s in enumerate(scores):
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))  # [R, L]
            l_i = l_i + p.sum(axis=1)
            if dequant is not None:  # a value's scale is a row scale of V: fold it into p
                row_scale = v_scale_smem.at[slot, pl.ds(j * page_size, page_size)][...]  # [L]
                # where, not just p * scale: a stale slot past the length may hold any scale.
                p = jnp.where(valid[j], p * lax.broadcast_in_dim(row_scale, p.shape, [1]), 0.0)
            # Staged in SMEM: a wgmma A operand in registers does not run in the interpreter.
            p_smem.at[:, pl.ds(j * page_size, page_size)][...] = p.astype(dtype)
        if dequant is None:
            plgpu.commit_smem()
            plgpu.barrier_wait(v_barriers.at[slot])
        else:
            plgpu.barrier_wait(v_barriers.at[slot])
            for j in range(pages_per_block):  # page by page: a [L, K] tile's registers at a time
                rows = pl.ds(j * page_size, page_size)
                v_mma.at[rows][...] = _codes_to(v_smem.at[slot, rows][...], dtype)  # [L, K]
            plgpu.commit_smem()  # p and the converted V, before the wgmma reads them

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot] if dequant is None else v_mma)
            return acc_ref[...]

        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((num_rows, head_dim), jnp.float32))
        # Both wgmmas have been awaited (their results are in registers), so the slot is free.
        pl.when(block + pipeline_depth < num_blocks)(functools.partial(fetch, pages, slot))
        return acc, m_new, l_i, following

    init = (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
        block_pages(pipeline_depth),
    )
    acc, m_i, l_i, _ = lax.fori_loop(0, num_blocks, kv_step, init)

    nonempty = l_i > 0  # false for all rows of an empty split
    l_safe = jnp.where(nonempty, l_i, 1.0)
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
    if lse_ref is not None:
        lse_smem[...] = jnp.where(nonempty, m_i + jnp.log2(l_safe), MASK_VALUE)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group_size)], out_ref.at[seq, kv_head, split])
    if lse_ref is not None:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, kv_head, split])
    plgpu.wait_smem_to_gmem(0)


def _codes_to(codes, dtype):
    """Quantized codes -> the wgmma dtype, exactly (every int8 and every e4m3 value is
    representable in bf16 and in f16). Mosaic GPU converts e4m3 to bf16 only with ptxas ISA
    >= 9.2 (the CPU lowering raises NotImplementedError without it), and e4m3 to f16 always, so
    e4m3 -> bf16 goes through f16 (then f32, which Mosaic inserts between the 16-bit types)."""
    if codes.dtype == jnp.float8_e4m3fn and dtype == jnp.bfloat16:
        codes = codes.astype(jnp.float16)
    return codes.astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig:
    """Static kernel knobs; hashable, so it can be a jit static argument."""

    num_splits: int = 1  # sequence splits per (sequence, kv head), merged by log-sum-exp in XLA
    pages_per_block: int = 1  # pages per KV block (one ring slot); the PV wgmma's K dimension
    pipeline_depth: int = 2  # SMEM ring slots: KV blocks in flight while one is computed
    block_h: int = _WGMMA_ROWS  # query rows per program; a kv head's group is padded to it
    # Deterministic mode: pages per split, fixed, so the split count follows the table width
    # alone (num_splits stays 1) and splits merge in a fixed order; see `deterministic_config`.
    pages_per_split: int | None = None

    def __post_init__(self):
        for name in ("num_splits", "pages_per_block", "pipeline_depth", "block_h"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive int")
        if self.num_splits > MAX_SPLITS:
            raise ValueError(f"{self.num_splits=} must be <= {MAX_SPLITS}")
        if self.pages_per_split is not None:
            if not isinstance(self.pages_per_split, int) or self.pages_per_split < 1:
                raise ValueError(f"{self.pages_per_split=} must be a positive int or None")
            if self.pages_per_split % self.pages_per_block:  # no block may straddle two splits
                raise ValueError(f"{self.pages_per_split=} must be a multiple of "
                                 f"{self.pages_per_block=}")
            if self.num_splits != 1:
                raise ValueError(f"{self.num_splits=} must stay 1 with {self.pages_per_split=}: "
                                 "the split count then follows the block-table width")
        if self.pages_per_block not in (1, 2, 4):
            raise ValueError(f"{self.pages_per_block=} must be 1, 2 or 4")
        if not 2 <= self.pipeline_depth <= 6:
            raise ValueError(f"{self.pipeline_depth=} must be in [2, 6]")
        if self.block_h != _WGMMA_ROWS:
            raise ValueError(f"{self.block_h=} must be {_WGMMA_ROWS}, one warpgroup's wgmma M")

    @property
    def deterministic(self) -> bool:
        """Whether a sequence's output is independent of the batch, its row and the table width."""
        return self.pages_per_split is not None

    def split_layout(self, max_pages: int) -> tuple[int, int]:
        """(num_splits, pages_per_split) over a block table of `max_pages` pages (static).

        Raises:
          ValueError: if a fixed pages_per_split needs more than MAX_SPLITS splits.
        """
        if self.pages_per_split is None:  # equal splits of the table, whole blocks each
            num_blocks = -(-max_pages // self.pages_per_block)
            return self.num_splits, -(-num_blocks // self.num_splits) * self.pages_per_block
        num_splits = -(-max_pages // self.pages_per_split)
        if num_splits > MAX_SPLITS:
            raise ValueError(f"{max_pages=} needs {num_splits} splits of {self.pages_per_split} "
                             f"pages; at most {MAX_SPLITS}")
        return num_splits, self.pages_per_split

    def smem_bytes(self, head_dim: int, page_size: int, itemsize: int = 2,
                   kv_itemsize: int | None = None) -> int:
        """Shared memory one program allocates (the output aliases the K ring).

        `kv_itemsize` is the bytes of a stored K/V element when it differs from q's `itemsize`
        (1 for int8 / fp8 codes): the rings then hold codes, and one converted K block and one V
        block in q's dtype plus the f32 scale rows of every slot are added.
        """
        block_kv = self.pages_per_block * page_size
        if kv_itemsize is None or kv_itemsize == itemsize:
            ring = 2 * self.pipeline_depth * block_kv * head_dim * itemsize
            return ring + self.block_h * (head_dim + block_kv) * itemsize + 2048  # + q, p, barriers
        # Counted as the lowering allocates (checked to the byte): each buffer 1024-aligned.
        def aligned(num_bytes):
            return -(-num_bytes // 1024) * 1024

        ring = aligned(self.pipeline_depth * block_kv * head_dim * kv_itemsize)  # K or V codes
        union = aligned(max(ring, self.block_h * (head_dim + 1) * 4))  # f32 output + lse alias K
        converted = 2 * aligned(block_kv * head_dim * itemsize)  # one K and one V block
        scales = 2 * aligned(self.pipeline_depth * block_kv * 4)  # f32 rows, every slot
        q_and_p = aligned(self.block_h * (head_dim + block_kv) * itemsize)
        barriers = 8 * (1 + 2 * self.pipeline_depth)
        return union + ring + converted + scales + q_and_p + barriers + 2048

    def check_shapes(self, head_dim: int, page_size: int, group_size: int, *,
                     kv_itemsize: int | None = None) -> None:
        """Raises ValueError if this config cannot run these (static) sizes (`kv_itemsize` as in
        `smem_bytes`)."""
        if self.pages_per_block * page_size > 256:
            raise ValueError(f"{self.pages_per_block=} * {page_size=} exceeds the wgmma K limit 256")
        if group_size > self.block_h:
            raise ValueError(f"{group_size=} query heads per kv head exceeds {self.block_h=}")
        n = self.smem_bytes(head_dim, page_size, kv_itemsize=kv_itemsize)
        if n > SMEM_LIMIT_BYTES:
            raise ValueError(f"{self} needs {n} bytes of SMEM at {head_dim=}, {page_size=}; "
                             f"the limit is {SMEM_LIMIT_BYTES}")


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One row of the tuned-config table: a shape bucket and the config it runs."""

    head_dim: int
    page_size: int
    max_rows: int  # bucket bound (inclusive) on batch * num_kv_heads, the programs per split
    max_context: int  # bucket bound (inclusive) on max_pages * page_size, in tokens
    config: PagedAttentionConfig


# (head_dim, page_size) -> (pages_per_block, pipeline_depth). Seeded, not yet measured (no GPU in
# the session that wrote it): every block is 128 tokens, the ring holds 2-3 blocks in 122-162 KiB
# of SMEM. experiments/device_check.py times alternatives.
_BLOCKING = {(64, 64): (2, 3), (64, 128): (1, 3), (128, 64): (2, 2), (128, 128): (1, 2)}


def _build_tuned_table() -> tuple[TunedEntry, ...]:
    # Splits aim at >= 2 * NUM_SMS programs with >= 2 blocks per split.
    inf = 2**31 - 1
    context_bounds = (1024, 4096, 16384, inf)
    splits_by_rows = {8: (4, 16, 32, 32), 32: (4, 8, 16, 16), 128: (2, 4, 4, 8),
                      512: (1, 2, 2, 2), inf: (1, 1, 2, 2)}
    return tuple(
        TunedEntry(head_dim, page_size, max_rows, max_context, PagedAttentionConfig(
            num_splits=splits, pages_per_block=pages_per_block, pipeline_depth=depth))
        for (head_dim, page_size), (pages_per_block, depth) in _BLOCKING.items()
        for max_rows, row_splits in splits_by_rows.items()
        for max_context, splits in zip(context_bounds, row_splits))


TUNED_TABLE: tuple[TunedEntry, ...] = _build_tuned_table()


def config_for(batch: int, max_pages: int, num_kv_heads: int, group_size: int, head_dim: int,
               page_size: int) -> PagedAttentionConfig:
    """Returns the tuned config for one shape bucket (all arguments are static sizes).

    Raises:
      ValueError: if the sizes are unsupported by the kernel.
    """
    _check_sizes(head_dim, page_size, group_size)
    rows, context = batch * num_kv_heads, max_pages * page_size
    entry = next(e for e in TUNED_TABLE if (e.head_dim, e.page_size) == (head_dim, page_size)
                 and rows <= e.max_rows and context <= e.max_context)
    num_blocks = -(-max_pages // entry.config.pages_per_block)
    config = dataclasses.replace(entry.config, num_splits=min(entry.config.num_splits, num_blocks))
    config.check_shapes(head_dim, page_size, group_size)
    return config


def deterministic_config(head_dim: int, page_size: int, group_size: int) -> PagedAttentionConfig:
    """The config of deterministic mode: the tuned table's blocking, DETERMINISTIC_SPLIT_TOKENS per
    split whatever the batch or the table width (all arguments are static sizes).

    A split's partial output then depends only on its own sequence's pages, and the merge folds the
    splits left to right, so a sequence's output is bitwise the same in any batch, at any row and
    under any table width (extra trailing splits are empty and skipped). Fewer splits than the
    tuned table gives at a small batch: parallelism is traded for invariance.

    Raises:
      ValueError: if the sizes are unsupported by the kernel.
    """
    _check_sizes(head_dim, page_size, group_size)
    return _deterministic_config(head_dim, page_size)


def _deterministic_config(head_dim: int, page_size: int) -> PagedAttentionConfig:
    """deterministic_config, unchecked (`supports` checks it)."""
    pages_per_block, depth = _BLOCKING[(head_dim, page_size)]
    return PagedAttentionConfig(pages_per_block=pages_per_block, pipeline_depth=depth,
                                pages_per_split=DETERMINISTIC_SPLIT_TOKENS // page_size)


def supports(head_dim: int, page_size: int, group_size: int = 1, *, dtype=None, kv_dtype=None
             ) -> str | None:
    """Why the kernel cannot serve this geometry, or None if it can: the one rule that
    `config_for`, `deterministic_config` and `paged_attention` enforce, and that jaxinfer's
    `jaxinfer.engine.backends.resolve_impl` asks before it picks the kernel. All arguments are static.

    Args:
      head_dim: K. page_size: L, tokens per page. group_size: query heads per kv head.
      dtype: q's dtype (None: not checked). kv_dtype: the stored pages' dtype, q's (None) or
        int8 / float8_e4m3fn codes.
    """
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return (f"needs bfloat16 or float16, got {jnp.dtype(dtype)} (an f32 wgmma would run in "
                "tf32; f32 is served by the jnp reference)")
    if head_dim not in SUPPORTED_HEAD_DIMS or page_size not in SUPPORTED_PAGE_SIZES:
        return (f"{head_dim=} must be in {SUPPORTED_HEAD_DIMS} and {page_size=} in "
                f"{SUPPORTED_PAGE_SIZES}")
    if kv_dtype is not None and jnp.dtype(kv_dtype) not in QUANTIZED_DTYPES + SUPPORTED_DTYPES:
        return (f"stores pages as q's dtype or as {[d.name for d in QUANTIZED_DTYPES]}, "
                f"got {jnp.dtype(kv_dtype)}")
    kv_itemsize = None if kv_dtype is None else jnp.dtype(kv_dtype).itemsize
    configs = [e.config for e in TUNED_TABLE if (e.head_dim, e.page_size) == (head_dim, page_size)]
    for config in (*configs, _deterministic_config(head_dim, page_size)):
        try:
            config.check_shapes(head_dim, page_size, group_size, kv_itemsize=kv_itemsize)
        except ValueError as e:
            return str(e)
    return None


def _check_sizes(head_dim: int, page_size: int, group_size: int = 1, *, dtype=None) -> None:
    """Raises ValueError with `supports`' reason."""
    if (reason := supports(head_dim, page_size, group_size, dtype=dtype)) is not None:
        raise ValueError(reason)


def validate_block_tables(block_tables, num_pages: int, lengths=None, page_size: int | None = None
                          ) -> None:
    """Host-side check of page ids (JAX would clamp an out-of-range id silently).

    Args:
      block_tables: int [B, M] array-like (numpy or a concrete jax array).
      num_pages: pages in the pool; valid ids are 0 .. num_pages - 1 (0 is the null page).
      lengths: optional int [B]; if given with page_size, each must lie in [0, M * page_size].

    Raises:
      ValueError: naming the first offending row and entry.
    """
    table = np.asarray(block_tables)
    bad = np.argwhere((table < 0) | (table >= num_pages))
    if bad.size:
        row, col = bad[0]
        raise ValueError(f"block_tables[{row}, {col}] = {table[row, col]} is out of range for "
                         f"{num_pages=} ({len(bad)} bad entries)")
    if lengths is not None and page_size is not None:
        lens = np.asarray(lengths)
        capacity = table.shape[1] * page_size
        if ((lens < 0) | (lens > capacity)).any():
            row = int(np.argmax((lens < 0) | (lens > capacity)))
            raise ValueError(f"lengths[{row}] = {lens[row]} outside [0, {capacity}] "
                             f"(max_pages={table.shape[1]} * {page_size=})")


def _one_layer(k_pages, v_pages, k_scales, v_scales, layer) -> tuple:
    """Checks that the pages are one layer's [G, P, ...] without `layer` and the whole pool
    [N, G, P, ...] with it (a concrete layer in [0, N)); returns one layer's (k, v, k_scales,
    v_scales) shapes, to check the rest on."""
    expected = 4 if layer is None else 5
    if k_pages.ndim != expected or v_pages.ndim != expected:
        what = ("one layer's [G, P, ...], or the whole pool (5-D) with a layer" if layer is None
                else "the whole pool [N, G, P, ...] when a layer is given")
        raise ValueError(f"pages must be {expected}-D, {what}; got {k_pages.shape=}, "
                         f"{v_pages.shape=}")
    if layer is None:
        return k_pages, v_pages, k_scales, v_scales
    if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < k_pages.shape[0]:
        raise ValueError(f"layer={int(layer)} is out of range for a pool of {k_pages.shape[0]} "
                         "layers")

    def drop_layer_axis(x):
        return None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)

    return tuple(map(drop_layer_axis, (k_pages, v_pages, k_scales, v_scales)))


def _check_inputs(q, k_pages, v_pages, block_tables, lengths, k_scales=None, v_scales=None,
                  layer=None) -> tuple[int, int]:
    """Validates static shapes and dtypes (of one layer's pages: a whole pool's layer axis is
    checked, then dropped); returns (num_kv_heads, group_size)."""
    if q.ndim != 3:
        raise ValueError(f"expected q [B, H, K]; got {q.shape=}")
    k_pages, v_pages, k_scales, v_scales = _one_layer(k_pages, v_pages, k_scales, v_scales, layer)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, _, page_size = k_pages.shape
    if k_pages.shape != (num_kv_heads, num_pages, head_dim, page_size):
        raise ValueError(f"{k_pages.shape=} must be [G, P, K={head_dim}, L] (K transposed per page)")
    if v_pages.shape != (num_kv_heads, num_pages, page_size, head_dim):
        raise ValueError(f"{v_pages.shape=} must be {(num_kv_heads, num_pages, page_size, head_dim)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"{block_tables.shape=} must be [{batch}, M] and {lengths.shape=} [{batch}]")
    if block_tables.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError(f"{block_tables.dtype=} and {lengths.dtype=} must be int32")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{k_pages.dtype=} and {v_pages.dtype=} must match")
    if k_pages.dtype in QUANTIZED_DTYPES:
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is None:
                raise ValueError(f"{name} is required with {k_pages.dtype} pages")
            if scales.shape != (num_kv_heads, num_pages, page_size) or scales.dtype != jnp.float32:
                raise ValueError(f"{name} must be float32 {(num_kv_heads, num_pages, page_size)} "
                                 f"[G, P, L], one scale per token slot; got {scales.shape} "
                                 f"{scales.dtype}")
    else:
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is not None:
                raise ValueError(f"{name} must be None: {k_pages.dtype} pages are not quantized "
                                 f"(quantized pages are {[d.name for d in QUANTIZED_DTYPES]})")
        if q.dtype != k_pages.dtype:
            raise ValueError(f"{q.dtype=}, {k_pages.dtype=} and {v_pages.dtype=} must match")
    return num_kv_heads, num_q_heads // num_kv_heads


def _bind_refs(body, *, quantized: bool, with_lse: bool):
    """Adapts `_paged_attention_kernel` to the refs a kernel really has: None stands for the
    scale inputs and dequant scratch of unquantized pages, and for lse with one split."""
    num_inputs, num_outputs = (9 if quantized else 7), (2 if with_lse else 1)

    def bound(*refs):
        inputs, refs = list(refs[:num_inputs]), refs[num_inputs:]
        outputs, scratch = list(refs[:num_outputs]), list(refs[num_outputs:])
        inputs += [None, None] * (not quantized)
        outputs += [None] * (not with_lse)
        scratch += [None] * (not quantized)
        return body(*inputs, *outputs, *scratch)

    return bound


def _paged_attention_partials(q, k_pool, v_pool, block_tables, lengths, layer, k_scales=None,
                              v_scales=None, *, sm_scale, config, interpret, starts=None, softcap=None):
    """Runs the kernel over layer `layer` (int32 [1]) of the whole pool, k_pool [N, G, P, K, L] and
    v_pool [N, G, P, L, K], read in place. Returns (out [B, G, S, group, K], lse [B, G, S, R] in
    log2 units | None); out is f32 normalized per split when there is an lse, and the final q.dtype
    output when not: one split outside deterministic mode (which always merges, so that one split
    and several take the same path). k_scales / v_scales: f32 [N, G, P, L] with quantized pages,
    else None."""
    batch, _, head_dim = q.shape
    _, num_kv_heads, _, _, page_size = k_pool.shape
    group_size = q.shape[1] // num_kv_heads
    pages_per_block, depth = config.pages_per_block, config.pipeline_depth
    num_splits, pages_per_split = config.split_layout(block_tables.shape[1])
    num_rows, block_kv = config.block_h, pages_per_block * page_size
    quantized = k_scales is not None
    padded_group = -(-group_size // 8) * 8  # the TMA box into the 8-row-tiled q_smem
    q_packed = q.reshape(batch, num_kv_heads, group_size, head_dim)  # [B, G, group, K]
    q_packed = jnp.pad(q_packed, ((0, 0), (0, 0), (0, padded_group - group_size), (0, 0)))
    with_lse = num_splits > 1 or config.deterministic
    out_dtype = jnp.float32 if with_lse else q.dtype
    out_type = [jax.ShapeDtypeStruct(
        (batch, num_kv_heads, num_splits, group_size, head_dim), out_dtype)]
    if with_lse:
        out_type.append(jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, num_rows), jnp.float32))
    smem = functools.partial(plgpu.SMEM, dtype=q.dtype, transforms=_SWIZZLE)
    # The rings hold the pages as stored: codes (64-byte rows of 1-byte codes) when quantized.
    ring = (functools.partial(plgpu.SMEM, dtype=k_pool.dtype, transforms=_SWIZZLE_8BIT)
            if quantized else smem)
    # K and V each arrive as one TMA per page; with quantized pages the K barrier also counts
    # the two scale rows of each page.
    scratch = [
        smem((num_rows, head_dim)),
        ring((depth, block_kv, head_dim)),
        smem((num_rows, block_kv)),
        plgpu.RefUnion(ring((depth, pages_per_block, head_dim, page_size)), (
            plgpu.SMEM((num_rows, head_dim), out_dtype), plgpu.SMEM((num_rows,), jnp.float32))),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages_per_block * (3 if quantized else 1), num_barriers=depth),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=depth),
    ]
    if quantized:
        scratch.append((
            plgpu.SMEM((depth, pages_per_block, page_size), jnp.float32),  # K scale rows
            plgpu.SMEM((depth, block_kv), jnp.float32),  # V scale rows
            smem((pages_per_block, head_dim, page_size)),  # K block converted to q.dtype
            smem((block_kv, head_dim)),  # V block converted to q.dtype
        ))
    body = _bind_refs(functools.partial(
        _paged_attention_kernel, group_size=group_size, pages_per_split=pages_per_split,
        pages_per_block=pages_per_block, pipeline_depth=depth, sm_scale=sm_scale, softcap=softcap),
        quantized=quantized, with_lse=with_lse)
    # A fresh plgpu.kernel per config: a reused kernel can keep its first grid (jax-ml/jax#40847).
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch,
        grid=(num_kv_heads, batch, num_splits), grid_names=("kv_head", "seq", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None)
    scale_inputs = (k_scales, v_scales) if quantized else ()
    starts = jnp.zeros_like(lengths) if starts is None else starts  # [B]: first visible position
    outs = kernel(q_packed, k_pool, v_pool, block_tables, lengths, starts, layer, *scale_inputs)
    return outs[0], (outs[1] if with_lse else None)


def _merge_splits(out, lse):
    """Log-sum-exp merge. out [B, G, S, group, K] f32, lse [B, G, S, R] -> [B, G, group, K] f32."""
    lse = lse[..., : out.shape[3]]  # [B, G, S, group]
    weight = jnp.exp2(lse - lse.max(axis=2, keepdims=True))  # an empty split weighs exactly 0
    return (out * weight[..., None]).sum(axis=2) / weight.sum(axis=2)[..., None]


def _merge_splits_in_order(out, lse):
    """`_merge_splits` as a left-to-right fold over the splits (deterministic mode).

    XLA may reassociate a reduction over the split axis differently for another split count, so
    the sum is a sequential loop instead, and a split of weight 0 (an empty trailing split, or
    one whose weight underflows) is skipped rather than added as +0, which would also turn a
    -0.0 into +0.0. The max is exact in any order. So a sequence's result is the fold over its own
    nonempty splits only, whatever the table width. Shapes as in `_merge_splits`.
    """
    lse = lse[..., : out.shape[3]]  # [B, G, S, group]
    weights = jnp.exp2(lse - lse.max(axis=2, keepdims=True))  # [B, G, S, group]

    def add_split(carry, split):
        total, weight_sum = carry  # [B, G, group, K], [B, G, group]
        split_out, weight = split  # [B, G, group, K], [B, G, group]
        used = weight > 0
        total = jnp.where(used[..., None], total + split_out * weight[..., None], total)
        return (total, jnp.where(used, weight_sum + weight, weight_sum)), None

    # Split 0 holds the first page, so it always counts (a padding row, all weights 1 and zero
    # outputs, merges to 0 at any width).
    first = (out[:, :, 0] * weights[:, :, 0, :, None], weights[:, :, 0])
    rest = (jnp.moveaxis(out[:, :, 1:], 2, 0), jnp.moveaxis(weights[:, :, 1:], 2, 0))  # [S-1, ...]
    (total, weight_sum), _ = lax.scan(add_split, first, rest)
    return total / weight_sum[..., None]


def _as_pool(pages, layer):
    """A page array as a whole pool plus its layer: one layer's pages [G, ...] become a pool of
    one, [1, G, ...] (a free reshape under jit), at layer 0. Returns (pool, int32 [1]) or
    (None, layer) for absent scales."""
    if pages is None:
        return None, layer
    if layer is None:
        return pages[None], jnp.zeros((1,), jnp.int32)
    return pages, jnp.asarray(layer, jnp.int32).reshape(1)


def window_starts(lengths: Int[Array, "B"], window) -> Int[Array, "B"]:
    """First visible position per row: max(length - window, 0); zeros without a window."""
    if window is None:
        return jnp.zeros_like(lengths)
    return jnp.maximum(lengths - jnp.asarray(window, jnp.int32), 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret", "softcap"))
def _paged_attention_jit(q, k_pages, v_pages, block_tables, lengths, layer, k_scales, v_scales,
                         window, *, sm_scale, config, interpret, softcap=None):
    batch, num_q_heads, head_dim = q.shape
    (k_pool, index), (v_pool, _) = _as_pool(k_pages, layer), _as_pool(v_pages, layer)
    (k_scales, _), (v_scales, _) = _as_pool(k_scales, layer), _as_pool(v_scales, layer)
    out, lse = _paged_attention_partials(q, k_pool, v_pool, block_tables, lengths, index, k_scales,
                                         v_scales, sm_scale=sm_scale, config=config,
                                         interpret=interpret, starts=window_starts(lengths, window),
                                         softcap=softcap)
    if lse is None:
        return out.reshape(batch, num_q_heads, head_dim)  # [B, G, 1, group, K] -> [B, H, K]
    merge = _merge_splits_in_order if config.deterministic else _merge_splits
    return merge(out, lse).reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_attention(
    q: Float[Array, "B H K"],
    k_pages: Num[Array, "*N G P K L"],
    v_pages: Num[Array, "*N G P L K"],
    block_tables: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    layer: Int[Array, ""] | int | None = None,
    k_scales: Float[Array, "*N G P L"] | None = None,
    v_scales: Float[Array, "*N G P L"] | None = None,
    window: Int[Array, ""] | int | None = None,
    sm_scale: float | None = None,
    softcap: float | None = None,
    config: PagedAttentionConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "B H K"]:
    """Decode attention of one query token per sequence over a paged KV cache (Mosaic GPU).

    Args:
      q: queries; head h attends with kv head h // (H // G). bf16 or f16.
      k_pages: K pool, transposed per page. v_pages: V pool. Either q's dtype, or int8 /
        float8_e4m3fn codes (both the same), dequantized per token slot with the scales below.
        Either one layer's pages [G, P, ...], or the whole pool [N, G, P, ...] with `layer`.
      block_tables: int32 page ids per sequence, padded with page 0 (the null page).
      lengths: int32 valid tokens per sequence, in [0, M * L]; 0 gives a zero output row.
      layer: with a whole pool, the layer to attend over (an int32 scalar, traced or not): the
        kernel reads that layer's pages in place, so no [G, P, ...] slice of the pool is made.
      k_scales, v_scales: f32 [(N,) G, P, L] (as the pages), given exactly when the pages are
        quantized: the key of slot l of page p, kv head g is `k_pages[g, p, :, l] *
        k_scales[g, p, l]` and its value `v_pages[g, p, l, :] * v_scales[g, p, l]`.
      window: None, or a sliding window W >= 1 (an int32 scalar, traced or not): a row sees only
        its last W tokens, positions [length - W, length); entries of pages wholly before them
        are not read (the null page may stand there).
      sm_scale: static softmax scale; default 1 / sqrt(K).
      softcap: static attention soft-cap c > 0, or None: each scaled score s becomes
        c * tanh(s / c) before the mask (Gemma 2). The kernel's tanh is the approximate one.
      config: static kernel knobs; default `config_for(...)` of these shapes. Pass
        `deterministic_config(...)` for a result independent of the batch and the table width.
      interpret: False on GPU; an `InterpretGPUParams` (or True) runs the GPU interpreter on CPU.

    Returns:
      [B, H, K] in q.dtype. Accumulation and softmax statistics are f32.

    Raises:
      ValueError: bad shapes, dtypes, scales, layer or config, or (for concrete inputs) an
        out-of-range page id, length or layer. Under an outer jit the ids are traced, so the
        caller must run `validate_block_tables` on the host first.
    """
    num_kv_heads, group_size = _check_inputs(q, k_pages, v_pages, block_tables, lengths,
                                             k_scales, v_scales, layer)
    batch, _, head_dim = q.shape
    num_pages, page_size = k_pages.shape[-3], k_pages.shape[-1]
    _check_sizes(head_dim, page_size, dtype=q.dtype)
    if not isinstance(block_tables, jax.core.Tracer) and not isinstance(lengths, jax.core.Tracer):
        validate_block_tables(block_tables, num_pages, lengths, page_size)
    if config is None:
        config = config_for(batch, block_tables.shape[1], num_kv_heads, group_size, head_dim,
                            page_size)
    config.check_shapes(head_dim, page_size, group_size, kv_itemsize=k_pages.dtype.itemsize)
    config.split_layout(block_tables.shape[1])  # raises if a fixed split size needs too many splits
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    softcap = _check_softcap(softcap)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    return _paged_attention_jit(q, k_pages, v_pages, block_tables, lengths, layer, k_scales,
                                v_scales, window, sm_scale=sm_scale, config=config,
                                interpret=interpret, softcap=softcap)


def paged_attention_reference(
    q: Float[Array, "B H K"],
    k_pages: Num[Array, "*N G P K L"],
    v_pages: Num[Array, "*N G P L K"],
    block_tables: Int[Array, "B M"],
    lengths: Int[Array, "B"],
    *,
    layer: Int[Array, ""] | int | None = None,
    k_scales: Float[Array, "*N G P L"] | None = None,
    v_scales: Float[Array, "*N G P L"] | None = None,
    window: Int[Array, ""] | int | None = None,
    sm_scale: float | None = None,
    softcap: float | None = None,
    config: PagedAttentionConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "B H K"]:
    """Pure-jnp paged decode attention in f32; the same contract as `paged_attention`.

    Gathers each sequence's pages (and, for quantized pages, their scale rows) through its block
    table, from layer `layer` of a whole pool, dequantizes on read in f32, and masks positions
    >= length and, with a window, < length - window (scores with MASK_VALUE, V with zeros, so
    stale or released pages and scales may hold anything).
    Any float q dtype; `config` and `interpret` are accepted for signature parity and ignored.
    Out-of-range page ids are clamped by the gather: validate on the host first.
    """
    del config, interpret
    _check_inputs(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, layer)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return _reference_jit(q, k_pages, v_pages, block_tables, lengths, layer, k_scales, v_scales,
                          window, sm_scale=scale, softcap=_check_softcap(softcap))


def _check_softcap(softcap: float | None) -> float | None:
    """The soft-cap as a float, or None; a ValueError naming it unless finite and > 0."""
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    return None if softcap is None else float(softcap)


@functools.partial(jax.jit, static_argnames=("sm_scale", "softcap"))
def _reference_jit(q, k_pages, v_pages, block_tables, lengths, layer, k_scales, v_scales, window,
                   *, sm_scale, softcap=None):
    if layer is not None:  # the oracle may slice: one layer of the pool [N, G, ...]
        k_pages, v_pages = k_pages[layer], v_pages[layer]
        if k_scales is not None:
            k_scales, v_scales = k_scales[layer], v_scales[layer]
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, group_size = k_pages.shape[0], num_q_heads // k_pages.shape[0]
    max_pages, page_size = block_tables.shape[1], k_pages.shape[-1]
    hi = lax.Precision.HIGHEST  # true f32 on GPU too (the default may use tf32)
    q_grouped = q.reshape(batch, num_kv_heads, group_size, head_dim).astype(jnp.float32)
    k = k_pages[:, block_tables].astype(jnp.float32)  # [G, B, M, K, L]
    v = v_pages[:, block_tables].astype(jnp.float32)  # [G, B, M, L, K]
    if k_scales is not None:  # dequantize on read: one scale per (kv head, page, token slot)
        k = k * k_scales[:, block_tables][:, :, :, None, :]  # [G, B, M, 1, L]
        v = v * v_scales[:, block_tables][..., None]  # [G, B, M, L, 1]
    scores = jnp.einsum("bgqk,gbmkl->bgqml", q_grouped, k, precision=hi) * sm_scale
    if softcap is not None:  # c * tanh(s / c), before the mask
        scores = softcap * jnp.tanh(scores / softcap)
    scores = scores.reshape(batch, num_kv_heads, group_size, max_pages * page_size)  # [B,G,q,S]
    slots = jnp.arange(max_pages * page_size)[None, :]  # [1, S]
    valid = (slots < lengths[:, None]) & (slots >= window_starts(lengths, window)[:, None])  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).reshape(
        batch, num_kv_heads, group_size, max_pages, page_size)  # [B, G, q, M, L]
    # Zero V past the length too: a 0 probability times a NaN in a stale page is still NaN.
    v = jnp.where(valid.reshape(1, batch, max_pages, page_size, 1), v, 0.0)
    out = jnp.einsum("bgqml,gbmlk->bgqk", probs, v, precision=hi)  # [B, G, q, K]
    out = jnp.where(lengths[:, None, None, None] > 0, out, 0.0)  # padding rows: zeros
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
