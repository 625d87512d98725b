"""The simulator's fast-forward: runs of decode iterations that must repeat the one before, applied at once.
Host only, no jax.

Between two events the scheduler's decode iterations repeat (under a policy that does not learn from
each step): every running request is decoding, none can be admitted (no free sequence slot, or nothing waiting and no arrival due), none finishes, and no row's
page count leaves its page bucket, so the split into programs (sorted by length, costed on bucketed pages)
and every program key are those of the iteration just run. `fast_forward` finds how many such iterations
come next (k) and applies them as the scheduler and the run loop would have: the pages each request
needs (allocated through the KV manager, as `_reserve_decode_pages` would, only when all of them fit),
k tokens per request, the scheduler's statistics, the step counts and the virtual clock. The iteration
after them runs for real, so every finish, admission, preemption and bucket change is the scheduler's own.
"""

import math

from jaxinfer.scheduling.bucket_tables import pad_to_bucket
from jaxinfer.scheduling.policies import SchedulingPolicy
from jaxinfer.scheduling.request import RequestStatus


def repeats(run, plans) -> int:
    """How many iterations from now must repeat `plans` (the last iteration's); 0 when not known to."""
    scheduler, cfg = run.scheduler, run.cfg
    running, policy = scheduler.running, scheduler.policy
    if type(policy).observe is not SchedulingPolicy.observe:
        return 0  # a policy that learns from every step (adaptive budgets, EDF's rate) may decide otherwise at each
    if any(p.phase != "decode" for p in plans) or sum(len(p.request_ids) for p in plans) != len(running):
        return 0
    width = policy.decode_width()
    if scheduler.waiting and len(running) < width:
        return 0
    k = math.inf
    for r in running:
        if r.status != RequestStatus.RUNNING or r.num_computed_tokens != r.num_tokens - 1:
            return 0
        left = min(r.params.max_tokens - len(r.output_ids), cfg.max_context - r.num_tokens)
        held = len(scheduler.kv.pages_of(r))
        k = min(k, left - 1, pad_to_bucket(held, scheduler.tables.pages) * cfg.page_size - r.num_computed_tokens)
    if run.timed and len(running) < width:  # an arrival would be admitted at the first iteration after it
        k = min(k, math.floor((run.timed[-1][0] - run.clock.now) / _iteration_seconds(run, plans)))
    return max(0, int(k)) if k != math.inf else 0


def _iteration_seconds(run, plans) -> float:
    return sum(run.costs.step_seconds(p.bucket, len(p.request_ids)) for p in plans)


def _pages_fit(scheduler, k: int, page_size: int) -> bool:
    needed = sum(max(0, -(-(r.num_computed_tokens + k) // page_size) - len(scheduler.kv.pages_of(r))) for r in scheduler.running)
    return needed <= scheduler.kv.num_free_pages


def fast_forward(run, plans) -> None:
    """Apply the iterations that must repeat `plans`, if any (see the module's docstring)."""
    k = repeats(run, plans)
    scheduler = run.scheduler
    if k < 1 or not _pages_fit(scheduler, k, run.cfg.page_size):
        return
    for r in scheduler.running:
        if scheduler.kv.try_allocate(r, r.num_computed_tokens + k) is None:
            raise RuntimeError("fast-forward: pages counted free could not be allocated")  # _pages_fit said they fit
        r.num_computed_tokens += k
        r.output_ids.extend([0] * k)
        r.num_steps += k
        scheduler.kv.cache_computed_pages(r)
    stats = scheduler.stats
    stats.num_steps += k * len(plans)
    stats.real_tokens += k * sum(p.num_real_tokens for p in plans)
    stats.padded_tokens += k * sum(p.num_padded_tokens for p in plans)
    before = stats.kv_utilization_sum
    scheduler._record_utilization()  # one iteration's, as the last of the k sees it; the others as the same
    stats.kv_utilization_sum += (stats.kv_utilization_sum - before) * (k - 1)
    stats.kv_utilization_steps += k - 1
    for p in plans:
        run.steps_by_key[p.bucket] += k
    run.clock.advance(k * _iteration_seconds(run, plans))
    run.last_step = run.clock.now
