"""The engine's default bucket tables are literals in bucket_tables.py; the fit they came from still gives them.

The fit lives here, not in the package: it is how the literal was chosen, and only this test runs it (in
the package it closed the one import cycle, config -> runloop -> scheduler -> config).
"""

import numpy as np
import pytest

from jaxinfer.scheduling.bucket_tables import DEFAULT_CHUNK_BUCKETS, BucketTables
from jaxinfer.bucketing.strategies import fit_buckets
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.runloop import dry_run
from jaxinfer.bucketing.traces import synthetic_trace


def fitted_chunk_buckets(budget: int = 6, num_requests: int = 2000, scale: float = 8.0) -> tuple[int, ...]:
    """Prefill chunk buckets fitted (exact DP, buckets.fit_buckets, multiples of 16) to the real sizes of the
    packed prefill rows that the default engine's scheduler plans for a synthetic conversation trace
    (traces.synthetic_trace, seed 0, lengths divided by `scale` as bench_engine scales the Azure trace,
    prompts cut to the context), found by a dry scheduling pass (runloop.dry_run) with every row size a
    bucket. Deterministic; about 3 s. The sample is the packed rows, not the prompts: a row holds the
    chunks of up to max_prefill_seqs sequences, so its size is what a bucket pads."""
    finest = EngineConfig(prefill_chunk_buckets=tuple(range(1, EngineConfig.max_prefill_tokens + 1)), compilation_cache_dir=None)
    trace = synthetic_trace(num_requests, seed=0)
    outputs = np.maximum(1, np.round(trace.generated_tokens / scale)).astype(int)
    prompts = np.minimum(np.maximum(1, np.round(trace.context_tokens / scale)).astype(int), finest.max_context - outputs)
    plans, _ = dry_run(finest, [[i + 1] * int(n) for i, n in enumerate(prompts)], outputs.tolist())  # distinct prompts: no prefix hits
    return fit_buckets([p.bucket.num_tokens for p in plans if p.phase == "prefill"], budget, multiple_of=16)


@pytest.mark.slow  # the fit dry-runs 2000 requests through the scheduler
def test_default_chunk_buckets_are_the_fit_plus_the_chat_bucket():
    assert DEFAULT_CHUNK_BUCKETS == (32,) + fitted_chunk_buckets()


def test_default_chunk_buckets_are_cut_at_the_prefill_budget_and_context():
    chunks = lambda **limits: BucketTables.from_config(EngineConfig(**limits)).chunk_tokens  # noqa: E731
    assert chunks() == DEFAULT_CHUNK_BUCKETS
    assert chunks(max_prefill_tokens=256) == (32, 80, 160, 224, 256)
    assert chunks(max_context=64, page_size=16) == (32, 64)
