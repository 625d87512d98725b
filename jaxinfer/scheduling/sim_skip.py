"""The simulator's fast-forward: runs of decode iterations that must repeat the one before, applied at once.
Host only, no jax.

Between two events the scheduler's decode iterations repeat (under a policy that does not learn from
each step): every running request is decoding, none can be admitted (no free sequence slot, or nothing waiting and no arrival due), none finishes, and no row's
page count leaves its page bucket, so the split into programs (sorted by length, costed on bucketed pages)
and every program key are those of the iteration just run. `fast_forward` finds how many such iterations
come next (k) and applies them as the scheduler and the run loop would have: the pages each request
needs (allocated through the KV manager, as `_reserve_decode_pages` would, only when all of them fit),
k tokens per request, the scheduler's statistics, the step counts and the virtual clock (moved plan by plan, as
the run loop moves it, so every later time is the run loop's to the bit). With a sequence slot free and an
arrival to come, k stops before the first iteration that starts at or after it on that clock; so it does with every
slot taken under a policy with its own admission order, which every iteration calls (the prefix policy prunes its
ranks there, so a prune falls between the same two arrivals as step by step). With two or more rows that name their
pages as they fill (equal whole prompts name theirs alike, and the first to fill a page keeps the name), k stops before
the first iteration at which one fills a page, so that they name in the run loop's order.

The iteration after them is the event. When that event is only a finish (the iteration repeats the plans
once more, and some of its rows take their last token), it is applied too, as the run loop applies a
step: per plan, the clock moves on by the plan's seconds, its rows take their token, and the output
processor (`run.processor`, the run loop's) decides who is done, whom `Scheduler.finish` then ends at
that time. Every other event (an admission, a preemption, a bucket change, an arrival) runs for real.

With the rows on the decode clock (sim_decode.py), the same is done from its kept events (`_fast_forward_on_clock`):
the bounds are the earliest last token and bucket end, k iterations are k ticks, and only the rows whose
pages run out, fill or end within them are visited, in the order and with the calls given above.
"""

import math

from jaxinfer.scheduling.bucket_tables import pad_to_bucket
from jaxinfer.scheduling.request import RequestStatus
from jaxinfer.scheduling.sim_decode import end_plan, in_order


def bounds(run, plans) -> tuple[int, int] | None:
    """(iterations before a row takes its last token, iterations that repeat `plans` finishes aside), or
    None when the next iteration is not known to repeat them."""
    scan = _scan(run, plans, run.scheduler.kv.num_pages_held_by(run.scheduler.running))
    return None if scan is None else scan[:2]


def _scan(run, plans, held: list[int]) -> tuple[int, int, list[int]] | None:
    """bounds, given the pages each running request holds (`held`, in running order), with each one's
    tokens (prompt + generated, in running order) read on the way."""
    scheduler, cfg = run.scheduler, run.cfg
    running, policy = scheduler.running, scheduler.policy
    if not running or policy.learns_from_steps():
        return None  # a policy that learns from every step (adaptive budgets, EDF's rate) may decide otherwise at each
    if any(p.phase != "decode" for p in plans) or sorted([i for p in plans for i in p.request_ids]) != sorted([r.request_id for r in running]):
        return None  # the last iteration's rows are the running requests (none finished or was admitted since)
    width = policy.decode_width()
    if scheduler.waiting and len(running) < width:
        return None
    page_size, max_context = cfg.page_size, cfg.max_context
    tops = {pages: pad_to_bucket(pages, scheduler.tables.pages) * page_size for pages in set(held)}  # tokens its page bucket holds
    finish = other = math.inf
    tokens, running_status = [], RequestStatus.RUNNING
    for r, pages in zip(running, held):
        generated = len(r.output_ids)
        total = len(r.prompt_ids) + generated
        computed = r.num_computed_tokens
        if r.status != running_status or computed != total - 1 or not generated:  # decoding (Scheduler.in_decode): its newest token is an output
            return None
        finish = min(finish, r.params.max_tokens - generated, max_context - total)
        if tops[pages] - computed < other:
            other = tops[pages] - computed
        tokens.append(total)
    naming = [total for r, total in zip(running, tokens) if r.public_pages is None] if cfg.enable_prefix_caching else []
    if len(naming) > 1:  # rows that name their pages as they fill, in the order they fill (DecodeRows.ticks_before_naming)
        other = min(other, min((-total) % page_size for total in naming))
    if run.timed and (len(running) < width or scheduler.policy_orders):  # an arrival is admitted, or ordered, at the first iteration after it
        other = _before_arrival(run, plans, min(finish, other))
    return int(finish) - 1, int(other), tokens


def _before_arrival(run, plans, limit: int) -> int:
    """The iterations of `plans` from now that start before the next arrival (at most `limit`): iteration j starts
    at the clock after j - 1 of them, added plan by plan as the run loop adds them (an arrival at or before an
    iteration's start is admitted at it: _Run._arrive)."""
    if limit < 1:
        return limit
    arrival, now = run.timed[-1][0], run.clock.now
    seconds = [run.step_seconds(p) for p in plans]
    started = 1  # the first starts now, before the arrival (every arrival due was submitted)
    while started < limit:
        for s in seconds:
            now += s
        if now >= arrival:
            break
        started += 1
    return started


def repeats(run, plans) -> int:
    """How many iterations from now must repeat `plans` (the last iteration's) with no row finishing; 0
    when not known to."""
    known = bounds(run, plans)
    return max(0, min(known)) if known else 0


def _new_pages(page_size: int, tokens: list[int], held: list[int], k: int) -> list[int]:
    """Pages each running request lacks to hold k more computed tokens (kv.num_new_pages), in running order,
    given its tokens (`tokens`; its computed tokens are one fewer) and the pages it holds (`held`)."""
    return [max(0, -(-(total - 1 + k) // page_size) - pages) for total, pages in zip(tokens, held)]


def fast_forward(run, plans) -> bool:
    """Apply the iterations that must repeat `plans`, if any, and the finishing one after them when it
    repeats them too (see the module's docstring); True when requests finished (the caller pulls more)."""
    scheduler = run.scheduler
    for p in plans:  # as _scan decides, before reading every row's pages
        if p.phase != "decode":
            return False
    if scheduler.lazy is not None:
        return _fast_forward_on_clock(run, plans)
    held = scheduler.kv.num_pages_held_by(scheduler.running)
    scan = _scan(run, plans, held)
    if scan is None:
        return False
    finish, other, tokens = scan
    k = max(0, min(finish, other))
    size, free = run.cfg.page_size, scheduler.kv.num_free_pages
    grown = _new_pages(size, tokens, held, k)
    if k and sum(grown) > free:
        return False
    finishing = finish < other and sum(_new_pages(size, tokens, held, k + 1)) <= free  # iteration k + 1 repeats too, and ends rows
    if k:
        _record_utilization(scheduler, k, size, tokens, held)  # each iteration's planning records it after its allocation
        _allocate(scheduler, grown, k)
        _apply(run, plans, k)
        tokens, held = [total + k for total in tokens], [pages + more for pages, more in zip(held, grown)]
    if finishing:
        grown = _new_pages(size, tokens, held, 1)
        _allocate(scheduler, grown, 1)
        _record_utilization(scheduler, 1, size, tokens, [pages + more for pages, more in zip(held, grown)])
        _apply_last(run, plans)
    return finishing


def _bounds_on_clock(run, plans) -> tuple[int, int] | None:
    """_scan's (finish, other) bounds for rows on the decode clock (sim_decode.py), from its kept events: every
    registered row decodes, and its tokens are base + ticks."""
    scheduler = run.scheduler
    running, policy, lazy = scheduler.running, scheduler.policy, scheduler.lazy
    scheduler.register_decoders()
    if not running or policy.learns_from_steps() or len(lazy.rows) != len(running):
        return None
    if sum([len(p.request_ids) for p in plans]) != len(running):
        return None
    width = policy.decode_width()
    if len(running) < width and scheduler.waiting:
        return None
    ticks = scheduler.decode_clock.ticks
    finish = lazy.min_finish() - ticks  # min over rows of min(max_tokens - generated, max_context - total)
    other = min(lazy.min_top() - ticks + 1, lazy.ticks_before_naming())  # min over rows of (tokens its page bucket holds - computed)
    if run.timed and (len(running) < width or scheduler.policy_orders):
        other = _before_arrival(run, plans, min(finish, other))
    return finish - 1, other


def _fast_forward_on_clock(run, plans) -> bool:
    """fast_forward for rows on the decode clock: the same bounds, pages, statistics and order, visiting only
    the rows whose pages run out within the iterations applied."""
    scan = _bounds_on_clock(run, plans)
    if scan is None:
        return False
    scheduler, size = run.scheduler, run.cfg.page_size
    lazy, kv = scheduler.lazy, scheduler.kv
    finish, other = scan
    k = max(0, min(finish, other))
    ticks = scheduler.decode_clock.ticks
    rows = lazy.needing_pages(ticks + k + 1)  # the only rows that lack pages for k + 1 more tokens
    tokens = [r._total_base + ticks for r in rows]
    held = kv.num_pages_held_by(rows)
    free = kv.num_free_pages
    grown = _new_pages(size, tokens, held, k)
    finishing = finish < other and sum(_new_pages(size, tokens, held, k + 1)) <= free
    if k and sum(grown) > free:
        finishing = k = 0
    filled, count = lazy.base_sum + len(lazy.rows) * ticks, len(lazy.rows)
    if k:
        _record_rows_utilization(scheduler, k, size, tokens, held, filled, count)
        _allocate_rows(scheduler, rows, grown, k)
        _apply(run, plans, k)
        tokens, held = [total + k for total in tokens], [pages + more for pages, more in zip(held, grown)]
        filled += count * k
    if finishing:
        grown = _new_pages(size, tokens, held, 1)
        _allocate_rows(scheduler, rows, grown, 1)
        _record_rows_utilization(scheduler, 1, size, tokens, [pages + more for pages, more in zip(held, grown)], filled, count)
        _apply_last(run, plans)
    return finishing


def _allocate_rows(scheduler, rows, grown: list[int], k: int) -> None:
    """_allocate for these rows (in running order; the others need no page)."""
    kv = scheduler.kv
    for r, pages in zip(rows, grown):
        if pages:
            if kv.try_allocate(r, r.num_computed_tokens + k) is None:
                raise RuntimeError("fast-forward: pages counted free could not be allocated")
            scheduler.note_allocated(r)


def _allocate(scheduler, grown: list[int], k: int) -> None:
    """The pages each running request lacks for k more tokens (`grown`, counted free), as
    `_reserve_decode_pages` allocates them, in running order."""
    kv, lazy = scheduler.kv, scheduler.lazy is not None
    for r, pages in zip(scheduler.running, grown):
        if not pages:
            continue
        if kv.try_allocate(r, r.num_computed_tokens + k) is None:  # none needed: try_allocate allocates nothing
            raise RuntimeError("fast-forward: pages counted free could not be allocated")  # fast_forward counted them free
        if lazy:
            scheduler.note_allocated(r)


def _apply(run, plans, k: int) -> None:
    """k iterations of `plans`, their pages allocated: tokens, statistics, steps and the clock."""
    scheduler, steps = run.scheduler, run.steps_by_key
    stats = scheduler.stats
    _advance(scheduler, scheduler.running, k)
    real = padded = 0
    for p in plans:
        real += p.num_real_tokens
        padded += p.num_padded_tokens
        steps[p.bucket] += k
    stats.num_steps += k * len(plans)
    stats.real_tokens += k * real
    stats.padded_tokens += k * padded
    seconds, now = [run.step_seconds(p) for p in plans], run.clock.now
    for _ in range(k):  # plan by plan, as the run loop adds them: k * their sum rounds otherwise
        for s in seconds:
            now += s
    run.clock.now = run.last_step = now


def _apply_last(run, plans) -> None:
    """One iteration of `plans`, its pages allocated, in the run loop's per-plan order: each plan's rows
    take their token and are checked by the output processor after its step."""
    scheduler = run.scheduler
    by_id, lazy = scheduler.running_by_id, scheduler.lazy
    if lazy is not None:  # every row's token at one tick of the decode clock; only the rows filling a page or finishing are visited
        scheduler.decode_clock.ticks += 1
        order = scheduler.decode_order  # the plans' rows, one plan after the other (no row left since they were planned: _scan)
        filling, finishing = in_order(lazy.filling(), order), in_order(lazy.finishing(), order)
        first = 0
        for p in plans:
            _count_plan(run, p)
            last = first + len(p.request_ids)
            for r in end_plan(scheduler, filling, finishing, first, last):
                run.retire(r)
            first = last
        return
    for p in plans:
        rows = [by_id[i] for i in p.request_ids]
        _count_plan(run, p)
        _advance(scheduler, rows, 1)
        for r in rows:  # finish() changes running_by_id, after every row was looked up
            reason = run.processor.check(r)
            if reason is not None:
                scheduler.finish(r, reason, r.error)
                run.retire(r)


def _count_plan(run, p) -> None:
    """One more step of plan `p`: the scheduler's statistics, the step counts and the clock."""
    stats = run.scheduler.stats
    stats.num_steps += 1
    stats.real_tokens += p.num_real_tokens
    stats.padded_tokens += p.num_padded_tokens
    run.steps_by_key[p.bucket] += 1
    run.clock.advance(run.step_seconds(p))
    run.last_step = run.clock.now


def _record_utilization(scheduler, k: int, page_size: int, tokens: list[int], held: list[int]) -> None:
    """The simulator's utilization statistic (sim_scheduler.SketchScheduler._record_utilization) as each of the
    next k decode iterations' planning records it, after its allocation: iteration j (1..k) holds T + j - 1
    tokens per row (T: `tokens`), all in its pages, and each row's pages are those it holds now (`held`)
    or, if more, those T + j - 1 tokens need. Exact integers divided once per iteration, summed in order,
    as one step at a time adds them. A page shared through the prefix cache counts once."""
    new_at = [0] * (k + 1)  # new_at[j]: rows whose pages first overflow at iteration j (a row past several pages counts once per page)
    for total, pages in zip(tokens, held):
        j = pages * page_size - total + 2  # the first iteration whose tokens (total + j - 1) need one more page
        while j <= k:
            new_at[max(j, 1)] += 1
            j += page_size
    _add_utilization(scheduler, k, page_size, new_at, sum(tokens), len(tokens))


def _record_rows_utilization(scheduler, k: int, page_size: int, tokens: list[int], held: list[int], filled: int, rows: int) -> None:
    """_record_utilization when only these rows' pages may run out within k iterations; `filled`: every running
    row's tokens, `rows`: how many run."""
    new_at = [0] * (k + 1)
    for total, pages in zip(tokens, held):
        j = pages * page_size - total + 2
        while j <= k:
            new_at[max(j, 1)] += 1
            j += page_size
    _add_utilization(scheduler, k, page_size, new_at, filled, rows)


def _add_utilization(scheduler, k: int, page_size: int, new_at: list[int], tokens: int, rows: int) -> None:
    """Each of k iterations' utilization: `tokens` held by `rows` rows before the first, one more per row and
    iteration, and new_at[j] pages taken at iteration j."""
    # decode allocates fresh pages only, so the shared ones counted twice stay the same over the k iterations
    filled, used = tokens - scheduler.shared_tokens_counted_twice(), scheduler.kv.num_used_pages
    stats = scheduler.stats
    peak, summed = stats.peak_kv_utilization, stats.kv_utilization_sum
    for j in range(1, k + 1):
        used += new_at[j]
        utilization = (filled + rows * (j - 1)) / (used * page_size)
        peak = max(peak, utilization)
        summed += utilization
    stats.peak_kv_utilization, stats.kv_utilization_sum = peak, summed
    stats.kv_utilization_steps += k


def _advance(scheduler, requests, k: int) -> None:
    """k decode tokens (token 0) for each of these running requests, whose pages are allocated (on the decode
    clock, when the scheduler keeps one: `requests` are then every running request, all of them decoding)."""
    if scheduler.lazy is not None:  # the rows that filled a page are the only ones cache_computed_pages_of names pages of
        scheduler.decode_clock.ticks += k
        filled = scheduler.lazy.filled_within(k)
        if filled:
            scheduler.kv.cache_computed_pages_of(filled)
        return
    tokens = [0] * k
    for request in requests:
        request.num_computed_tokens += k
        request.output_ids.extend(tokens)
        request.num_steps += k
    scheduler.kv.cache_computed_pages_of(requests)
