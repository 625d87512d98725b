"""The tuner's exact check of the W8A8 kernels: reference_run(w8a8=True) is the kernels' own arithmetic, and a
'cpu_int8' candidate is measured against it, its error against f32 reported beside it."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import tuning
from jaxinfer.loading import loading
from jaxinfer.model import forward as model, panels
from jaxinfer.model.attention import CPU_IMPL
from kernels_cpu import kquant_matmul
from tolerances import relative_error

Q4_K_M = Path(__file__).resolve().parent.parent / "fixtures" / "kquant" / "q4_k_m.gguf"  # Q4_K + Q6_K layers, a Q6_K head


@pytest.fixture(scope="module")
def kquant_model():
    if not kquant_matmul.available():
        pytest.skip("the CPU K-quant kernel could not be built")
    return loading.load_model(Q4_K_M, quantization="gguf", kquant_panels=True)


@pytest.mark.usefixtures("cpu_kernels")
def test_exact_reference_run_is_the_kernel_forward_and_the_f32_one_is_not(kquant_model):
    """The prompt-end logits of the exact reference == the model run through the kernels (their packed step params,
    no cache) to f32 sum order; the f32 reference's differ by the activations' 8 bits. (16 tokens of this model
    cross no rounding half between the two; on longer runs one code flipped by a last bit moves the logits by 1e-2.)"""
    cfg, params = kquant_model
    prompt = list(range(1, 17))
    tokens, positions = jnp.asarray([prompt], jnp.int32), jnp.arange(len(prompt), dtype=jnp.int32)[None]
    kernel = np.asarray(jax.jit(lambda p: model.forward(p, None, tokens, positions, cfg=cfg)[0])(panels.pack_panels(params, quantized=True)))[0, -1]
    exact = tuning.reference_run(cfg, params, [prompt], num_tokens=1, w8a8=True).logits[0]
    f32 = tuning.reference_run(cfg, params, [prompt], num_tokens=1).logits[0]
    assert relative_error(kernel, exact) < 1e-5, relative_error(kernel, exact)
    assert relative_error(kernel, f32) > 1e-2, relative_error(kernel, f32)


@pytest.mark.usefixtures("cpu_kernels")
def test_a_kernel_candidate_is_checked_against_the_exact_reference_with_f32_beside_it(kquant_model, compile_cache):
    cfg, params = kquant_model
    probe = tuning.make_probe(EngineConfig(max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64, compilation_cache_dir=compile_cache),
                              list(range(1, 200)))
    rows = tuning.measure_all([tuning.Candidate("float32", CPU_IMPL, "cpu_int8")], cfg, params, probe, float("inf"), auto_weights=True)
    assert rows[0].passed and rows[0].f32_relative_error is not None, rows[0]
    assert rows[0].relative_error < rows[0].f32_relative_error / 2  # the 8 bits' cost is not in the exact check
    table = tuning.format_table(tuning.TuneResult(rows[0].impls, rows, source="tuned"))
    assert rows[0].matmul_error < 1e-5  # each kernel matmul: the exact reference to f32 sum order
    assert f"exact W8A8 reference; kernel matmuls {rows[0].matmul_error:.1e}; vs f32 {rows[0].f32_relative_error:.2e}" in table
