"""Per-request metrics (issue 26): where each request's latency went, and the summary's percentiles."""

import json

import pytest

from jaxinfer.api import LLM
from jaxinfer.batch.job import BatchJob
from jaxinfer.scheduling.request import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    # 2 programs (one 64-token chunk, the 2-row 8-page decode), not the full tables' 16: the metrics do not depend on them
    return LLM(tiny_chat_model, max_context=128, page_size=16, max_num_seqs=2, max_prefill_tokens=64, compilation_cache_dir=compile_cache,
               prefill_chunk_buckets=(64,), decode_batch_buckets=(2,), decode_page_buckets=(8,))


def test_queue_prefill_and_decode_add_up_to_the_latency(llm):
    prompts = [f"Question {i}: name a colour." for i in range(6)]  # 6 requests, 2 decode rows: some queue
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for out in outputs:
        m = out.metrics
        assert abs(m.queue_s + m.prefill_s + m.decode_s - out.latency) < 1e-3, (m, out.latency)
        assert abs(m.queue_s + m.prefill_s - out.time_to_first_token) < 1e-3
        assert m.time_per_output_token_s == pytest.approx(m.decode_s / (out.num_generated_tokens - 1))
        assert m.num_steps >= out.num_generated_tokens  # a prefill step, then one decode step per later token
        assert min(m.queue_s, m.prefill_s, m.decode_s) >= 0
    assert max(o.metrics.queue_s for o in outputs) > min(o.metrics.queue_s for o in outputs)  # the later ones waited


def test_records_carry_the_metrics_and_the_summary_their_percentiles(llm, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"Say {i}"}) + "\n" for i in range(4)))
    with BatchJob(inp, tmp_path / "out.jsonl", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)) as job:
        summary = job.run(llm, progress=False)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tpots = sorted(r["metrics"]["time_per_output_token_s"] for r in records)
    assert all(set(r["metrics"]) == {"queue_s", "prefill_s", "decode_s", "time_per_output_token_s", "num_steps", "num_preemptions"} for r in records)
    assert summary.tpot_percentile(0) == pytest.approx(tpots[0]) and summary.tpot_percentile(100) == pytest.approx(tpots[-1])
    assert summary.queue_percentile(100) == pytest.approx(max(r["metrics"]["queue_s"] for r in records))
