"""The library's run loop driven over an Engine without a tokenizer, and the dense-argmax check of greedy outputs:
shared by the engine tests and the bucket-table tests that run a warmed engine."""

from conftest import padded_logits
from jaxinfer.api import Prompt
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.request import Request
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor


def run_engine(engine: Engine, prompts: list[Prompt], eos_id=None, *, num_pages=None, engine_cfg=None):
    """The library's run loop without a tokenizer; returns (outputs by index, scheduler stats, plans).
    `num_pages`: the scheduler may use fewer pages than the pool holds (the programs depend on the
    pool's shape only); `engine_cfg`: scheduler-side settings (prefix caching) over the same programs."""
    engine_cfg = engine.engine_cfg if engine_cfg is None else engine_cfg
    scheduler = Scheduler(engine_cfg, engine.num_pages if num_pages is None else num_pages)
    requests = [Request(str(p.index), p.token_ids, p.params, seed=p.index, arrival_index=p.index) for p in prompts]
    for r in requests:
        scheduler.add(r)
    plans = []
    processor = OutputProcessor(None, eos_id, engine_cfg.max_context)
    finished = list(runloop.run(scheduler, engine.step, processor, on_step=lambda plan, *_: plans.append(plan)))
    assert len(finished) == len(requests) and not [r.error for r in finished if r.error]
    return {int(r.request_id): r.output_ids for r in requests}, scheduler.stats, plans


def assert_greedy_is_dense_argmax(cfg, params, prompts: list[Prompt], outputs: dict[int, list[int]]) -> None:
    """The independent reference: greedy means every output token is the argmax of the plain forward (no
    cache, no pages, no batch, no sampler; the path test_model_reference checks against HF) over the
    prompt and the output tokens before it, so one teacher-forced forward per request checks every token."""
    for p in prompts:
        out = outputs[p.index]
        assert len(out) == p.params.max_tokens, f"request {p.index}: {len(out)} tokens, max_tokens {p.params.max_tokens}"
        (logits,) = padded_logits(cfg, params, [p.token_ids + out[:-1]])
        logits = logits[len(p.token_ids) - 1 :]  # the logits that chose each output token
        expected = logits.argmax(-1).tolist()
        if out != expected:
            j = next(j for j, (a, b) in enumerate(zip(out, expected)) if a != b)
            gap = logits[j, expected[j]] - logits[j, out[j]]
            raise AssertionError(f"request {p.index} (prompt {len(p.token_ids)} tokens): token {j} is {out[j]}, the dense argmax {expected[j]} (logit gap {gap:.3g})")
