"""The one run loop: scheduler -> step -> output processor, until no work is left. Host only, no jax.

`run` is used by `LLM`, the tests (with a fake step) and the benchmarks (through `on_step`). Each
iteration expires requests past their deadline, asks the scheduler for plans, runs each plan, and
hands every sampled token to the output processor, which decides who is done; the scheduler then
frees their pages. Two rules keep one request from taking others down, or the loop from spinning:

- a step that raises fails only the requests of its plan (finish reason 'error', with the reason);
- an iteration with work left but no plan and nothing expired fails the remaining requests, naming
  why, instead of looping forever.
"""

import time
from collections.abc import Callable, Iterator

import numpy as np

from jaxinfer.output import OutputProcessor
from jaxinfer.request import Request, StepPlan
from jaxinfer.scheduler import Scheduler

StepFn = Callable[[StepPlan], np.ndarray]  # plan -> sampled tokens int[R]
OnStep = Callable[[StepPlan, np.ndarray, float], None]  # (plan, tokens, seconds the step took)


def run(scheduler: Scheduler, step: StepFn, processor: OutputProcessor, *, on_step: OnStep | None = None) -> Iterator[Request]:
    """Run until the scheduler has no work; yield each request as soon as it has finished.

    Args:
      scheduler: holds the submitted requests.
      step: runs one plan (Engine.step, or a fake in tests).
      processor: decides when a request is done.
      on_step: called with (plan, tokens, seconds) after every step (benchmarks time and count steps here).
    """
    while scheduler.has_work():
        finished = scheduler.expire()
        plans = scheduler.schedule()
        if not plans and not finished:
            finished = scheduler.abort_all("no step could be planned for this request (the pool or the limits are too small for it)")
        for plan in plans:
            finished += run_plan(scheduler, step, processor, plan, on_step)
        yield from finished


def run_plan(scheduler: Scheduler, step: StepFn, processor: OutputProcessor, plan: StepPlan, on_step: OnStep | None = None) -> list[Request]:
    """Run one plan and apply its tokens; returns the requests it finished."""
    start = time.perf_counter()
    try:
        tokens = step(plan)
    except Exception as e:  # one bad step fails its own rows, not the job
        return scheduler.abort(plan.request_ids, f"the step failed: {type(e).__name__}: {e}")
    if on_step is not None:
        on_step(plan, tokens, time.perf_counter() - start)
    finished = []
    for request in scheduler.update(plan, tokens):
        try:
            reason = processor.check(request)
        except Exception as e:  # a detokenizer failure is this request's error
            finished += scheduler.abort([request.request_id], f"output processing failed: {type(e).__name__}: {e}")
            continue
        if reason is not None:
            scheduler.finish(request, reason)
            finished.append(request)
    return finished
