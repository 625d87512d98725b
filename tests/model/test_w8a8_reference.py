"""The W8A8 kernels' exact reference (jaxinfer/model/w8a8_reference.py): its activation rule against a numpy
transcription of kernels_cpu/w8a8.h, and one matmul of each kernel against it (tight) and against f32
activations (loose), through panels.einsum as the model calls it."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxinfer.model import panels, quant, w8a8_exact, w8a8_reference
from kernels_cpu import kquant_matmul
from tolerances import KERNEL_F32, relative_error

SPEC = "btd,df->btf"  # rows @ matrix, as the model's projections


def numpy_fake_quantize(x: np.ndarray, block: int) -> np.ndarray:
    """kernels_cpu/w8a8.h quantize_group, transcribed: amax and the inverse 127 / amax in f32, the f32 product
    x * inverse (exact in float64, then rounded once to f32), rounded half to even (np.rint), clamped to
    [-127, 127] as integers; then codes * (amax / 127), that quotient in f32, the product exact in float64 and
    rounded once to f32 (the reference dequantizes in f32)."""
    blocks = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1)  # f32
    inverse = np.zeros_like(amax)
    np.divide(np.float32(127), amax, out=inverse, where=amax > 0)  # f32 division
    products = (blocks.astype(np.float64) * inverse[:, None].astype(np.float64)).astype(np.float32)
    codes = np.clip(np.rint(products.astype(np.float64)).astype(np.int64), -127, 127)
    scale = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    return (codes * scale[:, None]).astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("block", [32, 256])
def test_fake_quantized_activations_are_the_kernel_rule_with_exact_ties(block):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 4 * block)) * rng.uniform(0.01, 50, (64, 1))).astype(np.float32)
    x[0, :block] = 0  # an all-zero block: scale 0, codes 0
    ties = (np.arange(block, dtype=np.float32) % 254) - 126.5  # every product a half: -126.5 .. 126.5
    ties[0] = 127.0  # max |x| = 127: the inverse is exactly 1, so each code is the tie itself, rounded to even
    x[1, block : 2 * block] = ties
    x[2, 2 * block : 3 * block] = 2 * ties  # max 254: inverse 0.5, the same ties
    ours = np.asarray(w8a8_reference.fake_quantize(jnp.asarray(x), block))
    expected = numpy_fake_quantize(x, block)
    np.testing.assert_array_equal(ours, expected)
    assert np.array_equal(ours[1, block + 1 : block + 4], [-126.0, -124.0, -124.0])  # -125.5 -> -126, -124.5 -> -124, -123.5 -> -124
    half_away = np.clip(np.trunc(ties[1:4].astype(np.float64) + np.copysign(0.5, ties[1:4])), -127, 127)
    assert not np.array_equal(ours[1, block + 1 : block + 4], half_away)  # a rule rounding half away from zero would fail


def _random_kquant(fmt: str, rows: int, num_in: int, seed: int) -> quant.QuantizedTensor:
    """A [num_in] -> [rows] matrix of random GGUF blocks of `fmt`, fp16 scales ~N(0, 1e-2), in Params layout."""
    rng = np.random.default_rng(seed)
    _, block, size = quant.GGUF_KEPT_TYPES[int(getattr(QT, fmt.upper()))]
    data = rng.integers(0, 256, (rows, num_in // block, size), dtype=np.uint8)
    for offset in {"q6_k": (208,)}.get(fmt, (0, 2)):
        data[..., offset : offset + 2] = (rng.standard_normal((rows, num_in // block)) * 1e-2).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    q = quant.from_gguf(data.reshape(rows, -1), getattr(QT, fmt.upper()), layout="in_out")
    return jax.device_put(q)


def _q4_0(rows: int, num_in: int, seed: int) -> quant.QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((rows, num_in)).astype(np.float32)
    return jax.device_put(quant.from_gguf(gguf.quants.quantize(w, QT.Q4_0), QT.Q4_0, layout="in_out"))


def _activations(num_in: int) -> jax.Array:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, num_in)) * rng.uniform(0.1, 10, (2, 3, 1))
    x[..., 5] *= 30  # an outlier channel: the blocks it falls in get a coarse step
    return jnp.asarray(x, jnp.float32)


@pytest.mark.usefixtures("cpu_kernels")
def test_q4_0_kernel_is_the_fake_quant_reference_not_the_f32_one():
    q = _q4_0(80, 512, seed=1)
    x = _activations(512)
    kernel = panels.einsum(SPEC, x, panels.to_quant_panels(q))
    exact = panels.einsum(SPEC, x, w8a8_reference.FakeQuantWeight(q))
    f32 = quant.qeinsum(SPEC, x, q)
    assert relative_error(kernel, exact) <= KERNEL_F32, relative_error(kernel, exact)
    assert relative_error(kernel, f32) > 100 * KERNEL_F32, relative_error(kernel, f32)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_kquant_kernel_is_the_fake_quant_reference_not_the_f32_one(fmt):
    if not kquant_matmul.available():
        pytest.skip("the CPU K-quant kernel could not be built")
    q = _random_kquant(fmt, 70, 768, seed=2)
    x = _activations(768)
    packed = panels.to_kquant_panels(q)
    kernel = panels.einsum(SPEC, x, dataclasses.replace(packed, read="kernel"))
    exact = panels.einsum(SPEC, x, dataclasses.replace(packed, read=w8a8_reference.READ))
    f32 = panels.einsum(SPEC, x, dataclasses.replace(packed, read="dense"))
    assert relative_error(kernel, exact) <= KERNEL_F32, relative_error(kernel, exact)
    assert relative_error(kernel, f32) > 100 * KERNEL_F32, relative_error(kernel, f32)


def test_activation_block_is_each_kernels_group():
    assert [w8a8_reference.activation_block(f) for f in ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_0", "q4_1", "q8_0", "int8")] == [256] * 3 + [32] * 6
    with pytest.raises(ValueError, match="f16"):
        w8a8_reference.activation_block("f16")


@pytest.mark.usefixtures("cpu_kernels")
def test_kernel_matmul_error_is_tight_and_sees_a_wrong_activation_block(monkeypatch):
    """The tuner's per-matmul check: every kernel matmul of the tiny Q4_K_M file (Q4_K, and Q6_K + Q4_K mixed layers)
    is its exact reference to f32 sum order; a reference quantizing in blocks of 32 instead of 256 is 1e-2 away."""
    if not kquant_matmul.available():
        pytest.skip("the CPU K-quant kernel could not be built")
    from pathlib import Path

    from jaxinfer.loading import loading

    _, params = loading.load_model(Path(__file__).resolve().parent.parent / "fixtures" / "kquant" / "q4_k_m.gguf", quantization="gguf", kquant_panels=True)
    step_params = panels.pack_panels(params, quantized=True)
    assert w8a8_exact.kernel_matmul_error(step_params, params) <= KERNEL_F32
    monkeypatch.setattr(w8a8_reference, "activation_block", lambda fmt: 32)
    assert w8a8_exact.kernel_matmul_error(step_params, params) > 1e-3
