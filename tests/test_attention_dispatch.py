"""attention.py's two back ends against each other: the Pallas decode kernel (GPU interpreter on CPU)
and the jnp reference, inside the real model forward over the paged pool."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import kv_pool as kvp
from jaxinfer.config import ModelConfig
from jaxinfer.model import forward
from jaxinfer.params import init_random
from kernel_interpret import gpu_interpreter, races_found
from tolerances import KERNEL_BF16, assert_close

PAGE = 64
# SmolLM2's attention geometry (9 query heads over 3 kv heads, head_dim 64), two layers, bf16.
CFG = ModelConfig(vocab_size=256, num_layers=2, embed_dim=192, ffn_dim=256, num_heads=9, num_kv_heads=3, head_dim=64, dtype="bfloat16", max_context=256)


def prefill_then_decode(impl: str, params, prompt_lengths):
    """Prefill two sequences with the reference path, then one decode step with `impl`."""
    pool = kvp.init_pool(CFG, 8, PAGE)
    tables = np.array([[3, 5, 0, 0], [6, 1, 2, 0]], np.int32)  # shuffled pages, null-padded
    rng = np.random.default_rng(0)
    for row, length in enumerate(prompt_lengths):
        positions = np.arange(length, dtype=np.int32)[None]
        meta = kvp.PageMeta(tables[row : row + 1], tables[row][positions // PAGE], positions % PAGE)
        tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, length)), jnp.int32)
        _, pool = forward(params, pool, tokens, jnp.asarray(positions), cfg=CFG, pages=meta)
    positions = np.array([[n] for n in prompt_lengths], np.int32)
    meta = kvp.PageMeta(tables, np.take_along_axis(tables, positions // PAGE, 1), positions % PAGE)
    logits, _ = forward(params, pool, jnp.array([[7], [9]], jnp.int32), jnp.asarray(positions), cfg=CFG, pages=meta, attention_impl=impl)
    return np.asarray(logits[:, 0], np.float32)


@pytest.mark.slow
def test_pallas_decode_matches_reference_inside_model_forward():
    params = init_random(jax.random.key(0), CFG, scale=0.3)
    reference = prefill_then_decode("reference", params, (70, 129))
    with gpu_interpreter() as interpret:
        with jax.sharding.use_abstract_mesh(_h100_mesh()), _force_interpret(interpret):
            kernel = prefill_then_decode("pallas", params, (70, 129))
        assert not races_found()
    assert_close(kernel, reference, KERNEL_BF16, "pallas vs reference decode logits")


def test_explicit_pallas_refuses_float32():
    cfg = dataclasses.replace(CFG, dtype="float32")
    params = init_random(jax.random.key(0), cfg)
    pool = kvp.init_pool(cfg, 4, PAGE)
    meta = kvp.PageMeta(jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        forward(params, pool, jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cfg=cfg, pages=meta, attention_impl="pallas")


def _h100_mesh():
    from jax.sharding import AbstractDevice, AbstractMesh

    return AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=8))


def _force_interpret(params):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.force_gpu_interpret_mode(params)
