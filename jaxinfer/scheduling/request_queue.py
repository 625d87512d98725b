"""The scheduler's waiting queue: admission order in O(log n), deadline expiry in O(expired). Host only:
imports the stdlib and jaxinfer.scheduling.request, never jax or numpy.

Admission order is the queue's key, by default `admission_key(request)` = (priority, deadline or +inf,
arrival index) (a scheduling policy may give another: policies.py), then the place the request holds in
the queue's line. The line is what a list with `append` at the back and
`insert(0, ...)` at the front would hold: requests re-queued at the front (preempted ones) come first,
the most recently re-queued first, then the others in the order they were added. Each push gets a
sequence number that encodes that place (-1, -2, ... at the front; 0, 1, ... at the back), so the
line order is the sequence order and the heap key (key, sequence) is unique.

Two heaps with lazy deletion: `_order` (the admission key) and `_deadlines` (deadline, sequence). A
removed request leaves stale entries, told apart by their sequence number (`_seq_of` maps each queued
request to its live one) and dropped when they reach a top, or all at once when they are more than
half a heap (amortized O(1) per removal). Invariant: a request's key (its priority, deadline and arrival
index by default) does not change while it is queued.
"""

import heapq
import itertools
from collections.abc import Callable, Iterator

from jaxinfer.scheduling.request import Request

_REBUILD_SLACK = 64  # stale entries always tolerated before a heap is rebuilt


def admission_key(request: Request) -> tuple:
    """(priority, deadline, arrival index): lower first; no deadline sorts after every deadline."""
    deadline = request.deadline if request.deadline is not None else float("inf")
    return (request.priority, deadline, request.arrival_index)


class RequestQueue:
    """Waiting requests, popped in admission order. Reads like the list it replaces: `len`, `bool`,
    `in`, iteration (in line order, O(n)), `append`, `remove`; plus `appendleft`, `first`, `expire`."""

    def __init__(self, key: Callable[[Request], tuple] = admission_key):
        self._key = key  # admission order, lower first; a key need not have a fixed length (its own tuple)
        self._seq_of: dict[Request, int] = {}  # queued request -> its live sequence number
        self._order: list[tuple] = []  # heap of (key, seq, request)
        self._deadlines: list[tuple] = []  # heap of (deadline, seq, request), requests with a deadline
        self._num_front = 0  # pushes to the front so far
        self._num_back = 0  # pushes to the back so far
        self.num_with_deadline = 0  # queued requests that have a deadline

    def __len__(self) -> int:
        return len(self._seq_of)

    def __bool__(self) -> bool:
        return bool(self._seq_of)

    def __contains__(self, request: Request) -> bool:
        return request in self._seq_of

    def __iter__(self) -> Iterator[Request]:
        """Line order: the front (latest re-queued first), then the back (in the order added)."""
        front = [r for r, seq in self._seq_of.items() if seq < 0]  # dict order = push order: -1, -2, ...
        return itertools.chain(reversed(front), (r for r, seq in self._seq_of.items() if seq >= 0))

    # ------------------------------------------------------------ push and remove

    def append(self, request: Request) -> None:
        """Queue at the back of the line (a new request). O(log n)."""
        self._push(request, self._num_back)
        self._num_back += 1

    def appendleft(self, request: Request) -> None:
        """Queue at the front of the line (a preempted request): it wins every tie of admission_key. O(log n)."""
        self._num_front += 1
        self._push(request, -self._num_front)

    def _push(self, request: Request, seq: int) -> None:
        if request in self._seq_of:
            raise ValueError(f"request {request.request_id!r} is already queued")
        self._seq_of[request] = seq
        heapq.heappush(self._order, (self._key(request), seq, request))
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, seq, request))
            self.num_with_deadline += 1

    def remove(self, request: Request) -> None:
        """Take a queued request out (ValueError if it is not queued). O(1) amortized: its heap entries go stale."""
        if self._seq_of.pop(request, None) is None:
            raise ValueError(f"request {request.request_id!r} is not queued")
        self.num_with_deadline -= request.deadline is not None
        self._order = self._compacted(self._order)
        self._deadlines = self._compacted(self._deadlines)

    def _live(self, entry: tuple) -> bool:
        return self._seq_of.get(entry[-1]) == entry[-2]

    def _compacted(self, heap: list[tuple]) -> list[tuple]:
        """`heap`, or a new heap of its live entries once stale ones are over half of it. A new list, so
        an iterator from `first` that holds the old one is not disturbed."""
        if len(heap) <= 2 * len(self._seq_of) + _REBUILD_SLACK:
            return heap
        live = [entry for entry in heap if self._live(entry)]
        heapq.heapify(live)
        return live

    def _drop_stale_tops(self, heap: list[tuple]) -> None:
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)

    # ------------------------------------------------------------ admission order

    def peek(self) -> Request | None:
        """The first request in admission order, or None. O(1) amortized."""
        self._drop_stale_tops(self._order)
        return self._order[0][-1] if self._order else None

    def first(self, k: int) -> Iterator[Request]:
        """Lazily, the first `k` queued requests in admission order, without taking them out: O(log n)
        amortized to start, then O(log j) for the j-th. Requests removed while iterating (admitted ones)
        are fine; pushing while iterating is not."""
        if k <= 0:
            return iter(())
        self._drop_stale_tops(self._order)
        if k == 1:  # the top itself (a step that admits into one free slot: most of a full batch's steps)
            return iter((self._order[0][-1],) if self._order else ())
        return self._walk(self._order, k)

    def _walk(self, heap: list[tuple], k: int) -> Iterator[Request]:
        """Best-first walk of the heap's tree: the frontier holds (entry, index) of unvisited nodes whose
        parent was visited; a node is never smaller than its parent, so the frontier's least is next."""
        frontier = [(heap[0], 0)] if heap else []
        while frontier and k > 0:
            entry, index = heapq.heappop(frontier)
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if self._live(entry):
                k -= 1
                yield entry[-1]

    # ------------------------------------------------------------ deadlines

    def expire(self, now: float) -> list[Request]:
        """Take out and return, in line order, the requests whose deadline is before `now` and that have not
        started (Request.has_started). O(log n) per entry past its deadline; O(1) when none is."""
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] < now:
            _, seq, request = heapq.heappop(heap)
            if self._seq_of.get(request) == seq and not request.has_started:
                expired.append((seq, request))
            # a live request that started never expires while it waits: its entry is just dropped
        for _, request in expired:
            self.remove(request)
        return [request for _, request in sorted(expired, key=lambda pair: pair[0])]
