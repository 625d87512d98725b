"""Scoring requests on the host (no jax): `logprob_start` decides which positions get a target and how much
of a cached prefix a scoring request may share; `max_tokens=0` ends a request with its prefill. A fake step
answers each targeted position with a value made from its target (NaN elsewhere), so a misplaced target or
an entry read from the wrong position shows."""

import math

import numpy as np
import pytest

from fakes import small_config
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.plan import Logprobs, StepResult
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor

PAGE = 4


def fake_score_step(plans: list):
    """A step whose prompt log-probability at a position is -(target + 1) / 1000, NaN where there is no target."""

    def step(plan) -> StepResult:
        plans.append(plan)
        targets = plan.targets.reshape(-1)
        values = np.where(targets >= 0, -(targets + 1) / 1000.0, np.nan).astype(np.float32)
        logprobs = Logprobs(values, np.maximum(targets, 0)[:, None].astype(np.int32), values[:, None])
        return StepResult(np.zeros(plan.seeds.shape[0], np.int32), None, logprobs if plan.wants_prompt_logprobs else None)

    return step


def scoring_request(rid: str, prompt: list[int], start: int, index: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0, logprob_start=start)
    return Request(rid, prompt, params, seed=0, arrival_index=index)


def run(scheduler: Scheduler, plans: list) -> list[Request]:
    return list(runloop.run(scheduler, fake_score_step(plans), OutputProcessor(None, None, scheduler.cfg.max_context)))


def test_targets_start_at_logprob_start_and_max_tokens_zero_ends_with_the_prefill():
    scheduler = Scheduler(small_config(max_prefill_tokens=8, prefill_chunk_buckets=(4, 8)), num_pages=16)
    prompt = [10 + i for i in range(11)]
    scheduler.add(scoring_request("s", prompt, start=6))
    plans = []
    (done,) = run(scheduler, plans)
    assert done.finish_reason == "length" and done.output_ids == []
    targeted = [(int(p), int(t)) for plan in plans for p, t in zip(plan.positions[0], plan.targets[0]) if t >= 0]
    assert targeted == [(p, prompt[p + 1]) for p in range(5, 10)]  # logits at 5..9 score tokens 6..10
    assert done.prompt_logprobs[:6] == [None] * 6
    assert [entry[0] for entry in done.prompt_logprobs[6:]] == pytest.approx([-(t + 1) / 1000 for t in prompt[6:]])
    assert not any(math.isnan(entry[0]) for entry in done.prompt_logprobs[6:])


def test_a_scoring_request_shares_cached_pages_only_before_the_token_ahead_of_logprob_start():
    cfg = small_config(max_prefill_tokens=8, prefill_chunk_buckets=(4, 8))
    scheduler = Scheduler(cfg, num_pages=16)
    context = [50 + i for i in range(13)]  # 3 full pages and one token
    scheduler.add(Request("warm", context, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), seed=0))
    run(scheduler, [])
    cases = {"tail": (len(context), 12), "mid": (6, 4), "whole": (0, 0), "second": (1, 0)}  # start -> tokens it may share
    for index, (rid, (start, shared)) in enumerate(cases.items(), start=1):
        scheduler.add(scoring_request(rid, context + [7, 8, 9], start, index))
        plans = []
        (done,) = run(scheduler, plans)
        assert done.num_cached_tokens == shared, (rid, done.num_cached_tokens)
        assert min(int(plan.positions[row, first]) for plan in plans for row, first in plan.chunk_starts()) == shared  # computed from there
        first_scored = max(start, 1)
        assert done.prompt_logprobs[:first_scored] == [None] * first_scored
        assert all(entry is not None for entry in done.prompt_logprobs[first_scored:])


def test_max_tokens_zero_is_refused_without_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0, logprobs=1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
