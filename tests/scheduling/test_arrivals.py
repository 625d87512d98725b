"""Replayed arrivals on the real clock (scheduling/arrivals.py): what is due, in what order, and when the next is."""

import time

from jaxinfer.scheduling.arrivals import Arrivals
from jaxinfer.scheduling.request import Prompt, SamplingParams


def _prompt(index: int, arrival_s: float | None) -> Prompt:
    return Prompt(index, [1, 2, 3], SamplingParams(max_tokens=1), arrival_s=arrival_s)


def test_untimed_and_past_prompts_are_due_at_once_and_later_ones_by_due_time_ties_in_submission_order():
    arrivals = Arrivals(time.perf_counter())
    now = [_prompt(0, None), _prompt(1, 0.0)]
    later = [_prompt(2, 50.0), _prompt(3, 20.0), _prompt(4, 20.0)]
    assert [p.index for p in arrivals.hold(now + later)] == [0, 1]
    assert len(arrivals) == 3 and arrivals.due() == []
    assert arrivals.time_of(later[1]) == arrivals.start + 20.0 and arrivals.time_of(now[0]) is None
    assert [p.index for p in arrivals.due(arrivals.start + 20.0)] == [3, 4]
    assert [p.index for p in arrivals.due(arrivals.start + 49.9)] == [] and len(arrivals) == 1
    assert [p.index for p in arrivals.due(arrivals.start + 50.0)] == [2] and len(arrivals) == 0


def test_wait_sleeps_until_the_next_arrival():
    arrivals = Arrivals(time.perf_counter())
    arrivals.hold([_prompt(0, 0.05)])
    arrivals.wait()
    assert time.perf_counter() >= arrivals.start + 0.05 and [p.index for p in arrivals.due()] == [0]
