"""jaxinfer.logprobs, the trainer's pure function: over 64 sampled rollouts of a deterministic engine (n samples
sharing prompt pages through the prefix cache, batches of 4 rows, prompts chunked under a shared token
budget), every token's reported logprob equals it bit for bit, and the prompt logprobs too. The control:
the plain full-sequence forward (another reduction order) is close but not equal, so the check can fail.
jax.grad of a loss over it runs and matches central finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.api import LLM
from jaxinfer.model import forward as model
from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.trainer import StepShapes, logprobs_jit

LIMITS = dict(dtype="float32", max_context=256, page_size=16, max_num_seqs=4, max_prefill_tokens=64)
PROMPT_LENGTHS = (3, 9, 30, 63, 64, 65, 100, 140)  # one chunk, a chunk's edge, several chunks
SAMPLES = 8  # per prompt: 8 x 8 = 64 rollouts


def prompts() -> list[list[int]]:
    return [[(13 * i + 7 * j) % 450 + 4 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache) -> LLM:
    return LLM(tiny_chat_model, deterministic=True, compilation_cache_dir=compile_cache, **LIMITS)


@pytest.fixture(scope="module")
def rollouts(llm):
    """64 rollouts: (prompt, sampled tokens, reported logprobs f32)."""
    sampling = SamplingParams(temperature=1.0, seed=11, n=SAMPLES, max_tokens=16, logprobs=0, ignore_eos=True)
    out = []
    for prompt, output in zip(prompts(), llm.generate(prompts(), sampling, progress=False)):
        for sample in output.samples:
            out.append((prompt, sample.token_ids, np.asarray([lp for lp, _ in sample.logprobs], np.float32)))
    assert len(out) == 64
    assert llm.last_stats.prefix_cache_hits > 0, "the samples were meant to share prompt pages through the prefix cache"
    return out


def pure(llm, prompt, sampled):
    tokens = jnp.asarray(prompt + sampled, jnp.int32)
    return np.asarray(logprobs_jit(llm.params, tokens, llm.model_config, prompt_len=len(prompt), engine_config=llm.engine_config))


def test_reported_logprobs_equal_the_pure_function_bit_for_bit_over_64_rollouts(llm, rollouts):
    assert jaxinfer.logprobs is jaxinfer.trainer.logprobs
    for i, (prompt, sampled, reported) in enumerate(rollouts):
        mine = pure(llm, prompt, sampled)[len(prompt) - 1 :]
        assert mine.dtype == np.float32 and mine.shape == reported.shape
        assert np.array_equal(mine.view(np.uint32), reported.view(np.uint32)), f"rollout {i}: max |diff| {np.abs(mine - reported).max()}"


def test_prompt_logprobs_equal_the_pure_function_of_the_prompt_alone(llm):
    sampling = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for prompt, output in zip(prompts()[1:5], llm.generate(prompts()[1:5], sampling, progress=False)):
        reported = np.asarray([entry[0] for entry in output.prompt_logprobs[1:]], np.float32)
        mine = np.asarray(logprobs_jit(llm.params, jnp.asarray(prompt, jnp.int32), llm.model_config, engine_config=llm.engine_config))
        assert np.array_equal(mine, reported), np.abs(mine - reported).max()


def test_the_plain_full_sequence_forward_differs_so_the_check_can_fail(llm, rollouts):
    """The control: one [1, T] forward with the reference attention (a full softmax over all keys at once) and
    [T, D] matmuls gives the same numbers to ~1e-5 but not the same bits."""
    unequal = 0
    for prompt, sampled, reported in rollouts[::4]:
        tokens = jnp.asarray([prompt + sampled], jnp.int32)
        logits, _ = model.forward(llm.params, None, tokens, jnp.arange(tokens.shape[1])[None], cfg=llm.model_config)
        plain = np.asarray(jax.nn.log_softmax(logits[0, :-1], axis=-1)[jnp.arange(tokens.shape[1] - 1), tokens[0, 1:]])[len(prompt) - 1 :]
        np.testing.assert_allclose(plain, reported, atol=1e-4)
        unequal += int((plain != reported).sum())
    assert unequal > 0, "the plain forward matched every bit: the bitwise check could not fail here"


def test_another_attention_order_in_the_same_program_shapes_differs(llm, rollouts, monkeypatch):
    """The control of the reduction order alone: the same chunks and decode rows, with attention_over_pages
    (one softmax over all pages at once) in place of the blocks in position order."""
    from jaxinfer import trainer

    monkeypatch.setattr(trainer, "DETERMINISTIC_IMPL", "reference")
    unequal = 0
    for prompt, sampled, reported in rollouts[::8]:
        other = jax.jit(lambda p, t, n=len(prompt): trainer.logprobs(p, t, llm.model_config, prompt_len=n, engine_config=llm.engine_config))  # a fresh trace
        mine = np.asarray(other(llm.params, jnp.asarray(prompt + sampled, jnp.int32)))[len(prompt) - 1 :]
        np.testing.assert_allclose(mine, reported, atol=1e-4)
        unequal += int((mine != reported).sum())
    assert unequal > 0, "another attention order matched every bit: the bitwise check could not fail here"


def test_logprobs_is_differentiable_and_matches_finite_differences(llm):
    """jax.grad equals the plain forward's gradient (the same function up to rounding) leaf by leaf, and a
    central finite difference along a random direction (steps of 1e-4 per weight)."""
    tokens = jnp.asarray(prompts()[2][:20], jnp.int32)
    shapes = StepShapes.of(llm.engine_config)

    def loss(params):
        return -jaxinfer.logprobs(params, tokens, llm.model_config, prompt_len=12, engine_config=shapes).sum()

    def plain_loss(params):
        logits, _ = model.forward(params, None, tokens[None], jnp.arange(tokens.shape[0])[None], cfg=llm.model_config)
        return -jax.nn.log_softmax(logits[0, :-1], axis=-1)[jnp.arange(tokens.shape[0] - 1), tokens[1:]].sum()

    grads, plain_grads = jax.jit(jax.grad(loss))(llm.params), jax.jit(jax.grad(plain_loss))(llm.params)
    for (path, g), p in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(plain_grads)):
        assert float(jnp.abs(g - p).max()) <= 1e-4 * float(jnp.abs(p).max()) + 1e-5, jax.tree_util.keystr(path)
    leaves, tree = jax.tree.flatten(llm.params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    direction = jax.tree.unflatten(tree, [0.01 * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)])
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    eps = 1e-2
    shifted = lambda sign: jax.tree.map(lambda p, d: p + sign * eps * d, llm.params, direction)  # noqa: E731
    numeric = (float(jax.jit(loss)(shifted(1))) - float(jax.jit(loss)(shifted(-1)))) / (2 * eps)
    assert abs(analytic - numeric) <= 1e-2 * abs(numeric) + 1e-3, (analytic, numeric)


def test_bad_lengths_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_len <= T"):
        jaxinfer.logprobs(llm.params, jnp.arange(1, 6), llm.model_config, prompt_len=9)


@pytest.mark.slow
def test_smollm2_rollouts_equal_the_pure_function_bit_for_bit(compile_cache):
    """The real model (576-wide matmuls, where XLA:CPU's row bits follow the row count): 8 rollouts."""
    llm = LLM(None, deterministic=True, compilation_cache_dir=compile_cache, **LIMITS)
    sampling = SamplingParams(temperature=1.0, seed=2, max_tokens=8, logprobs=0, ignore_eos=True)
    chosen = [prompts()[i] for i in (0, 2, 4, 6)] * 2
    for prompt, output in zip(chosen, llm.generate(chosen, sampling, progress=False)):
        reported = np.asarray([lp for lp, _ in output.logprobs], np.float32)
        assert np.array_equal(pure(llm, prompt, output.token_ids)[len(prompt) - 1 :], reported)
