"""Fakes shared by the host-side tests: a paged engine that checks every plan, and its helpers.

`FakePagedEngine` keeps a numpy "pool" of token ids per (page, offset). It writes each plan's tokens to
their slots, reads each sampled row's context back through its block table, and returns a token that is
a hash of that whole context. If any slot mapping, block table, chunk or preemption were wrong, the
tokens would differ from `expected_output`, the hash chain of the true sequence. No jax.
"""

import numpy as np

from jaxinfer.scheduling import runloop
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler

VOCAB = 1000


def small_config(**overrides) -> EngineConfig:
    base = dict(
        page_size=4, max_context=32, max_num_seqs=4, max_prefill_tokens=8,
        prefill_chunk_buckets=(4, 8), prefill_seq_buckets=(1, 2), decode_batch_buckets=(2, 4), compilation_cache_dir=None,
    )
    return EngineConfig(**(base | overrides))


def request(rid: str, prompt_len: int, max_tokens: int, index: int = 0, priority: int = 0) -> Request:
    prompt = [(7 * index + 3 * i + 1) % VOCAB for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), seed=0, arrival_index=index, priority=priority)


def context_hash(tokens) -> int:
    value = 17
    for t in tokens:
        value = (value * 131 + int(t) + 1) % VOCAB
    return value


class FakePagedEngine:
    """A step function over a pool of token ids; each sampled token hashes the context its row read."""

    def __init__(self, num_pages: int, page_size: int):
        self.slots = np.full((num_pages, page_size), -1, np.int64)
        self.page_size = page_size

    def step(self, plan) -> np.ndarray:
        real = len(plan.request_ids)
        self.slots[plan.slot_pages, plan.slot_offsets] = plan.token_ids  # padding lands on page 0
        slots_per_row = plan.logit_indices.shape[1]
        out = np.zeros(plan.logit_indices.size, np.int32)
        for index in range(real):
            row, slot = divmod(index, slots_per_row)
            last = plan.logit_indices[row, slot]
            segment = plan.token_segments[row, last]
            table = plan.block_tables[row, plan.page_segments[row] == segment]  # the sequence's own pages, in order
            positions = np.arange(plan.positions[row, last] + 1)
            pages = table[positions // self.page_size]
            assert (pages != 0).all(), "a real token reads the null page"
            out[index] = context_hash(self.slots[pages, positions % self.page_size])
        return out


def expected_output(req: Request) -> list[int]:
    tokens = list(req.prompt_ids)
    for _ in range(req.params.max_tokens):
        tokens.append(context_hash(tokens))
    return tokens[len(req.prompt_ids):]


def run_to_completion(scheduler: Scheduler, engine: FakePagedEngine, max_steps: int = 2000):
    """The library's run loop over the fake engine; fails if any request errors or it runs too long."""
    plans = []

    def on_step(plan, *_):
        plans.append(plan)
        assert len(plans) <= max_steps, "did not finish"

    processor = OutputProcessor(None, None, scheduler.cfg.max_context)
    finished = list(runloop.run(scheduler, engine.step, processor, on_step=on_step))
    assert not [r.error for r in finished if r.finish_reason == "error"]
    return finished, plans
