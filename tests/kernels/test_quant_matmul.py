"""The CPU quantized-matmul kernel (kernels_cpu/quant_matmul): int8, Q8_0, Q4_0 and Q4_1 weights
packed as unsigned codes with a scale and offset per block of 32 (panels.to_quant_panels), times activations
quantized per block of 32 in the kernel. Checked three ways: the kernel against its jnp reference on the
same packed arrays; the reference against a numpy int64 transcription of the arithmetic on the GGUF file's
own block bytes (so the packing is checked too). End to end, an engine on matmul_impl='cpu_int8' against the
same int8 weights multiplied in f32 is tests/test_int8_dot.py's, beside XLA's W8A8. Also quantization='auto'
(backends.resolve_quantization), which keeps a GGUF's blocks for this kernel."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType, quants

from jaxinfer.model import panels, quant
from jaxinfer.engine import tuning
from jaxinfer.engine.backends import Impls, resolve_matmul_impl, resolve_quantization
from jaxinfer.model.params import dense_params
from kernels_cpu import quant_matmul

GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}


pytestmark = pytest.mark.usefixtures("cpu_kernels")  # conftest.require_cpu_kernels: builds this kernel too


def _quantized(fmt: str, w: np.ndarray) -> tuple[quant.QuantizedTensor, np.ndarray | None]:
    """w [*lead, O, I] in `fmt` (Params layout in_out), and the GGUF block bytes it came from (None for int8)."""
    if fmt == "int8":
        return quant.quantize_int8(jnp.asarray(w), layout="in_out"), None
    blocks = quants.quantize(w, GGUF_TYPES[fmt])
    return jax.tree.map(jnp.asarray, quant.from_gguf(blocks, GGUF_TYPES[fmt], layout="in_out")), blocks


def _activations(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape) * rng.uniform(0.1, 10, (shape[0], 1))
    x[:, 3] *= 30  # an outlier channel
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 6, 13])  # the kernel's row tiles are 4: whole tiles and every remainder
def test_kernel_is_its_reference_on_every_format_and_layer(fmt, rows):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (3, 80, 192)).astype(np.float32)  # 80 columns: padded to 96, three panel pairs
    q, _ = _quantized(fmt, w)
    packed = panels.to_quant_panels(q)
    x = jnp.asarray(_activations(rng, (rows, 192)))
    for layer in (0, 2):
        ours = np.asarray(quant_matmul.quant_matmul(x, packed.codes, packed.scale, packed.offset, jnp.int32(layer), zero_point=packed.zero_point))
        expected = np.asarray(quant_matmul.reference(x, packed.codes, packed.scale, packed.offset, jnp.int32(layer), zero_point=packed.zero_point))
        assert ours.shape == (rows, 96)
        assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
        assert not ours[:, 80:].any()  # the padding columns are zero weights
        dense = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(q), np.float64)[layer]  # the error W8A8 adds
        assert 1e-4 < np.linalg.norm(ours[:, :80] - dense) / np.linalg.norm(dense) < 0.02


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [4, 16, 17])  # up to 16 rows, 4-bit tiles go in runs of 4 with a prefetch
def test_runs_of_column_tiles_cover_every_column(fmt, rows):
    """Nine column tiles: at decode's few rows of 4-bit codes two runs of four and one of one (the prefetch of
    a run's last tile would read past it), one tile a task otherwise; every column against the reference."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (2, 288, 64)).astype(np.float32)  # 288 columns: 18 panels, 9 tiles of two
    q, _ = _quantized(fmt, w)
    packed = panels.to_quant_panels(q)
    x = jnp.asarray(_activations(rng, (rows, 64)))
    ours = np.asarray(quant_matmul.quant_matmul(x, packed.codes, packed.scale, packed.offset, jnp.int32(1), zero_point=packed.zero_point))
    expected = np.asarray(quant_matmul.reference(x, packed.codes, packed.scale, packed.offset, jnp.int32(1), zero_point=packed.zero_point))
    assert ours.shape == (rows, 288)
    per_column = np.abs(ours - expected).max(axis=0) / np.abs(expected).max()
    assert per_column.max() <= 1e-5, np.flatnonzero(per_column > 1e-5)


def _numpy_block_w8a8(x: np.ndarray, fmt: str, blocks: np.ndarray) -> np.ndarray:
    """x [T, I] times a GGUF tensor's raw blocks [O, I/32 * bytes], by hand: each block of 32 of x rounded to
    int8 with scale max|x| / 127, an int64 dot with the block's integer codes, then the scales (and Q4_1's
    min times the sum of x's codes) in float64."""
    out_dim = blocks.shape[0]
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    raw = blocks.reshape(out_dim, -1, size)
    d = raw[..., :2].copy().view("<f2")[..., 0].astype(np.float64)  # [O, B]
    if fmt == "q8_0":
        codes, mins = raw[..., 2:].copy().view(np.int8).astype(np.int64), np.zeros_like(d)
    else:
        nib = raw[..., size - 16:].astype(np.int64)
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # element j: low nibble of byte j, j + 16: high
        mins = raw[..., 2:4].copy().view("<f2")[..., 0].astype(np.float64) if fmt == "q4_1" else np.zeros_like(d)
        codes = codes - (8 if fmt == "q4_0" else 0)
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1)  # [T, B]
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.clip(np.round(xb * inverse[..., None]), -127, 127).astype(np.int64)
    sx = (amax / np.float32(127)).astype(np.float64)
    dots = np.einsum("tbk,obk->tob", xq, codes).astype(np.float64)  # exact integers
    return np.einsum("tob,ob,tb->to", dots, d, sx) + np.einsum("ob,tb->to", mins, sx * xq.sum(-1))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_packed_blocks_multiply_as_the_files_bytes_say(fmt):
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (64, 256)).astype(np.float32)
    q, blocks = _quantized(fmt, w)
    packed = jax.tree.map(lambda leaf: leaf[None], panels.to_quant_panels(q))
    x = _activations(rng, (5, 256))
    ours = np.asarray(quant_matmul.quant_matmul(jnp.asarray(x), packed.codes, packed.scale, packed.offset, jnp.int32(0), zero_point=packed.zero_point), np.float64)
    expected = _numpy_block_w8a8(x, fmt, blocks)
    assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0"])
@pytest.mark.parametrize("rows", [1, 7])
def test_symmetric_form_is_the_offset_form(fmt, rows):
    """The symmetric formats keep no offsets (w = (code - zero_point) * scale, subtracted in int32 by the
    kernel); the same codes with offsets -zero_point * scale through the general form give the same sums."""
    rng = np.random.default_rng(3)
    q, _ = _quantized(fmt, rng.normal(0, 0.05, (2, 64, 128)).astype(np.float32))
    packed = panels.to_quant_panels(q)
    assert packed.offset is None and packed.zero_point == quant.affine_zero_point(fmt) == (8 if fmt == "q4_0" else 128)
    offset = (-packed.zero_point * packed.scale.astype(jnp.float32)).astype(jnp.float16)
    x = jnp.asarray(_activations(rng, (rows, 128)))
    symmetric = np.asarray(quant_matmul.quant_matmul(x, packed.codes, packed.scale, None, jnp.int32(1), zero_point=packed.zero_point))
    general = np.asarray(quant_matmul.quant_matmul(x, packed.codes, packed.scale, offset, jnp.int32(1)))
    assert np.abs(symmetric - general).max() <= 1e-5 * np.abs(general).max()
    assert panels.to_quant_panels(_quantized("q4_1", rng.normal(0, 0.05, (64, 128)).astype(np.float32))[0]).offset is not None


def test_affine_form_is_the_dequantized_weight():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (2, 32, 64)).astype(np.float32)
    for fmt in ("int8", "q8_0", "q4_0", "q4_1"):
        q, _ = _quantized(fmt, w)
        codes, scale, offset = quant.affine_blocks(q)  # [L, O, I], [L, O, I/32]
        values = np.asarray(codes, np.float64).reshape(2, 32, 2, 32) * np.asarray(scale, np.float64)[..., None] + np.asarray(offset, np.float64)[..., None]
        dense = np.swapaxes(np.asarray(quant.dequantize(q), np.float64), -1, -2)
        if fmt == "int8":  # an f32 scale times a 128-shifted code: exact in float64, within an f32 rounding of the codes' value
            np.testing.assert_allclose(values.reshape(2, 32, 64), dense, rtol=1e-6, atol=0)
        else:  # fp16 scales and minimums: every term exact
            np.testing.assert_array_equal(values.reshape(2, 32, 64), dense)
    with pytest.raises(ValueError, match="affine_blocks"):
        quant.affine_blocks(quant.quantize_int4(jnp.asarray(w[0])))


def test_cpu_int8_without_quantized_weights_or_in_bf16_is_refused():
    with pytest.raises(ValueError, match="quantization='int8'"):
        resolve_matmul_impl("cpu_int8", "cpu", dtype="float32", on_mesh=False, affine_weights=False)
    with pytest.raises(ValueError, match="float32"):
        resolve_matmul_impl("cpu_int8", "cpu", dtype="bfloat16", on_mesh=False, affine_weights=True)
    assert resolve_matmul_impl("cpu_int8", "reference", dtype="float32", on_mesh=False, affine_weights=True) == "cpu_int8"


def test_cpu_int8_is_a_candidate_exactly_where_the_kernel_reads_the_weights():
    offered = lambda **kinds: {c.matmul_impl for c in tuning.default_candidates(Impls(), "cpu", **kinds)}  # noqa: E731
    assert "cpu_int8" in offered(affine_weights=True) and "cpu_int8" not in offered(affine_weights=False)
    assert "cpu_int8" not in {c.matmul_impl for c in tuning.default_candidates(Impls(), "gpu", affine_weights=True)}
    q4 = jax.tree.map(jnp.asarray, quant.from_gguf(quants.quantize(np.ones((32, 64), np.float32), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0))
    assert panels.has_affine_weights({"w": q4}) and not quant.has_int8_weights({"w": q4})


# ------------------------------------------------------------------ quantization="auto" (backends.resolve_quantization)


@pytest.fixture(scope="module")
def smollm2_kept():
    from jaxinfer.loading import loading

    return loading.load_model(None, quantization="gguf", max_context=2048)


def test_dense_params_of_kept_blocks_are_the_dense_load_bit_for_bit(smollm2_kept, smollm2):
    """What the tuner's non-kernel candidates run under quantization='auto' is exactly the dense load."""
    dense = dense_params(smollm2_kept[1])
    ours, theirs = jax.tree_util.tree_leaves_with_path(dense), jax.tree_util.tree_leaves_with_path(smollm2[1])
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_auto_keeps_a_gguf_s_blocks_only_where_the_kernel_may_run(monkeypatch, tiny_chat_model):
    from jaxinfer.loading import loading

    gguf_file = loading.default_model_path()
    assert resolve_quantization("auto", gguf_file, Impls()) == "gguf"
    assert resolve_quantization("auto", tiny_chat_model, Impls()) is None  # a Hugging Face folder
    assert resolve_quantization("auto", gguf_file, Impls(dtype="bfloat16")) is None  # the kernel computes in f32
    assert resolve_quantization("auto", gguf_file, Impls(matmul_impl="cpu")) is None
    assert resolve_quantization("auto", gguf_file, Impls(), on_mesh=True) is None
    assert resolve_quantization(None, gguf_file, Impls()) is None and resolve_quantization("int8", gguf_file, Impls()) == "int8"
    # nothing measured (JAXINFER_TUNE=0): dense, as before, unless the kernel is pinned
    assert resolve_quantization("auto", gguf_file, Impls(), tuning=False) is None
    assert resolve_quantization("auto", gguf_file, Impls(matmul_impl="cpu_int8"), tuning=False) == "gguf"
    # an explicit float32 means f32 compute: no W8A8 kernel unless the matmul is pinned to it
    assert resolve_quantization("auto", gguf_file, Impls(dtype="float32")) is None


def test_auto_runs_kept_blocks_dense_unless_the_choice_is_the_kernel(smollm2_kept):
    cfg, params = smollm2_kept
    from jaxinfer.config import EngineConfig

    kernel = Impls("float32", "cpu", "cpu_int8")
    _, kept, engine_cfg = tuning.apply_choice(kernel, cfg, params, EngineConfig(), "auto")
    assert isinstance(kept.layers.wq, quant.QuantizedTensor) and engine_cfg.matmul_impl == "cpu_int8"
    _, dense, _ = tuning.apply_choice(Impls("float32", "cpu", "cpu"), cfg, params, EngineConfig(), "auto")
    assert not any(isinstance(leaf, quant.QuantizedTensor) for leaf in jax.tree.leaves(dense, is_leaf=lambda leaf: isinstance(leaf, quant.QuantizedTensor)))
    _, still_kept, _ = tuning.apply_choice(Impls("float32", "cpu", "cpu"), cfg, params, EngineConfig(), "gguf")
    assert isinstance(still_kept.layers.wq, quant.QuantizedTensor)  # an explicit gguf is never densified
    kinds = tuning.weight_kinds(params, auto_weights=True)
    assert kinds == {"int8_weights": False, "affine_weights": True}  # XLA's W8A8 would run on the dense copy: not offered


def test_params_given_to_from_params_keep_their_format(smollm2_kept, smollm2_tokenizer):
    """LLM.from_params runs quantized params as they are: 'auto' densifies only what LLM(path) loaded for it."""
    from jaxinfer import LLM

    llm = LLM.from_params(*smollm2_kept, smollm2_tokenizer, max_context=128, page_size=16, max_num_seqs=2, warmup=False)
    assert isinstance(llm.engine.params.layers.wq, quant.QuantizedTensor)
