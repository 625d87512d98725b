"""W8A8: weights of int8 codes (the int8 format, GGUF Q8_0) times activations quantized per block of 32,
through XLA's int8 x int8 -> int32 dot (quant._int8_dot, EngineConfig.matmul_impl='int8'), by the same rule
as the CPU quantized-matmul kernel (kernels_cpu/quant_matmul: one block size, one activation quantizer).
Checked against a numpy transcription of the same integer arithmetic in int64 (exact up to the final f32
scaling), against the float64 dot of the dequantized weights (the error W8A8 adds), and end to end against
the same int8 weights multiplied in f32."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType, quants

from jaxinfer import LLM, SamplingParams
from jaxinfer.model import panels, quant
from kernels_cpu import quant_matmul


def numpy_w8a8(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray, block: int) -> np.ndarray:
    """x [T, I] f32, codes int8 [O, I], w_scale [O, I / g] (g a multiple of `block`): each `block` entries
    of a row of x rounded to int8 (codes round(x * (127 / max|x|)) in f32, half to even, as the CPU kernel
    rounds them; scale max|x| / 127), an int64 dot per block, both scales, summed."""
    t, i = x.shape
    xb = x.reshape(t, i // block, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True).astype(np.float32)  # [T, nb, 1]
    x_scale = amax / np.float32(127)
    inverse = (np.float32(127) / np.where(amax > 0, amax, np.float32(1))).astype(np.float32)
    x_codes = np.clip(np.round(xb * inverse), -127, 127).astype(np.int64)
    cb = codes.astype(np.int64).reshape(codes.shape[0], i // block, block)
    partial = np.einsum("tbk,obk->tob", x_codes, cb).astype(np.float64)  # exact integers
    w_block = np.repeat(w_scale.astype(np.float64), i // block // w_scale.shape[1], axis=1)  # [O, nb]
    return np.einsum("tob,ob,tb->to", partial, w_block, x_scale[..., 0].astype(np.float64))


def _rows_of_different_scales(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape) * rng.uniform(0.1, 10, (shape[0], 1))
    x[:, 5] *= 40  # one outlier channel, as real activations have
    return x.astype(np.float32)


@pytest.mark.parametrize("layout,spec", [("out_in", "ti,oi->to"), ("in_out", "ti,io->to")])
def test_int8_dot_is_the_integer_arithmetic_it_claims(layout, spec):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((384, 512)).astype(np.float32)
    x = _rows_of_different_scales(rng, (7, 512))
    q = quant.quantize_int8(jnp.asarray(w), layout=layout)
    ours = np.asarray(quant.qeinsum(spec, jnp.asarray(x), quant.with_int8_activations(q)), np.float64)
    expected = numpy_w8a8(x, np.asarray(q.codes), np.asarray(q.scales), 32)
    assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
    dense = np.einsum(spec, x.astype(np.float64), np.asarray(quant.dequantize(q), np.float64))
    error = np.linalg.norm(ours - dense) / np.linalg.norm(dense)
    per_token = numpy_w8a8(x, np.asarray(q.codes), np.asarray(q.scales), 512)  # one scale per token: the outlier sets it
    assert 1e-4 < error < 0.02  # the activations' rounding: visible, and small
    assert error < 0.5 * np.linalg.norm(per_token - dense) / np.linalg.norm(dense)  # blocks confine the outlier
    coarser = numpy_w8a8(x, np.asarray(q.codes), np.asarray(q.scales), 64)  # control: a block size other than the rule's
    assert np.abs(ours - coarser).max() > 1e-5 * np.abs(coarser).max()  # the tolerance above tells 32 from 64


def test_xla_w8a8_and_the_kernel_reference_are_one_rule():
    """The same int8 weights through XLA's W8A8 (quant._int8_dot) and through the CPU kernel's jnp reference on
    the packed panels agree to f32 rounding: the same activation quantizer, blocks of 32 and exact block
    dots. Each row's largest weight is 127 * 2^-7, so its int8 scale 2^-7 survives the panels' float16."""
    rng = np.random.default_rng(5)
    w = rng.uniform(-0.5, 0.5, (2, 96, 128)).astype(np.float32)  # [L, O, I]
    w[..., 7] = 127 * 2.0**-7
    x = _rows_of_different_scales(rng, (6, 128))
    q = quant.quantize_int8(jnp.asarray(w), layout="in_out")
    assert np.all(np.asarray(q.scales) == 2.0**-7)
    xla = np.asarray(quant.qeinsum("ti,io->to", jnp.asarray(x), quant.with_int8_activations(jax.tree.map(lambda leaf: leaf[1], q))))
    packed = panels.to_quant_panels(q)
    kernel_reference = np.asarray(quant_matmul.reference(jnp.asarray(x), packed.codes, packed.scale, packed.offset, jnp.int32(1), zero_point=packed.zero_point))
    assert np.abs(kernel_reference - xla).max() <= 1e-5 * np.abs(xla).max()
    expected = numpy_w8a8(x, np.asarray(q.codes[1]), np.asarray(q.scales[1]), 32)
    assert np.abs(xla - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(numpy_w8a8(x, np.asarray(q.codes[1]), np.asarray(q.scales[1]), 64) - expected).max() > 1e-5 * np.abs(expected).max()  # control


def test_q8_0_blocks_are_multiplied_as_stored():
    """A GGUF Q8_0 tensor's codes and per-32 fp16 scales enter the integer dot unchanged: the result is
    the int64 arithmetic on the file's own blocks, with activation blocks of 32 (llama.cpp's Q8_0 x Q8_0)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 128)).astype(np.float32)
    blocks = quants.quantize(w, GGMLQuantizationType.Q8_0)  # uint8 [96, 4 * 34]
    q = quant.from_gguf(blocks, GGMLQuantizationType.Q8_0, layout="in_out")
    x = _rows_of_different_scales(rng, (5, 128))
    ours = np.asarray(quant.qeinsum("ti,io->to", jnp.asarray(x), quant.with_int8_activations(q)), np.float64)
    raw = blocks.reshape(96, 4, 34)
    codes = raw[..., 2:].copy().view(np.int8).reshape(96, 128)
    scales = raw[..., :2].copy().view(np.float16).reshape(96, 4).astype(np.float32)
    expected = numpy_w8a8(x, codes, scales, 32)
    assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
    assert quant.has_int8_weights({"w": q})


@pytest.mark.parametrize("fmt", ["int8", "q8_0"])
def test_past_the_partial_sum_bound_the_same_quantized_activations_meet_the_f32_weight(fmt, monkeypatch):
    """Above INT8_PARTIAL_BYTES the per-block int32 sums are not built; the result is the integer
    arithmetic's up to f32 rounding, and the lowered program then has no integer dot."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((96, 128)).astype(np.float32)
    q = quant.quantize_int8(jnp.asarray(w), layout="in_out") if fmt == "int8" else \
        quant.from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, layout="in_out")
    q = quant.with_int8_activations(jax.device_put(q))
    x = jnp.asarray(_rows_of_different_scales(rng, (6, 128)))
    integer = np.asarray(quant.qeinsum("ti,io->to", x, q))
    monkeypatch.setattr(quant, "INT8_PARTIAL_BYTES", 0)
    f32 = np.asarray(quant.qeinsum("ti,io->to", x, q))
    assert np.abs(f32 - integer).max() <= 1e-5 * np.abs(integer).max()
    hlo = jax.jit(lambda x: quant.qeinsum("ti,io->to", x, q)).lower(x).as_text()
    assert "xi32>" not in hlo.split("dot_general")[1].split("\n")[0]


def test_only_int8_weights_take_int8_activations():
    q = quant.quantize_int4(jnp.ones((64, 64)), group_size=32)
    assert quant.with_int8_activations(q).activations == "float"
    with pytest.raises(ValueError, match="int8 codes"):
        quant.QuantizedTensor(codes=q.codes, scales=q.scales, format="int4", group_size=32, in_shape=(64,), out_shape=(64,), activations="int8")


@pytest.fixture(scope="module")
def engines(tiny_chat_model, compile_cache):
    """The same int8 weights three ways: XLA's W8A8 (matmul 'int8'), the CPU quantized-matmul kernel's
    W8A8 in blocks of 32 (matmul 'cpu_int8', tests/test_quant_matmul.py), and f32 activations ('xla')."""
    from conftest import require_cpu_kernels

    require_cpu_kernels()
    common = dict(quantization="int8", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64, compilation_cache_dir=compile_cache,
                  prefill_chunk_buckets=(32,), decode_batch_buckets=(4,), decode_page_buckets=(8,))  # 2 programs each, not 13
    return {impl: LLM(str(tiny_chat_model), matmul_impl=impl, **common) for impl in ("int8", "cpu_int8", "xla")}


@pytest.mark.parametrize("impl", ["int8", "cpu_int8"])
def test_w8a8_engine_agrees_with_the_same_int8_weights_in_f32(engines, impl):
    w8a8, f32 = engines[impl], engines["xla"]
    assert w8a8.engine.matmul_impl == impl and isinstance(w8a8.engine.params.layers.wq, quant.QuantizedTensor)
    step = w8a8.engine.step_params
    if impl == "int8":
        assert step.layers.wq.activations == "int8" and w8a8.engine.params.layers.wq.activations == "float"
    else:  # packed for the kernel, the tied head too; the loaded params stay for the reference paths
        assert isinstance(step.layers.wq, panels.QuantPanelTensor) and isinstance(step.lm_head, panels.QuantPanelTensor)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    prompts = ["The cat sat on the mat", "One two three four", "Hello there, how are"]
    ours, theirs = w8a8.generate(prompts, params), f32.generate(prompts, params)
    nll = lambda o: -sum(lp for lp, _ in o.prompt_logprobs[1:])  # noqa: E731
    for a, b in zip(ours, theirs):
        assert abs(nll(a) / nll(b) - 1) < 0.02  # the prompt's likelihood within 2%
    assert np.mean([a.token_ids[:2] == b.token_ids[:2] for a, b in zip(ours, theirs)]) >= 2 / 3


def test_int8_matmul_without_int8_weights_is_refused(tiny_chat_model, compile_cache):
    with pytest.raises(ValueError, match="quantization='int8'"):
        LLM(str(tiny_chat_model), matmul_impl="int8", max_context=128, page_size=16, compilation_cache_dir=compile_cache)


@pytest.mark.parametrize("fmt,blocks", [("int8", "256x16x32"), ("q8_0", "256x16x32")])  # [O, I / b, b]: b = 32, the one W8A8 block
def test_w8a8_lowers_for_cuda_to_an_integer_dot_on_the_stored_codes(fmt, blocks):
    """Exported for CUDA (as the other GPU code is tested, on this CPU): the dot's operands are i8 and its
    result i32, and no f32 copy of the weight is built: the codes reach the dot as stored (the scales are
    applied by a small f32 contraction after it)."""
    from jax import export

    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    if fmt == "int8":
        q = quant.quantize_int8(jnp.asarray(w), layout="in_out")
    else:
        q = jax.device_put(quant.from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, layout="in_out"))
    q = quant.with_int8_activations(q)
    x = jax.ShapeDtypeStruct((4, 5, 512), jnp.bfloat16)  # 20 tokens: no activation shape looks like a weight
    module = export.export(jax.jit(lambda x, q: quant.qeinsum("bti,io->bto", x, q)), platforms=("cuda",))(x, q).mlir_module()
    integer = [line for line in module.splitlines() if "stablehlo.dot_general" in line and "xi8>" in line]
    assert len(integer) == 1 and f"tensor<{blocks}xi8>" in integer[0] and integer[0].split("->")[-1].split(" loc")[0].strip().endswith("xi32>"), integer
    assert "tensor<256x512xf32>" not in module and f"tensor<{blocks}xf32>" not in module
