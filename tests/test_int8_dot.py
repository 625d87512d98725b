"""W8A8 (issue 24): int8 weights times activations quantized per token, through XLA's int8 x int8 -> int32
dot (quant._int8_dot, EngineConfig.matmul_impl='int8'). Checked against a numpy transcription of the same
integer arithmetic in int64 (exact up to the final f32 scaling), against the float64 dot of the dequantized
weights (the error W8A8 adds), and end to end against the same int8 weights multiplied in f32."""

import numpy as np
import pytest

import jax.numpy as jnp

from jaxinfer import LLM, SamplingParams, quant


def numpy_w8a8(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """x [T, I] f32, codes int8 [O, I], w_scale [O]: x rounded to int8 per row (max|x| / 127), int64 dot, scaled."""
    x_scale = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32) / np.float32(127)
    x_codes = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64)
    return (x_codes @ codes.astype(np.int64).T).astype(np.float64) * x_scale * w_scale[None, :]


@pytest.mark.parametrize("layout,spec", [("out_in", "ti,oi->to"), ("in_out", "ti,io->to")])
def test_int8_dot_is_the_integer_arithmetic_it_claims(layout, spec):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((384, 256)).astype(np.float32)
    x = (rng.standard_normal((7, 256)) * rng.uniform(0.1, 10, (7, 1))).astype(np.float32)  # rows of very different scales
    q = quant.quantize_int8(jnp.asarray(w), layout=layout)
    ours = np.asarray(quant.qeinsum(spec, jnp.asarray(x), quant.with_int8_activations(q)), np.float64)
    expected = numpy_w8a8(x, np.asarray(q.codes), np.asarray(q.scales)[:, 0])
    assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
    dense = np.einsum(spec, x.astype(np.float64), np.asarray(quant.dequantize(q), np.float64))
    error = np.linalg.norm(ours - dense) / np.linalg.norm(dense)
    assert 1e-4 < error < 0.02  # the activations' rounding: visible, and small


def test_only_int8_weights_take_int8_activations():
    q = quant.quantize_int4(jnp.ones((64, 64)), group_size=32)
    assert quant.with_int8_activations(q).activations == "float"
    with pytest.raises(ValueError, match="int8 format"):
        quant.QuantizedTensor(codes=q.codes, scales=q.scales, format="int4", group_size=32, in_shape=(64,), out_shape=(64,), activations="int8")


@pytest.fixture(scope="module")
def engines(tiny_chat_model, compile_cache):
    common = dict(quantization="int8", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64, compilation_cache_dir=compile_cache)
    return LLM(str(tiny_chat_model), matmul_impl="int8", **common), LLM(str(tiny_chat_model), matmul_impl="xla", **common)


def test_w8a8_engine_agrees_with_the_same_int8_weights_in_f32(engines):
    w8a8, f32 = engines
    assert w8a8.engine.matmul_impl == "int8" and isinstance(w8a8.engine.step_params.layers.wq, quant.QuantizedTensor)
    assert w8a8.engine.step_params.layers.wq.activations == "int8" and w8a8.engine.params.layers.wq.activations == "float"
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
