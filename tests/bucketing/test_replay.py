"""Arrival-time replay: LLM.generate(arrival_times=...) admits each prompt at its time, between
steps, and times it from then; traces.replay scales a trace's times by a rate and reports TTFT, TPOT,
throughput and goodput, here checked against the outputs by hand."""

import dataclasses
import time

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.bucketing.traces import replay, replay_report

ARRIVALS = [0.0, 0.0, 0.6, 0.6, 1.5, 1.5]


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(str(tiny_chat_model), max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=32, compilation_cache_dir=compile_cache)


def test_each_prompt_is_admitted_at_its_arrival_time_and_timed_from_it(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [f"Question number {i}?" for i in range(len(ARRIVALS))]
    llm.generate(prompts[:1], params)  # compiled before the clock starts
    first_step = {}
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, arrival_times=ARRIVALS, on_step=lambda plan, *_: [first_step.setdefault(r, time.perf_counter() - start) for r in plan.request_ids])
    for i, t in enumerate(ARRIVALS):
        assert first_step[str(i)] >= t - 0.01, (i, first_step)  # never before its time
    assert first_step["4"] - 1.5 < 1.0  # and soon after it: the loop sleeps to the next arrival, then admits
    for output in outputs:
        m = output.metrics
        assert abs(m.queue_s + m.prefill_s + m.decode_s - output.latency) < 1e-3
        assert output.latency < 1.5  # from its arrival, not from the start of the run
    plain = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]  # replay changes when, not what
    with pytest.raises(ValueError, match="arrival_times holds 2 times for 6 prompts"):
        llm.generate(prompts, params, arrival_times=[0.0, 1.0])


def test_replay_scales_the_trace_and_reports_what_the_outputs_say(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [f"Tell me about {i}" for i in range(len(ARRIVALS))]
    start = time.perf_counter()
    outputs, report = replay(llm, prompts, params, np.array(ARRIVALS) * 2, rate=2.0, slo_ttft_s=0.5, slo_tpot_s=1.0)
    assert time.perf_counter() - start >= 1.5  # rate 2 over times doubled: the last arrives at 1.5 s
    ttft = np.array([o.time_to_first_token for o in outputs])
    met = np.sum(ttft <= 0.5)
    assert report["slo_attainment"] == round(met / 6, 4) and report["num_requests"] == 6
    duration = max(t + o.latency for t, o in zip(ARRIVALS, outputs))
    assert report["duration_s"] == pytest.approx(duration, abs=1e-3) and report["goodput_requests_per_s"] <= report["requests_per_s"]
    assert report["ttft_p99_s"] == round(float(np.percentile(ttft, 99)), 4)
    assert replay_report(outputs, ARRIVALS, slo_ttft_s=0.0, slo_tpot_s=0.0)["goodput_requests_per_s"] == 0.0
    # two requests shed at arrival (a deadline policy's timeouts): no first token, so no TTFT, and no SLO met
    shed = [dataclasses.replace(o, finish_reason="timeout", token_ids=[], num_generated_tokens=0, time_to_first_token=0.0, latency=0.0)
            if o.index in (1, 4) else o for o in outputs]
    kept = np.array([o.time_to_first_token for o in outputs if o.index not in (1, 4)])
    report = replay_report(shed, ARRIVALS, slo_ttft_s=100.0, slo_tpot_s=100.0)
    assert report["num_finished"] == 4 and report["slo_attainment"] == round(4 / 6, 4)
    assert report["ttft_p50_s"] == round(float(np.percentile(kept, 50)), 4)  # not pulled toward 0 by the requests shed
    with pytest.raises(ValueError, match="rate"):
        replay(llm, prompts, params, ARRIVALS, rate=0.0)
