"""jaxinfer.model.quant: kept GGUF blocks dequantize bit for bit like gguf.quants; int8/int4 error bounds;
qeinsum/take equal the dense ops; resident bytes are measured from the device buffers."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.loading import loading
from jaxinfer.model import quant
from tolerances import assert_close

QT = gguf.GGMLQuantizationType
QUANTIZABLE = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)  # gguf.quants.quantize supports these
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)  # gguf can only dequantize these: blocks are built byte-wise
FP16_OFFSETS = {  # byte offsets of the fp16 scales (d, and dmin/m where present) inside one block
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
dequantize_jit = jax.jit(quant.dequantize)


def random_blocks(qtype, rows: int, num_blocks: int, seed: int) -> np.ndarray:
    """Valid blocks of any kept type: random code and sub-scale bytes, fp16 scales ~N(0, 1e-2) with some
    fp16 subnormals. uint8 [rows, num_blocks * type_size], as GGUFReader gives a tensor's data."""
    rng = np.random.default_rng(seed)
    _, _, type_size = quant.GGUF_KEPT_TYPES[int(qtype)]
    blocks = rng.integers(0, 256, size=(rows, num_blocks, type_size), dtype=np.uint8)
    for offset in FP16_OFFSETS[qtype]:
        scale = rng.standard_normal((rows, num_blocks)) * 1e-2
        scale[:, ::5] *= 1e-4  # below 2**-14: fp16 subnormals
        blocks[..., offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, num_blocks, 2)
    return blocks.reshape(rows, num_blocks * type_size)


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory):
    """One GGUF file written with the gguf package: per kept type, a quantized random matrix (types gguf
    can quantize) and random blocks (every type); read back with GGUFReader."""
    path = tmp_path_factory.mktemp("quant") / "synthetic.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for qtype in QUANTIZABLE:
        weights = rng.standard_normal((48, 256)).astype(np.float32) * 0.05
        weights[3] = 0.0  # an all-zero row: scale 0
        writer.add_tensor(f"quantized.{qtype.name}", gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    for qtype in QUANTIZABLE + K_QUANTS:
        writer.add_tensor(f"random.{qtype.name}", random_blocks(qtype, rows=24, num_blocks=3, seed=int(qtype)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_kept_type_table_matches_gguf_constants():
    for type_id, (name, block_size, type_size) in quant.GGUF_KEPT_TYPES.items():
        assert QT(type_id).name.lower() == name
        assert gguf.GGML_QUANT_SIZES[QT(type_id)] == (block_size, type_size)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_gguf_cannot_quantize_k_quants_so_their_blocks_are_built_bytewise(qtype):
    with pytest.raises(NotImplementedError):
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)


SYNTHETIC = [f"quantized.{t.name}" for t in QUANTIZABLE] + [f"random.{t.name}" for t in QUANTIZABLE + K_QUANTS]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_kept_dequantize_equals_gguf_bitwise_on_synthetic_tensor(synthetic_gguf, name):
    tensor = synthetic_gguf[name]
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    kept = quant.from_gguf(tensor.data, tensor.tensor_type)
    actual = np.asarray(dequantize_jit(jax.device_put(kept)))
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    diff = actual.view(np.int32) != expected.view(np.int32)
    assert not diff.any(), f"{name}: {diff.sum()} of {diff.size} values differ, max {np.abs(actual - expected).max():.3g}"


def _element_scales(kept: quant.QuantizedTensor) -> np.ndarray:
    """f64 scale of every element [O, I], from the kept fields (the test's own broadcast)."""
    if kept.format in ("q4_k", "q5_k", "q6_k"):
        sub = np.asarray(kept.scales, np.float64).repeat(kept.group_size, axis=-1)
        return sub * np.asarray(kept.super_scales, np.float64).repeat(256, axis=-1)
    return np.asarray(kept.scales, np.float64).repeat(32, axis=-1)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
def test_every_product_is_exact_so_fma_cannot_change_a_bit(qtype):
    """scale x code is exact in f32 and the whole value equals one rounding of scale x code + min:
    exactly what an FMA computes, so contracting the multiply-add (GPU) leaves every bit as it is."""
    kept = quant.from_gguf(random_blocks(qtype, rows=16, num_blocks=2, seed=7), qtype)
    no_min = {} if kept.mins is None else {"mins": np.zeros_like(kept.mins)}
    unit = {name: np.ones_like(getattr(kept, name)) for name in ("scales", "super_scales") if getattr(kept, name) is not None}
    codes = np.asarray(dequantize_jit(dataclasses.replace(kept, **unit, **no_min)), np.float64)
    exact_products = _element_scales(kept) * codes  # f64: exact (<= 24 significant bits)
    products = np.asarray(dequantize_jit(dataclasses.replace(kept, **no_min)))
    assert np.array_equal(products.astype(np.float64), exact_products), "a scale x code product rounded in f32"
    if kept.mins is not None:
        if kept.format in ("q4_1", "q5_1"):
            minimum = np.asarray(kept.mins, np.float64).repeat(32, axis=-1)
        else:  # K-quants subtract dmin * m
            minimum = -np.asarray(kept.mins, np.float64).repeat(32, axis=-1) * np.asarray(kept.super_mins, np.float64).repeat(256, axis=-1)
        once_rounded = (exact_products + minimum).astype(np.float32)
        assert np.array_equal(np.asarray(dequantize_jit(kept)), once_rounded)


@pytest.fixture(scope="module")
def embedded_tensors():
    reader = loading.open_gguf(loading.default_model_path())
    return {t.name: t for t in reader.tensors}


def test_every_tensor_of_embedded_model_kept_equals_gguf_bitwise(embedded_tensors):
    checked, file_bytes, resident = 0, 0, 0
    for tensor in embedded_tensors.values():
        if int(tensor.tensor_type) not in quant.GGUF_KEPT_TYPES:
            assert tensor.tensor_type in (QT.F32, QT.F16, QT.BF16), f"{tensor.name}: {tensor.tensor_type.name} not kept"
            continue
        kept = jax.device_put(quant.from_gguf(tensor.data, tensor.tensor_type))
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        actual = np.asarray(dequantize_jit(kept))
        assert np.array_equal(actual.view(np.int32), expected.view(np.int32)), f"{tensor.name} ({tensor.tensor_type.name}) differs"
        checked, file_bytes, resident = checked + 1, file_bytes + int(tensor.n_bytes), resident + quant.resident_bytes(kept)
    assert checked == 211  # 210 Q4_1 + the Q8_0 embedding
    assert resident == file_bytes, f"kept model holds {resident} bytes, its blocks are {file_bytes}"


def test_resident_bytes_of_q4_1_tensor_equal_its_file_block_bytes(embedded_tensors):
    tensor = embedded_tensors["blk.0.ffn_down.weight"]
    assert tensor.tensor_type == QT.Q4_1
    kept = jax.device_put(quant.from_gguf(tensor.data, tensor.tensor_type))
    dense = dequantize_jit(kept)
    assert quant.resident_bytes(kept) <= 1.03 * tensor.n_bytes  # 20 bytes per 32 weights: codes 16, d 2, m 2
    assert quant.resident_bytes(kept) * 6.4 == quant.resident_bytes(dense)  # 5 bits vs 32 per weight


def test_resident_bytes_measures_buffers_not_nbytes():
    packed = jnp.zeros((512, 512), jnp.int4)
    if jax.default_backend() == "cpu":  # measured: the CPU backend holds int4 two per byte
        assert packed.nbytes == 512 * 512 and quant.resident_bytes(packed) == 512 * 512 // 2
    shared = jnp.ones((256,), jnp.float32)
    assert quant.resident_bytes({"a": shared, "b": shared, "c": None}) == 1024  # one buffer, counted once
    with pytest.raises(TypeError, match="host numpy"):
        quant.resident_bytes(np.ones(3))


@pytest.mark.parametrize("source_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_int8_round_trip_within_half_a_scale(source_dtype):
    w = (jax.random.normal(jax.random.key(0), (96, 320)) * jnp.linspace(0.01, 3.0, 96)[:, None]).astype(source_dtype)
    w = w.at[5].set(0)
    kept = quant.quantize_int8(w)
    w32 = np.asarray(w.astype(jnp.float32))
    scale = np.asarray(kept.scales)  # [O, 1]
    assert kept.codes.dtype == jnp.int8 and kept.codes.shape == (96, 320) and scale.shape == (96, 1)
    # XLA turns "/ 127" into "* (1 / 127)", so the scale may sit one ulp off max|w| / 127
    np.testing.assert_allclose(scale, np.abs(w32).max(-1, keepdims=True) / np.float32(127), rtol=2**-23, atol=0)
    assert np.abs(np.asarray(kept.codes)).max(-1)[np.arange(96) != 5].min() == 127  # the row maximum hits +-127
    error = np.abs(w32 - np.asarray(dequantize_jit(kept)))
    # round to nearest: |w/s - code| <= 1/2, plus f32 rounding of w/s and code * s (each <= 127 * 2**-24 s)
    assert (error <= scale * (0.5 + 2e-5)).all(), f"max error / scale {(error / np.where(scale == 0, 1, scale)).max():.6f}"
    assert (error[5] == 0).all()


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
@pytest.mark.parametrize("group_size", quant.INT4_GROUP_SIZES)
def test_int4_round_trip_within_half_a_scale(group_size, symmetric):
    w = jax.random.normal(jax.random.key(1), (40, 512)) * 0.1
    w = w.at[0, :].add(1.0)  # an all-positive row: the zero-point range must still cover it
    w = w.at[1, :].set(0.0)
    kept = quant.quantize_int4(w, group_size=group_size, symmetric=symmetric)
    groups = np.asarray(w).reshape(40, -1, group_size)
    scale = np.asarray(kept.scales.astype(jnp.float32))  # [O, I/g]
    assert kept.codes.dtype == jnp.uint8 and kept.codes.shape == (40, 256), "two codes per byte"
    assert kept.scales.dtype == jnp.bfloat16 and scale.shape == (40, 512 // group_size)
    if symmetric:
        needed = np.abs(groups).max(-1) / 7
    else:
        needed = (np.maximum(groups.max(-1), 0) - np.minimum(groups.min(-1), 0)) / 15
        assert 0 <= np.asarray(kept.zero_points).min() and np.asarray(kept.zero_points).max() <= 15
    assert (scale >= needed * (1 - 2**-22)).all() and (scale <= needed * (1 + 2**-7)).all(), "scale rounds up by at most one bf16 step"
    error = np.abs(groups - np.asarray(dequantize_jit(kept)).reshape(groups.shape))
    assert (error <= scale[..., None] * (0.5 + 1e-5)).all(), f"max error / scale {(error / np.maximum(scale, 1e-30)[..., None]).max():.4f}"
    assert (error[1] == 0).all()


def test_int4_rejects_other_group_sizes():
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_int4(jnp.ones((4, 96)), group_size=48)


def test_qeinsum_equals_dense_einsum_in_params_layouts(embedded_tensors):
    """wq-style [D, H, K] and wo-style [H, K, D] (in_out), a kept GGUF tensor and int8/int4."""
    h, k, d = 4, 16, 96
    x = jax.random.normal(jax.random.key(2), (2, 3, d))
    w_q = jax.random.normal(jax.random.key(3), (h * k, d)) * 0.1  # [out, in], as GGUF and HF store it
    w_o = jax.random.normal(jax.random.key(4), (d, h * k)) * 0.1
    cases = [
        ("btd,dhk->bthk", x, quant.quantize_int4(w_q, group_size=32, out_shape=(h, k), layout="in_out")),
        ("btd,dhk->bthk", x, quant.quantize_int8(w_q, out_shape=(h, k), layout="in_out")),
        ("bthk,hkd->btd", x.reshape(2, 3, 6, 16)[..., :h, :], quant.quantize_int4(w_o, group_size=64, symmetric=False, in_shape=(h, k), layout="in_out")),
    ]
    tensor = embedded_tensors["blk.0.attn_k.weight"]  # Q4_1 [192, 576] -> wk [D, G, K] = [576, 3, 64]
    kept = jax.device_put(quant.from_gguf(tensor.data, tensor.tensor_type, out_shape=(3, 64), layout="in_out"))
    cases.append(("btd,dgk->btgk", jax.random.normal(jax.random.key(5), (2, 3, 576)), kept))
    qeinsum = jax.jit(quant.qeinsum, static_argnums=0)
    for spec, activations, weight in cases:
        dense = dequantize_jit(weight)
        assert dense.shape == weight.shape
        expected = jnp.einsum(spec, activations, dense, precision="highest")
        assert_close(qeinsum(spec, activations, weight), expected, 1e-6, what=f"{spec} {weight.format}")
    assert jnp.array_equal(dequantize_jit(cases[0][2]), dequantize_jit(dataclasses.replace(cases[0][2], layout="out_in")).reshape(h, k, d).transpose(2, 0, 1))


def test_qeinsum_scans_over_stacked_layers_like_a_dense_weight():
    """Stacked [N, ...] quantized weights ride through lax.scan: each step gets one layer's codes."""
    layers = [quant.quantize_int4(jax.random.normal(jax.random.key(i), (64, 32)), layout="in_out") for i in range(3)]
    stacked = jax.device_put(quant.stack([jax.tree.map(np.asarray, q) for q in layers]))
    assert stacked.shape == (3, 32, 64) and stacked.codes.shape == (3, 64, 16)
    x = jax.random.normal(jax.random.key(9), (5, 32))

    def body(h, w):
        return jnp.tanh(quant.qeinsum("td,df->tf", h, w))[:, :32], None

    scanned, _ = jax.lax.scan(body, x, stacked)
    expected = x
    for q in layers:
        expected = jnp.tanh(jnp.einsum("td,df->tf", expected, dequantize_jit(q), precision="highest"))[:, :32]
    assert_close(scanned, expected, 1e-5, what="scan over stacked int4 layers")


def test_qeinsum_rejects_implicit_specs():
    w = quant.quantize_int8(jnp.ones((8, 4)), layout="in_out")
    with pytest.raises(ValueError, match="explicit spec"):
        quant.qeinsum("...d,df", jnp.ones((2, 4)), w)


def test_take_gathers_rows_bitwise_like_the_dense_table(embedded_tensors):
    tensor = embedded_tensors["token_embd.weight"]  # Q8_0 [V, D]
    kept = jax.device_put(quant.from_gguf(tensor.data, tensor.tensor_type))
    tokens = jnp.asarray([[0, 1, 49151], [17, 17, 2024]], jnp.int32)
    rows = np.asarray(jax.jit(quant.take)(kept, tokens))
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)[np.asarray(tokens)]
    assert rows.shape == (2, 3, 576) and np.array_equal(rows, expected)


def test_permute_out_and_stack_act_on_rows_of_every_field():
    blocks = random_blocks(QT.Q5_K, rows=8, num_blocks=1, seed=3)
    kept = quant.from_gguf(blocks, QT.Q5_K)
    order = np.asarray([3, 0, 7, 1, 2, 6, 5, 4])
    assert np.array_equal(dequantize_jit(quant.permute_out(kept, order)), dequantize_jit(kept)[order])
    stacked = quant.stack([kept, quant.permute_out(kept, order)])
    assert stacked.shape == (2, 8, 256) and np.array_equal(dequantize_jit(stacked)[1], dequantize_jit(kept)[order])


def test_from_gguf_rejects_unkept_types_and_torn_rows():
    with pytest.raises(ValueError, match="not a kept quantized format"):
        quant.from_gguf(np.zeros((2, 8), np.uint8), QT.F32)
    with pytest.raises(ValueError, match="q4_1"):
        quant.from_gguf(np.zeros((2, 30), np.uint8), QT.Q4_1)
    with pytest.raises(ValueError, match="factor"):
        quant.from_gguf(np.zeros((6, 20), np.uint8), QT.Q4_1, out_shape=(4, 2))
