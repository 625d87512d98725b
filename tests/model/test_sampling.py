"""Sampler: greedy, top-k/top-p supports and frequencies against hand-computed probabilities, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.model import sampling
from jaxinfer.scheduling import plan
from jaxinfer.scheduling.request import Request, SamplingParams

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))  # probabilities chosen by hand


def pack(params: list[SamplingParams], seeds, steps) -> sampling.SamplingArrays:
    """Temperature, top-k, top-p, seed and step of each row, packed by the engine's per-row packer
    (plan.pack_sampling): row i is a request with seed seeds[i] that has generated steps[i] tokens."""
    requests = [Request(str(i), [0], p, int(seed), output_ids=[0] * int(step)) for i, (p, seed, step) in enumerate(zip(params, seeds, steps))]
    packed = plan.pack_sampling(requests, bias_width=1)
    return sampling.SamplingArrays(packed["temperature"], packed["top_k"], packed["top_p"], packed["seeds"], packed["steps"])


def draw(params: SamplingParams, num_draws: int, logits=LOGITS) -> np.ndarray:
    """num_draws tokens from identical rows that differ only in seed."""
    rows = [params] * num_draws
    arrays = pack(rows, np.arange(num_draws), np.zeros(num_draws))
    batch = jnp.asarray(np.tile(logits, (num_draws, 1)), jnp.float32)
    return np.asarray(jax.jit(sampling.next_tokens)(batch, arrays))


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=len(LOGITS)) / len(tokens)


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    arrays = pack([SamplingParams(temperature=0)] * 6, np.zeros(6), np.zeros(6))
    np.testing.assert_array_equal(sampling.next_tokens(jnp.asarray(logits), arrays), logits.argmax(-1))


def test_temperature_one_matches_softmax_frequencies():
    freq = frequencies(draw(SamplingParams(temperature=1.0), 20000))
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.015)


def test_top_k_two_renormalises_over_two_tokens():
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_k=2), 20000))
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0, 0], atol=0.015)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # 0.5 + 0.25 = 0.75 < 0.8, so the prefix needs the third token too: {0.5, 0.25, 0.15} / 0.9
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_p=0.8), 20000))
    np.testing.assert_allclose(freq, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0], atol=0.015)


def test_low_temperature_sharpens_towards_argmax():
    tokens = draw(SamplingParams(temperature=0.05), 2000)
    assert (tokens == 0).mean() > 0.99


def test_same_seed_same_token_whatever_the_other_rows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=42)] + [SamplingParams(temperature=t) for t in (0.0, 0.5, 2.0)]
    first = sampling.next_tokens(jnp.asarray(logits), pack(params, np.array([42, 1, 2, 3]), np.full(4, 7)))
    alone = sampling.next_tokens(jnp.asarray(logits[:1]), pack(params[:1], np.array([42]), np.array([7])))
    assert int(first[0]) == int(alone[0])


@pytest.mark.parametrize("kwargs, message", [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"top_k": -2}, "top_k")])
def test_invalid_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]), min_size=1, max_size=9), min_size=1, max_size=4))
def test_argmax_is_numpys_first_maximum_with_ties_infinities_and_nans(rows):
    """sampling.argmax (a max and a min, faster on XLA:CPU) picks what numpy's argmax picks: the first
    maximum, or the first NaN of a row that has one."""
    width = max(len(r) for r in rows)
    x = np.array([r + [float("-inf")] * (width - len(r)) for r in rows], np.float32)
    assert np.asarray(sampling.argmax(jnp.asarray(x))).tolist() == np.argmax(x, axis=-1).tolist()
