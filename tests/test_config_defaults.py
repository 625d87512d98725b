"""The engine's default bucket tables are literals in config.py; the fit they came from still gives them."""

import pytest

from jaxinfer.config import DEFAULT_CHUNK_BUCKETS, EngineConfig, fitted_chunk_buckets


@pytest.mark.slow  # the fit dry-runs 2000 requests through the scheduler
def test_default_chunk_buckets_are_the_fit_plus_the_chat_bucket():
    assert DEFAULT_CHUNK_BUCKETS == (32,) + fitted_chunk_buckets()


def test_default_chunk_buckets_are_cut_at_the_prefill_budget_and_context():
    assert EngineConfig().prefill_chunk_buckets == DEFAULT_CHUNK_BUCKETS
    assert EngineConfig(max_prefill_tokens=256).prefill_chunk_buckets == (32, 80, 160, 224, 256)
    assert EngineConfig(max_context=64, page_size=16).prefill_chunk_buckets == (32, 64)
