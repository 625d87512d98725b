"""Embedding requests on the host (no jax): SamplingParams(max_tokens=0, pooling=...) prefills in chunks, packed
beside other prompts, and Request.keep_pooled gathers the chunks' pooled states into the prompt's. A fake
step gives token t at position p the hidden state [t, p, 1] and pools it per sequence slot as the engine
does (at the slot's logit index; summed over its segment up to it), so every expected vector is
hand-computed: "last" [last id, n - 1, 1], "mean" [mean id, (n - 1) / 2, 1]."""

import numpy as np
import pytest

from fakes import small_config
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.plan import StepResult
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.validation import FieldError


def fake_pooling_step(plans: list):
    def step(plan) -> StepResult:
        plans.append(plan)
        hidden = np.stack([plan.token_ids, plan.positions, np.ones_like(plan.positions)], axis=-1).astype(np.float32)  # [R, T, 3]
        rows, slots = plan.logit_indices.shape
        token = np.arange(plan.token_ids.shape[1])[None, :, None]
        own = (plan.token_segments[:, :, None] == np.arange(slots)) & (token <= plan.logit_indices[:, None, :])  # [R, T, J]
        sums = np.einsum("rtd,rtj->rjd", hidden, own.astype(np.float32)).reshape(rows * slots, 3)
        last = np.take_along_axis(hidden, plan.logit_indices[:, :, None], axis=1).reshape(rows * slots, 3)
        pooled = (last, sums) if plan.wants_pooled else ()
        return StepResult(np.zeros(rows * slots, np.int32), None, None, *pooled)

    return step


def embedding_request(rid: str, prompt: list[int], pooling: str, index: int = 0) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=0, pooling=pooling), seed=0, arrival_index=index)


def run(scheduler: Scheduler, plans: list) -> dict[str, Request]:
    return {r.request_id: r for r in runloop.run(scheduler, fake_pooling_step(plans), OutputProcessor(None, None, scheduler.cfg.max_context))}


def expected(prompt: list[int], pooling: str) -> list[float]:
    n = len(prompt)
    return [prompt[-1], n - 1, 1.0] if pooling == "last" else [sum(prompt) / n, (n - 1) / 2, 1.0]


@pytest.mark.parametrize("seq_buckets", [(1,), (1, 2, 4)])  # (1,): chunks packed in one row; else a row each
def test_chunked_and_packed_prompts_pool_every_token_once(seq_buckets):
    scheduler = Scheduler(small_config(max_context=32, prefill_seq_buckets=seq_buckets), num_pages=32)
    prompts = {"a": [5, 9, 11], "b": [20 + i for i in range(11)], "c": [40 + 2 * i for i in range(17)], "d": [7]}
    for i, (rid, prompt) in enumerate(prompts.items()):
        for pooling in ("last", "mean"):
            scheduler.add(embedding_request(f"{rid}-{pooling}", prompt, pooling, index=i))
    plans = []
    done = run(scheduler, plans)
    packed = seq_buckets == (1,)
    assert len(done) == 8 and any((plan.logit_indices.shape[1] > 1) == packed and len(plan.request_ids) > 1 for plan in plans)
    assert sum(1 for plan in plans if "c-mean" in plan.request_ids) >= 3  # 17 tokens in chunks of at most 8
    for rid, request in done.items():
        prompt, pooling = prompts[rid[0]], rid.split("-")[1]
        assert request.finish_reason == "length" and request.output_ids == []
        np.testing.assert_allclose(request.embedding(), expected(prompt, pooling), rtol=1e-6, err_msg=rid)
    assert scheduler.kv.num_used_pages == 0


def test_mean_reads_no_cached_prefix_and_last_starts_after_it():
    scheduler = Scheduler(small_config(max_context=32), num_pages=32)
    prompt = [30 + i for i in range(13)]  # 3 full pages of 4 and one token
    scheduler.add(embedding_request("first", prompt, "last"))
    run(scheduler, [])
    for pooling in ("last", "mean"):
        scheduler.add(embedding_request(pooling, prompt, pooling))
        plans = []
        (request,) = run(scheduler, plans).values()
        first_position = int(plans[0].positions[plans[0].chunk_starts()[0]])
        if pooling == "last":
            assert request.num_cached_tokens > 0 and first_position == request.num_cached_tokens
        else:
            assert request.num_cached_tokens == 0 and first_position == 0
        np.testing.assert_allclose(request.embedding(), expected(prompt, pooling), rtol=1e-6)


def test_pooling_is_checked_and_generates_nothing():
    with pytest.raises(FieldError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")
    with pytest.raises(FieldError, match="max_tokens must be 0"):
        SamplingParams(max_tokens=4, pooling="mean")
    with pytest.raises(FieldError, match="n.*identical"):
        SamplingParams(max_tokens=0, pooling="last", n=2, temperature=1.0)
    assert SamplingParams(max_tokens=0, pooling="last").pooling == "last"
