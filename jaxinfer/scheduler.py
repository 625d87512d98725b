"""Host scheduler: continuous batching over a paged pool. Plain Python and numpy; never imports jax.

Each call to `schedule()` returns the plans of one engine iteration:

  1. decode: every running request whose prompt is fully in the pool gets one token. If its next token
     needs a new page and none is free, requests are preempted by recompute, most recently admitted first
     (their pages are freed, their generated tokens kept, and they re-queue at the front).
  2. prefill: partially prefilled requests continue, then waiting requests are admitted in (priority,
     deadline, arrival) order (earliest deadline first within a priority), under the per-step token budget, the sequence limit and the free pages. A prompt
     longer than the largest chunk bucket is split over several steps (chunked prefill).

`update(plan, tokens)` applies the sampled tokens, checks stop conditions and frees finished requests.
Plans are shaped by the bucket tables of EngineConfig, so the engine only ever sees known shapes.
"""

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxinfer.block_pool import NULL_PAGE, BlockPool, OutOfPagesError
from jaxinfer.buckets import pad_to_bucket
from jaxinfer.config import EngineConfig
from jaxinfer.request import Request, RequestStatus, StepPlan, stop_reason


@dataclasses.dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    real_tokens: int = 0  # tokens computed by steps
    padded_tokens: int = 0  # token slots computed, padding included
    peak_kv_utilization: float = 0.0  # max over steps of tokens in pool / slots of allocated pages
    kv_utilization_sum: float = 0.0  # summed over the steps that hold pages (for the mean)
    kv_utilization_steps: int = 0

    @property
    def mean_kv_utilization(self) -> float:
        return self.kv_utilization_sum / self.kv_utilization_steps if self.kv_utilization_steps else 0.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_pages: int, *, eos_id: int | None = None, detokenize: Callable[[list[int]], str] | None = None):
        self.cfg = cfg
        self.block_pool = BlockPool(num_pages)
        self.eos_id = eos_id
        self.detokenize = detokenize  # needed only for stop strings
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.stats = SchedulerStats()
        self._admissions = 0

    # ------------------------------------------------------------ intake

    def check(self, request: Request) -> None:
        """Raise ValueError if the request can never run under this configuration."""
        check_request(self.cfg, self.block_pool.num_pages, len(request.prompt_ids), request.params.max_tokens)

    def add(self, request: Request) -> None:
        self.check(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ planning

    def expire(self, now: float | None = None) -> list[Request]:
        """Finish, with reason 'timeout', waiting requests whose deadline has passed before they started."""
        now = time.perf_counter() if now is None else now
        expired = [r for r in self.waiting if r.deadline is not None and r.deadline < now and not r.output_ids]
        for request in expired:
            self.waiting.remove(request)
            request.status, request.finish_reason, request.finish_time = RequestStatus.FINISHED, "timeout", now
        return expired

    def schedule(self) -> list[StepPlan]:
        """The plans of one iteration; never empty while requests are running (see _plan_step)."""
        plans = self._plan_step()
        while not plans and self.running:
            # Partial prefills can hold every page while none can grow: free the latest admitted one.
            self._preempt(self.running[-1])
            plans = self._plan_step()
        return plans

    def _plan_step(self) -> list[StepPlan]:
        decode_rows = self._reserve_decode_pages()
        prefill_rows = self._plan_prefill()
        plans = []
        for group in split_decode_rows(decode_rows, self._decode_cost):
            plans.append(self._decode_plan(group))
        if prefill_rows:
            plans.append(self._prefill_plan(prefill_rows))
        self._record_utilization()
        return plans

    def _pages_needed(self, request: Request, num_tokens: int) -> int:
        have = len(self.block_pool.pages_of(request.request_id))
        return max(0, -(-num_tokens // self.cfg.page_size) - have)

    def _reserve_decode_pages(self) -> list[Request]:
        """Give every decoding request room for one more token, preempting when the pool is full."""
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or not request.in_decode:
                continue
            while self._pages_needed(request, request.num_tokens) and not self._try_allocate(request, request.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
        return [r for r in self.running if r.in_decode]

    def _try_allocate(self, request: Request, num_tokens: int) -> bool:
        try:
            self.block_pool.allocate(request.request_id, self._pages_needed(request, num_tokens))
            return True
        except OutOfPagesError:
            return False

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the pages, keep the output, re-queue at the front."""
        self.block_pool.free(request.request_id)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.insert(0, request)

    def _plan_prefill(self) -> list[tuple[Request, int]]:
        """(request, chunk length) pairs under the token budget, the sequence limit and free pages."""
        budget = self.cfg.max_prefill_tokens
        max_rows = self.cfg.prefill_seq_buckets[-1]
        rows: list[tuple[Request, int]] = []
        partial = [r for r in self.running if not r.in_decode]
        for request in partial + self._waiting_in_order():
            if budget <= 0 or len(rows) == max_rows:
                break
            chunk = self._fit_chunk(request, budget)
            if chunk == 0:
                if request.status == RequestStatus.WAITING:
                    break  # no room to admit: keep the priority order, do not skip ahead
                continue
            if request.status == RequestStatus.WAITING:
                self._admit(request)
            rows.append((request, chunk))
            budget -= chunk
        return rows

    def _waiting_in_order(self) -> list[Request]:
        room = self.cfg.max_num_seqs - len(self.running)
        order = lambda r: (r.priority, r.deadline if r.deadline is not None else float("inf"), r.arrival_index)  # noqa: E731
        return sorted(self.waiting, key=order)[: max(room, 0)]

    def _fit_chunk(self, request: Request, budget: int) -> int:
        """Longest chunk (<= budget, <= largest bucket) whose pages can be allocated now; 0 if none."""
        remaining = request.num_tokens - request.num_computed_tokens
        chunk = min(remaining, budget, self.cfg.prefill_chunk_buckets[-1])
        while chunk > 0 and not self._try_allocate(request, request.num_computed_tokens + chunk):
            free_tokens = self.block_pool.num_free * self.cfg.page_size
            spare = len(self.block_pool.pages_of(request.request_id)) * self.cfg.page_size - request.num_computed_tokens
            chunk = min(chunk - 1, spare + free_tokens)
        return chunk

    def _admit(self, request: Request) -> None:
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.admit_index = self._admissions
        self._admissions += 1
        self.running.append(request)

    # ------------------------------------------------------------ plan arrays

    def _decode_shape(self, requests: list[Request]) -> tuple[int, int]:
        """(rows, pages per row) buckets of a decode step over these requests."""
        rows = pad_to_bucket(len(requests), self.cfg.decode_batch_buckets)
        max_pages = max(len(self.block_pool.pages_of(r.request_id)) for r in requests)
        return rows, pad_to_bucket(max_pages, self.cfg.page_buckets)

    def _decode_cost(self, requests: list[Request]) -> float:
        """Modelled cost of one decode step: a fixed part (weights read once) plus rows x (pages + 2)."""
        rows, width = self._decode_shape(requests)
        return self.cfg.decode_split_overhead + rows * (width + 2)

    def _decode_plan(self, requests: list[Request]) -> StepPlan:
        rows, width = self._decode_shape(requests)
        chunks = [(r, r.num_tokens - 1, 1) for r in requests]
        return self._build_plan("decode", chunks, rows, 1, width, [True] * len(requests))

    def _prefill_plan(self, pairs: list[tuple[Request, int]]) -> StepPlan:
        rows = pad_to_bucket(len(pairs), self.cfg.prefill_seq_buckets)
        tokens = pad_to_bucket(max(chunk for _, chunk in pairs), self.cfg.prefill_chunk_buckets)
        chunks = [(r, r.num_computed_tokens, chunk) for r, chunk in pairs]
        samples = [r.num_computed_tokens + chunk == r.num_tokens for r, chunk in pairs]
        # Rows read only the pages they hold (after this chunk's allocation), bucketed like decode.
        max_pages = max(len(self.block_pool.pages_of(r.request_id)) for r, _ in pairs)
        width = max(pad_to_bucket(max_pages, self.cfg.page_buckets), self.cfg.first_chunk_width(tokens))
        return self._build_plan("prefill", chunks, rows, tokens, width, samples)

    def _build_plan(self, phase, chunks, num_rows, num_tokens, width, samples) -> StepPlan:
        """chunks: (request, first position, length) per real row."""
        arrays = _empty_plan_arrays(num_rows, num_tokens, width)
        page_size = self.cfg.page_size
        for row, (request, start, length) in enumerate(chunks):
            pages = np.asarray(self.block_pool.pages_of(request.request_id), np.int32)
            positions = np.arange(start, start + length, dtype=np.int32)
            arrays["token_ids"][row, :length] = [request.token_at(p) for p in positions]
            arrays["positions"][row, :length] = positions
            arrays["slot_pages"][row, :length] = pages[positions // page_size]
            arrays["slot_offsets"][row, :length] = positions % page_size
            arrays["block_tables"][row, : len(pages)] = pages
            arrays["logit_indices"][row] = length - 1
            _fill_sampling(arrays, row, request)
        self.stats.num_steps += 1
        self.stats.real_tokens += sum(length for _, _, length in chunks)
        self.stats.padded_tokens += num_rows * num_tokens
        return StepPlan(
            phase=phase,
            request_ids=tuple(r.request_id for r, _, _ in chunks),
            num_new_tokens=tuple(length for _, _, length in chunks),
            samples=tuple(samples),
            **arrays,
        )

    def _record_utilization(self) -> None:
        used_pages = self.block_pool.num_used
        if used_pages:
            tokens = sum(min(r.num_tokens, len(self.block_pool.pages_of(r.request_id)) * self.cfg.page_size) for r in self.running)
            utilization = tokens / (used_pages * self.cfg.page_size)
            self.stats.peak_kv_utilization = max(self.stats.peak_kv_utilization, utilization)
            self.stats.kv_utilization_sum += utilization
            self.stats.kv_utilization_steps += 1

    # ------------------------------------------------------------ results

    def update(self, plan: StepPlan, tokens: np.ndarray) -> list[Request]:
        """Apply one step's sampled tokens (int[R]); return the requests that finished."""
        by_id = {r.request_id: r for r in self.running}
        finished = []
        now = time.perf_counter()
        for row, request_id in enumerate(plan.request_ids):
            request = by_id.get(request_id)
            if request is None:  # preempted after planning: nothing to apply
                continue
            request.num_computed_tokens += plan.num_new_tokens[row]
            if not plan.samples[row]:
                continue
            request.output_ids.append(int(tokens[row]))
            request.first_token_time = request.first_token_time or now
            if (reason := self._finish_reason(request)) is not None:
                self._finish(request, reason, now)
                finished.append(request)
        return finished

    def _finish_reason(self, request: Request) -> str | None:
        reason = stop_reason(request.output_ids, request.params, self.eos_id)
        if reason is None and request.params.stop and self.detokenize is not None:
            text = self.detokenize(request.output_ids)
            reason = "stop" if any(s in text for s in request.params.stop) else None
        if reason is None and request.num_tokens >= self.cfg.max_context:
            reason = "length"
        return reason

    def _finish(self, request: Request, reason: str, now: float) -> None:
        self.block_pool.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = now


def split_decode_rows(requests: list[Request], cost: Callable[[list[Request]], float]) -> list[list[Request]]:
    """Decode rows as one group, or two groups split by context length when that is cheaper.

    One long sequence would otherwise make every row of the step read as many pages as it does. Rows
    are sorted by length and every split point is costed; the cheapest of (no split, best split) wins.
    """
    if len(requests) < 2:
        return [requests] if requests else []
    ordered = sorted(requests, key=lambda r: r.num_tokens)
    best, groups = cost(ordered), [ordered]
    for split in range(1, len(ordered)):
        total = cost(ordered[:split]) + cost(ordered[split:])
        if total < best:
            best, groups = total, [ordered[:split], ordered[split:]]
    return groups


def check_request(cfg: EngineConfig, num_pages: int, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise ValueError if a prompt of this length can never run: empty, over the context, or needing
    more pages than the whole pool holds."""
    if num_prompt_tokens == 0:
        raise ValueError("empty prompt: at least one token is needed")
    if num_prompt_tokens >= cfg.max_context:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens; the context is {cfg.max_context} (use --truncate to cut it)")
    pages = -(-min(num_prompt_tokens + max_tokens, cfg.max_context) // cfg.page_size)
    if pages > num_pages - 1:
        raise ValueError(f"request needs {pages} KV pages; the pool has {num_pages - 1}")


def _empty_plan_arrays(num_rows: int, num_tokens: int, width: int) -> dict[str, np.ndarray]:
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return {
        "token_ids": zeros(num_rows, num_tokens),
        "positions": zeros(num_rows, num_tokens),
        "block_tables": np.full((num_rows, width), NULL_PAGE, np.int32),
        "slot_pages": np.full((num_rows, num_tokens), NULL_PAGE, np.int32),
        "slot_offsets": zeros(num_rows, num_tokens),
        "logit_indices": zeros(num_rows),
        "temperature": np.zeros(num_rows, np.float32),
        "top_k": zeros(num_rows),
        "top_p": np.ones(num_rows, np.float32),
        "seeds": zeros(num_rows),
        "steps": zeros(num_rows),
    }


def _fill_sampling(arrays: dict[str, np.ndarray], row: int, request: Request) -> None:
    arrays["temperature"][row] = request.params.temperature
    arrays["top_k"][row] = request.params.top_k
    arrays["top_p"][row] = request.params.top_p
    arrays["seeds"][row] = request.seed
    arrays["steps"][row] = len(request.output_ids)
