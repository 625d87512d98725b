"""LLM.update_params: weights swapped in place between batches. Nothing compiles (CompileCounter listens to
every trace and backend compile of the process), the outputs after the swap equal those of a fresh LLM
built on the new params token for token (and logprob for logprob), the CPU kernels' panels are rebuilt,
the prefix cache is dropped, every output names its weight_version, and a params tree that does not fit
is refused naming the field."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.api import LLM
from jaxinfer.engine.engine import CompileCounter
from jaxinfer.scheduling.request import SamplingParams

LIMITS = dict(dtype="float32", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64)
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 40, 70, 17))]
SAMPLING = SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=0, ignore_eos=True)


def perturbed(params, scale: float = 0.05, seed: int = 0):
    """Every floating leaf plus scale x N(0, 1) noise (a training step's worth of change on the tiny model)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf for k, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(tree, noisy)


def run(llm: LLM):
    outputs = llm.generate(PROMPTS, SAMPLING, progress=False)
    return [o.token_ids for o in outputs], [[lp for lp, _ in o.logprobs] for o in outputs], outputs


@pytest.fixture(scope="module")
def deterministic_llm(tiny_chat_model, compile_cache) -> LLM:
    return LLM(tiny_chat_model, deterministic=True, compilation_cache_dir=compile_cache, **LIMITS)


def test_swap_compiles_nothing_and_equals_a_fresh_llm_in_deterministic_mode(deterministic_llm, compile_cache):
    llm = deterministic_llm
    before_tokens, _, before = run(llm)
    assert {o.weight_version for o in before} == {llm.weight_version}
    new = perturbed(llm.params)
    version, engine, choices, programs = llm.weight_version, llm.engine, llm.choices, dict(llm.engine._programs)
    with CompileCounter() as counter:
        assert llm.update_params(new) == version + 1
        tokens, logprobs, outputs = run(llm)
    assert counter.count == 0, counter.events
    assert llm.engine is engine and llm.choices == choices and llm.engine._programs == programs  # the tuner's choice and programs kept
    assert {o.weight_version for o in outputs} == {version + 1}
    fresh = LLM.from_params(llm.model_config, new, llm.tokenizer, engine_config=llm.engine_config)
    fresh_tokens, fresh_logprobs, _ = run(fresh)
    assert tokens == fresh_tokens
    assert logprobs == fresh_logprobs  # bit for bit: Python floats of the same f32 values
    assert tokens != before_tokens, "the swap changed no token: the test could not tell the weights apart"


def test_swap_drops_the_prefix_cache(deterministic_llm):
    llm = deterministic_llm
    prompt = [PROMPTS[2]]
    llm.generate(prompt, SAMPLING, progress=False)
    assert llm.generate(prompt, SAMPLING, progress=False)[0].num_cached_tokens > 0  # the control: the cache holds it
    llm.update_params(llm.params)
    assert llm.generate(prompt, SAMPLING, progress=False)[0].num_cached_tokens == 0


def test_swap_is_refused_while_a_stream_runs(deterministic_llm):
    llm = deterministic_llm
    stream = llm.stream([llm.prepare(p, SAMPLING, index=i) for i, p in enumerate(PROMPTS)])
    next(stream)
    with pytest.raises(RuntimeError, match="update_params: this LLM is generating"):
        llm.update_params(llm.params)
    stream.close()
    llm.update_params(llm.params)  # between streams it is taken


def test_mismatched_params_are_refused_naming_the_field(deterministic_llm):
    llm = deterministic_llm
    params = llm.params
    layers = params.layers
    wrong_shape = dataclasses.replace(params, layers=dataclasses.replace(layers, wq=layers.wq[:, :-1]))
    with pytest.raises(ValueError, match=r"params\.layers\.wq: shape .* differs from the loaded"):
        llm.update_params(wrong_shape)
    wrong_dtype = dataclasses.replace(params, final_norm=params.final_norm.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"params\.final_norm: dtype int32 differs from the loaded float32"):
        llm.update_params(wrong_dtype)
    extra = dataclasses.replace(params, lm_head=params.embed.T)  # a tied model holds no head
    with pytest.raises(ValueError, match=r"params\.lm_head: not in the loaded params"):
        llm.update_params(extra)
    with pytest.raises(ValueError, match="takes a Params pytree"):
        llm.update_params({"embed": params.embed})
    version = llm.weight_version
    llm.update_params(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))  # floating leaves: cast as the load casts
    assert llm.weight_version == version + 1 and llm.params.embed.dtype == jnp.float32


def test_swap_repacks_the_cpu_kernel_panels(tiny_chat_model, compile_cache, cpu_kernels):
    """The default CPU engine multiplies panels packed at start (step_params); after a swap they are the new
    weights' panels: greedy outputs equal a fresh LLM on the new params, token for token."""
    # 2 programs (one 64-token chunk, the 4-row 8-page decode), not the full tables' 16: a swap that recompiled would
    # recompile these too
    limits = dict(LIMITS, attention_impl="cpu", matmul_impl="cpu", prefill_chunk_buckets=(64,), decode_batch_buckets=(4,), decode_page_buckets=(8,))
    llm = LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **limits)
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    new = perturbed(llm.params, seed=1)
    old_panels = jax.tree.leaves(llm.engine.step_params.layers.wq)
    with CompileCounter() as counter:
        llm.update_params(new)
        swapped = llm.generate(PROMPTS, greedy, progress=False)
    assert counter.count == 0, counter.events
    assert llm.engine.matmul_impl == "cpu" and not np.array_equal(np.asarray(jax.tree.leaves(llm.engine.step_params.layers.wq)[0]), np.asarray(old_panels[0]))
    fresh = LLM.from_params(llm.model_config, new, llm.tokenizer, engine_config=llm.engine_config)
    expected = fresh.generate(PROMPTS, greedy, progress=False)
    assert [o.token_ids for o in swapped] == [o.token_ids for o in expected]
    assert [[lp for lp, _ in o.logprobs] for o in swapped] == [[lp for lp, _ in o.logprobs] for o in expected]


@pytest.mark.slow
def test_swap_under_tensor_parallelism_after_jax_distributed_initialize(tiny_chat_model):
    """Two simulated CPU devices, in a process that called jax.distributed.initialize first (a subprocess: this
    file as a script): the swap compiles nothing and the outputs equal a fresh tensor-parallel LLM's, in
    deterministic mode and out of it; jaxinfer.logprobs runs on the sharded params (within 1e-4 there)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, __file__, str(tiny_chat_model)], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("deterministic", "default"):
        assert report[mode]["compiles"] == 0 and report[mode]["swapped"] == report[mode]["fresh"], mode
        assert report[mode]["swapped"] != report[mode]["before"], mode
    assert report["pure_max_abs_diff"] <= 1e-4


def _parallel_worker(model: str) -> dict:
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=1, process_id=0)
    from jaxinfer.options import LoadOptions

    report = {}
    # The default mode on 3 programs (its full tables hold 13): what is checked is the swap, not the tables.
    for mode, fields in (("deterministic", {"deterministic": True}), ("default", {"decode_batch_buckets": (4,), "decode_page_buckets": (8,)})):
        limits = dict(LIMITS, tensor_parallel=2, compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_swap_xla_"), **fields)
        llm = LLM(model, **limits)
        before = run(llm)[0]
        new = perturbed(llm.params)
        with CompileCounter() as counter:
            llm.update_params(new)
            swapped, logprobs, _ = run(llm)
        fresh = LLM.from_params(llm.model_config, new, llm.tokenizer, options=LoadOptions(tensor_parallel=2), engine_config=llm.engine_config)
        report[mode] = {"compiles": counter.count, "before": before, "swapped": swapped, "fresh": run(fresh)[0]}
        if mode == "deterministic":
            import jaxinfer

            tokens = jnp.asarray(PROMPTS[0] + swapped[0], jnp.int32)
            mine = np.asarray(jaxinfer.logprobs(llm.params, tokens, llm.model_config, prompt_len=len(PROMPTS[0]), engine_config=llm.engine_config))
            report["pure_max_abs_diff"] = float(np.abs(mine[len(PROMPTS[0]) - 1 :] - np.asarray(logprobs[0])).max())
    return report


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(_parallel_worker(sys.argv[1])))
