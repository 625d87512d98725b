"""Bucket strategies, the exact fit and the padding metrics, against hand-computed values and brute force."""

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.bucketing import strategies as buckets
from jaxinfer.bucketing.strategies import (
    PREFILL,
    TOKENS,
    CostModel,
    FixedList,
    Fitted,
    Linear,
    MeanKSigma,
    PadToMax,
    PowersOfTwo,
    Quantile,
    batch_indices,
    batch_padding,
    chunk_buckets,
    fit_buckets,
    pad_to_bucket,
    padded_lengths,
    padding_metrics,
    packing,
    strategies_at_budget,
)

samples = st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=10)
cost_models = st.sampled_from([TOKENS, PREFILL, CostModel(linear=1.0, quadratic=0.25, name="steep")])


def _brute_force_cost(lengths, budget, cost, multiple_of=1):
    """The cheapest table over every subset of the (rounded) distinct lengths that keeps the maximum."""
    candidates = np.unique(-(-np.asarray(lengths) // multiple_of) * multiple_of)
    best = np.inf
    for size in range(1, min(budget, candidates.size) + 1):
        for lower in itertools.combinations(candidates[:-1].tolist(), size - 1):
            table = (*lower, int(candidates[-1]))
            best = min(best, float(np.sum(cost(padded_lengths(lengths, table)))))
    return best


# --- lookup --------------------------------------------------------------------------------------------


def test_pad_to_bucket_returns_smallest_bucket_at_least_n():
    assert pad_to_bucket(1, (4, 8)) == 4
    assert pad_to_bucket(4, (4, 8)) == 4
    assert pad_to_bucket(5, (4, 8)) == 8


def test_pad_to_bucket_raises_naming_n_and_top_when_too_long():
    with pytest.raises(ValueError, match=r"n=9 exceeds the largest bucket 8"):
        pad_to_bucket(9, (4, 8))


def test_chunk_buckets_splits_into_top_chunks_and_bucketed_remainder():
    assert chunk_buckets(20, (4, 8)) == (8, 8, 4)
    assert chunk_buckets(16, (4, 8)) == (8, 8)
    assert chunk_buckets(3, (4, 8)) == (4,)


def test_padded_lengths_chunks_or_raises_above_top():
    assert padded_lengths([1, 4, 5, 20], (4, 8), overflow="chunk").tolist() == [4, 4, 8, 20]
    with pytest.raises(ValueError, match="n=20 exceeds the largest bucket 8"):
        padded_lengths([1, 20], (4, 8))


def test_padded_lengths_rejects_zero_and_fractional_lengths():
    with pytest.raises(ValueError, match="positive"):
        padded_lengths([0, 3], (4,))
    with pytest.raises(ValueError, match="integers"):
        padded_lengths([1.5], (4,))


# --- strategies on hand-computed cases -----------------------------------------------------------------


def test_pad_to_max_has_one_bucket_at_the_maximum():
    assert PadToMax.from_sample([3, 70, 5]).buckets == (70,)


def test_powers_of_two_start_at_minimum_and_cover_max():
    assert PowersOfTwo(100).buckets == (16, 32, 64, 128)
    assert PowersOfTwo(100, min_bucket=20).buckets == (32, 64, 128)
    assert PowersOfTwo(5, min_bucket=1).buckets == (1, 2, 4, 8)
    assert PowersOfTwo(8, min_bucket=16).buckets == (16,)


def test_powers_of_two_raise_minimum_when_over_budget():
    assert PowersOfTwo.from_sample([3, 100], budget=2).buckets == (64, 128)
    assert PowersOfTwo.from_sample([3, 100], budget=12).buckets == (16, 32, 64, 128)


def test_fixed_list_keeps_table_and_rejects_unsorted():
    assert FixedList((64, 128)).bucket_for(65) == 128
    with pytest.raises(ValueError, match="strictly increasing"):
        FixedList((128, 64))


def test_linear_uses_multiples_of_step():
    assert Linear(10, 35).buckets == (10, 20, 30, 40)
    assert Linear.from_sample([1, 35], budget=4).buckets == (9, 18, 27, 36)


def test_quantile_boundaries_are_sample_quantiles():
    assert Quantile.from_sample(list(range(1, 9)), budget=4).buckets == (2, 4, 6, 8)
    assert Quantile.from_sample([5, 5, 5, 5, 9], budget=4).buckets == (5, 9)


def test_mean_k_sigma_overflows_to_next_bucket_above_cap():
    # mean 28, std 36, so the cap at k=1 is 64; 100 is above it.
    strategy = MeanKSigma.from_sample([10, 10, 10, 10, 100], budget=3, k=1.0)
    assert (strategy.cap, strategy.buckets) == (64, (32, 64, 100))
    assert strategy.bucket_for(65) == 100
    assert "1 of 5 lengths (20.0%) overflow to the next bucket up, 100" in strategy.describe_policy([10] * 4 + [100])


def test_mean_k_sigma_chunks_above_cap_when_policy_is_chunk():
    strategy = MeanKSigma.from_sample([10, 10, 10, 10, 100], budget=3, k=1.0, policy="chunk")
    assert strategy.buckets == (22, 43, 64)
    assert strategy.bucket_for(100) == 64 + 43
    assert strategy.pad(np.array([100, 5])).tolist() == [107, 22]
    assert "are chunked into pieces of 64" in strategy.describe_policy([100])


def test_mean_k_sigma_spends_all_programs_below_max_when_nothing_overflows():
    assert MeanKSigma.from_sample([10, 12], budget=2, k=2.0).buckets == (6, 12)


def test_strategy_rejects_length_above_top_naming_it():
    with pytest.raises(ValueError, match="n=129 exceeds the largest bucket 128"):
        PowersOfTwo(100).bucket_for(129)


def test_strategies_serve_batch_axis_with_same_interface():
    batch_sizes = np.array([1, 3, 3, 7, 12, 12, 30])
    assert PowersOfTwo(32, min_bucket=1).pad(batch_sizes).tolist() == [1, 4, 4, 8, 16, 16, 32]
    assert Fitted.from_sample(batch_sizes, budget=3).buckets == (3, 12, 30)


# --- the exact fit -------------------------------------------------------------------------------------


def test_fit_buckets_matches_hand_computed_optimum():
    # (3, 11, 50) pads 1->3, 2->3, 10->11: 4 tokens; every other 3-bucket table pads more.
    assert fit_buckets([1, 2, 3, 10, 11, 50], budget=3) == (3, 11, 50)


def test_fit_buckets_returns_every_distinct_length_when_budget_allows():
    assert fit_buckets([5, 1, 5, 3], budget=8) == (1, 3, 5)


def test_fit_buckets_rounds_to_multiple():
    assert fit_buckets([1, 1, 9, 17], budget=2, multiple_of=8) == (8, 24)


def test_fit_buckets_rejects_decreasing_cost():
    with pytest.raises(ValueError, match="nondecreasing"):
        fit_buckets([1, 2, 3], budget=2, cost=lambda n: -np.asarray(n, dtype=float))


@settings(max_examples=300, deadline=None)
@given(samples, st.integers(min_value=1, max_value=5), cost_models, st.sampled_from([1, 4]))
def test_fit_buckets_matches_brute_force_on_small_samples(lengths, budget, cost, multiple_of):
    table = fit_buckets(lengths, budget, cost, multiple_of=multiple_of)
    assert len(table) <= budget and table[-1] == -(-max(lengths) // multiple_of) * multiple_of
    assert all(b % multiple_of == 0 for b in table)
    fitted_cost = float(np.sum(cost(padded_lengths(lengths, table))))
    assert fitted_cost == pytest.approx(_brute_force_cost(lengths, budget, cost, multiple_of), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(samples, st.integers(min_value=1, max_value=6))
def test_fitted_is_never_worse_than_other_strategies_at_same_budget(lengths, budget):
    fitted_waste = padding_metrics(Fitted.from_sample(lengths, budget), lengths).padded_tokens
    for strategy in strategies_at_budget(lengths, budget):
        assert len(strategy.buckets) <= budget
        assert fitted_waste <= padding_metrics(strategy, lengths).padded_tokens, strategy


@settings(max_examples=200, deadline=None)
@given(samples, st.integers(min_value=1, max_value=8), st.data())
def test_every_length_maps_to_bucket_at_least_itself(lengths, budget, data):
    for strategy in strategies_at_budget(lengths, budget):
        query = data.draw(st.integers(min_value=1, max_value=max(lengths)))
        assert strategy.bucket_for(query) >= query
        assert strategy.bucket_for(query) in strategy.buckets
        assert np.all(strategy.pad(np.array(lengths)) >= lengths)
        assert strategy.pad(np.array([query])).tolist() == [strategy.bucket_for(query)]


def test_fit_buckets_on_100k_lengths_with_32_buckets_is_fast():
    lengths = np.maximum(1, np.rint(np.random.default_rng(0).lognormal(6.63, 0.99, 100_000))).astype(int)
    start = time.perf_counter()
    table = fit_buckets(lengths, budget=32)
    elapsed = time.perf_counter() - start
    assert len(table) == 32 and table[-1] == lengths.max()
    assert elapsed < 5.0, f"fit took {elapsed:.2f} s"


# --- metrics -------------------------------------------------------------------------------------------


def test_padding_metrics_match_hand_computed_values():
    metrics = padding_metrics(FixedList((4, 8)), [1, 4, 5, 8])  # padded 4, 4, 8, 8
    assert (metrics.real_tokens, metrics.padded_tokens, metrics.num_programs) == (18, 24, 2)
    assert metrics.token_waste == pytest.approx(6 / 24)
    assert (metrics.mean_padding, metrics.max_padding, metrics.num_over_top) == (1.5, 3, 0)


def test_padding_metrics_chunk_and_count_requests_over_top():
    metrics = padding_metrics(FixedList((4, 8)), [1, 4, 5, 8, 20])  # 20 -> 8 + 8 + 4
    assert (metrics.real_tokens, metrics.padded_tokens, metrics.num_over_top) == (38, 44, 1)


def test_padding_metrics_cost_waste_uses_cost_model():
    # c(n) = n + n^2 / 2: padded 2·c(4) = 24, real c(1) + c(3) = 9.
    metrics = padding_metrics(FixedList((4,)), [1, 3], cost=CostModel(linear=1.0, quadratic=0.5))
    assert metrics.cost_waste == pytest.approx(15 / 24)
    assert metrics.token_waste == pytest.approx(4 / 8)


def test_batch_padding_pads_each_batch_to_longest_member():
    assert batch_padding([1, 5, 2, 6], batch_size=2) == buckets.BatchMetrics(2, 14, 22)
    assert batch_padding([1, 5, 2, 6], batch_size=2, sort=True) == buckets.BatchMetrics(2, 14, 16)
    assert batch_padding([3, 1, 2], batch_size=2) == buckets.BatchMetrics(2, 6, 8)


def test_batch_padding_rounds_longest_member_to_bucket():
    assert batch_padding([1, 5, 2, 6], 2, FixedList((4, 8))).padded_tokens == 32
    assert batch_padding([1, 5, 2, 6], 2, FixedList((4, 8)), sort=True).padded_tokens == 24


def test_batch_indices_sorts_by_length_for_offline_jobs():
    assert [b.tolist() for b in batch_indices([3, 1, 2], 2, sort=True)] == [[1, 2], [0]]
    assert [b.tolist() for b in batch_indices([3, 1, 2], 2)] == [[0, 1], [2]]


def test_packing_pads_only_the_end_of_each_step():
    assert packing([3, 3, 3, 7], token_budget=8) == buckets.BatchMetrics(3, 16, 24)
    assert packing([20, 3], token_budget=8) == buckets.BatchMetrics(3, 23, 24)
    assert packing([8, 8], token_budget=8).waste == 0.0
