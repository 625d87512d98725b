"""The waiting queue against the list it replaced: under random interleavings of push, re-queue at the
front (preemption), removal, admission and expiry, it holds the same requests in the same line order,
and admits in exactly the order that sorting the list by the old key gives (sorted is stable, so ties
of the key go by place in the line). No jax.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.request_queue import RequestQueue


def old_key(r: Request) -> tuple:
    """The scheduler's ordering rule before request_queue.py, as it was written there."""
    return (r.priority, r.deadline if r.deadline is not None else float("inf"), r.arrival_index)


class OldWaitingList(list):
    """The old waiting list: append, insert at the front, remove, sort on every step, scan to expire."""

    def appendleft(self, r: Request) -> None:
        self.insert(0, r)

    def first(self, k: int) -> list[Request]:
        return sorted(self, key=old_key)[: max(k, 0)]

    def expire(self, now: float) -> list[Request]:
        expired = [r for r in self if r.deadline is not None and r.deadline < now and r.admit_index < 0]  # never admitted: not started
        for r in expired:
            self.remove(r)
        return expired


def new_request(name: str, priority: int, deadline: float | None, arrival: int) -> Request:
    return Request(name, [1], SamplingParams(max_tokens=1), seed=0, priority=priority, deadline=deadline, arrival_index=arrival)


def assert_same(queue: RequestQueue, model: OldWaitingList) -> None:
    assert list(queue) == list(model)
    assert len(queue) == len(model) and bool(queue) == bool(model)
    assert list(queue.first(len(model) + 1)) == model.first(len(model) + 1)
    assert queue.peek() is (model.first(1) or [None])[0]
    assert queue.num_with_deadline == sum(r.deadline is not None for r in model)  # where a deadline walk may stop


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.one_of(st.none(), st.integers(0, 6).map(float)), st.integers(0, 3)),
    st.tuples(st.just("admit"), st.integers(0, 5), st.integers(0, 5)),  # walk the first k, admit the first j of them
    st.tuples(st.just("requeue"), st.integers(0, 10**6), st.booleans()),  # a taken-out one back at the front
    st.tuples(st.just("remove"), st.integers(0, 10**6)),
    st.tuples(st.just("expire"), st.integers(0, 7).map(float)),
)


class Driver:
    """Applies one op to the queue and to the old list alike, checking what each returns."""

    def __init__(self):
        self.queue, self.model, self.out = RequestQueue(), OldWaitingList(), []  # out: taken out, not finished
        self.num_added = 0

    def add(self, priority, deadline, arrival):
        r = new_request(f"r{self.num_added}", priority, deadline, arrival)
        self.num_added += 1
        self.queue.append(r)
        self.model.append(r)

    def admit(self, k, j):
        walked = []
        for r in self.queue.first(k):  # removal while walking, as the scheduler admits
            walked.append(r)
            if len(walked) <= j:
                self.queue.remove(r)
        assert walked == self.model.first(k)
        for r in walked[:j]:
            self.model.remove(r)
            self.out.append(r)
            r.admit_index = self.num_added  # as Scheduler._admit numbers it

    def requeue(self, pick, generated):
        if self.out:
            r = self.out.pop(pick % len(self.out))
            if generated:  # preempted after its first token, or before it: admitted once, it never times out while it waits
                r.output_ids.append(7)
            self.queue.appendleft(r)
            self.model.appendleft(r)

    def remove(self, pick):
        if self.model:
            r = self.model[pick % len(self.model)]
            self.queue.remove(r)
            self.model.remove(r)

    def expire(self, now):
        assert self.queue.expire(now) == self.model.expire(now)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPS, max_size=60))
def test_queue_admits_in_the_old_sorted_order_under_any_interleaving(ops):
    driver = Driver()
    for name, *args in ops:
        getattr(driver, name)(*args)
        assert_same(driver.queue, driver.model)
    drained = []
    while (head := driver.queue.peek()) is not None:
        drained.append(head)
        driver.queue.remove(head)
    assert drained == sorted(driver.model, key=old_key)


def test_preempted_request_goes_before_equal_keys_and_latest_preempted_first():
    queue = RequestQueue()
    a, b, c, d = (new_request(name, 0, None, 0) for name in "abcd")  # equal keys: only the line decides
    queue.append(a)
    queue.append(b)
    queue.appendleft(c)
    queue.appendleft(d)
    assert list(queue) == [d, c, a, b] == list(queue.first(4))
    assert list(queue.first(2)) == [d, c]


def test_expire_takes_out_only_requests_past_deadline_that_never_started():
    queue = RequestQueue()
    stale, fresh, started, none = new_request("s", 0, 1.0, 0), new_request("f", 0, 9.0, 1), new_request("g", 0, 1.0, 2), new_request("n", 0, None, 3)
    started.admit_index = 0  # admitted once, then preempted before its first token: it has started
    for r in (stale, fresh, started, none):
        queue.append(r)
    assert queue.expire(1.0) == []  # strictly before now
    assert queue.expire(2.0) == [stale]
    assert list(queue) == [fresh, started, none] and stale not in queue
    assert queue.expire(100.0) == [fresh]


def test_removed_entries_do_not_accumulate():
    queue = RequestQueue()
    requests = [new_request(f"r{i}", i % 3, float(i), i) for i in range(2000)]
    for r in requests:
        queue.append(r)
    for r in requests[:1990]:
        queue.remove(r)
    assert len(queue) == 10
    assert len(queue._order) <= 2 * 10 + 64 and len(queue._deadlines) <= 2 * 10 + 64
    assert list(queue.first(20)) == sorted(requests[1990:], key=old_key)


def test_double_push_and_unknown_remove_are_errors():
    queue, r = RequestQueue(), new_request("r", 0, None, 0)
    queue.append(r)
    with pytest.raises(ValueError, match="already queued"):
        queue.appendleft(r)
    queue.remove(r)
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(r)
