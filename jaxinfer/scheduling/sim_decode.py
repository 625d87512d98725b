"""The simulator's decode rows, counted by one clock instead of one by one. Host only, no jax.

Every simulated request generates token 0 until its length stops it, and every decoding request takes
exactly one token per iteration (all of them are planned, none is skipped outside deterministic mode). So
while a request decodes, its tokens are `base + ticks` (ticks: the decode iterations run so far, one
`DecodeClock` per simulation) and an iteration's decode bookkeeping is `ticks += 1`, whatever the rows.

`LazyRequest` is a `Request` whose `num_computed_tokens`, `output_ids` and `num_steps` read that clock while
it is registered (`DecodeRows.register`): any reader (the scheduler, a policy, the KV manager, the output
processor) sees the exact values, the list of output tokens grown to its length on demand; a write, or
leaving the decode rows (finish, preemption), settles them back into plain fields. The events that need
a row one at a time are kept by tick: its last token in a heap; the first tick whose token needs a page past
its table, and its page bucket's end, in lists kept beside the rows sorted by length (32 rows: one `min` over a
list costs less than a heap's stale entries); a full page to name is found by the residue of `base` modulo
the page size.
"""

import bisect
import heapq
import math
from operator import attrgetter

from jaxinfer.scheduling.bucket_tables import pad_to_bucket
from jaxinfer.scheduling.request import Request

total_base = attrgetter("_total_base")
_admit_index = attrgetter("admit_index")


class DecodeClock:
    """Decode iterations run so far in one simulation."""

    def __init__(self):
        self.ticks = 0


class LazyRequest(Request):
    """A Request whose decode tokens (token 0 each) are counted by a DecodeClock while it is registered."""

    _clock: DecodeClock | None = None  # set while registered
    _computed = 0
    _steps = 0
    # Pages whose names another request may look up (its shared prefix's); the rest, its own, are named only
    # if it is preempted (sim_pages.SimKV). None: every full page is named as it fills (the KV manager's rule).
    public_pages: int | None = None

    @property
    def num_computed_tokens(self) -> int:
        clock = self._clock
        return self._computed if clock is None else self._total_base + clock.ticks - 1

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._clock is not None:
            self.settle()
        self._computed = value

    @property
    def output_ids(self) -> list[int]:
        output, clock = self._output, self._clock
        if clock is not None:
            missing = self._total_base + clock.ticks - self._prompt_len - len(output)
            if missing > 0:
                output.extend([0] * missing)
        return output

    @output_ids.setter
    def output_ids(self, value: list[int]) -> None:
        if self._clock is not None:
            self.settle()
        self._output = value

    @property
    def num_steps(self) -> int:
        clock = self._clock
        return self._steps if clock is None else self._steps_base + clock.ticks

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        if self._clock is not None:
            self.settle()
        self._steps = value

    @classmethod
    def make(cls, request_id: str, prompt_ids: list[int], params, **fields) -> "LazyRequest":
        """`cls(request_id, prompt_ids, params, seed=0, **fields)` without the dataclass's __init__: a copy of a
        prototype's fields, each list, dict or set field a new empty one (the default factories')."""
        prototype = cls.__dict__.get("_prototype")
        if prototype is None:
            made = cls("", [], params, seed=0)
            prototype = cls._prototype = (made.__dict__, tuple((k, type(v)) for k, v in made.__dict__.items() if isinstance(v, (list, dict, set))))
        values, fresh = prototype
        state = values.copy()
        for name, kind in fresh:
            state[name] = kind()
        state.update(fields)
        state["request_id"], state["prompt_ids"], state["params"] = request_id, prompt_ids, params
        request = object.__new__(cls)
        request.__dict__ = state
        return request

    def settle(self) -> None:
        """Stop counting on the clock: the fields take their values now."""
        clock = self._clock
        output = self.output_ids  # grown to its length
        computed, steps = self._total_base + clock.ticks - 1, self._steps_base + clock.ticks
        self._clock = None
        self._computed, self._steps, self._output = computed, steps, output


class DecodeRows:
    """The registered (decoding) rows of one scheduler: their count, the sum of their bases, and their next
    events: the last tokens in a heap, whose entries of a row that left are stale and skipped (each carries the
    row's admit_index, new at every admission); the page needs and bucket ends in lists beside the rows sorted
    by length, which `push_need` sets at every growth of a row's table."""

    def __init__(self, clock: DecodeClock, page_size: int, max_context: int, tables: dict[str, list[int]], name_pages: bool):
        self.clock, self.page_size, self.max_context, self.tables = clock, page_size, max_context, tables
        self.name_pages = name_pages  # whether full pages are named (prefix caching): the residues are kept only then
        self.rows: dict[int, LazyRequest] = {}  # admit_index -> row
        self.base_sum = 0
        self.version = 0  # changes with the rows
        self._finishes: list[tuple[int, int, LazyRequest]] = []  # (tick of its last token, admit_index, row)
        self.page_buckets: tuple[int, ...] = ()  # the decode page buckets (the scheduler's tables.pages)
        self._residues: dict[int, dict[int, LazyRequest]] = {}  # base % page_size -> rows (they fill a page when (base + tick - 1) % page_size == 0)
        self._num_naming = 0  # rows in _residues
        self._buckets: dict[int, int] = {}  # pages -> their page bucket (page_bucket)
        self._max_index = -1  # the largest admit_index registered while rows were registered in admission order
        self._in_admission_order = True  # whether `rows` (a dict: registration order) holds them in admit_index order
        self._ordered: list[LazyRequest] | None = None
        self._by_length: list[LazyRequest] = []  # the rows sorted by (base, admit_index): by length, ties in running order
        self._length_keys: list[tuple[int, int]] = []  # their (base, admit_index), for bisect
        self._length_pages: list[int] = []  # their pages held (kept by push_need, which every growth of a row's table calls)
        self._length_buckets: list[int] = []  # the page buckets of those
        self._length_tops: list[int] = []  # tokens each one's page bucket holds - its base (min_top)
        self._length_needs: list[int] = []  # the first tick whose token needs a page past each one's table (due_pages)
        self._first_need = 0  # at most min(_length_needs): needing_pages reads the list only from that tick on

    def register(self, request: LazyRequest) -> None:
        """Count a request that now decodes (its newest token is its only uncomputed one) on the clock."""
        ticks = self.clock.ticks
        prompt = len(request.prompt_ids)
        total = prompt + len(request.output_ids)
        base = total - ticks
        request._total_base, request._steps_base, request._prompt_len = base, request.num_steps - ticks, prompt
        request._clock = self.clock
        index = request.admit_index
        if not self.rows:
            self._in_admission_order, self._max_index = True, -1
        if index < self._max_index:
            self._in_admission_order = False
        self._max_index = max(self._max_index, index)
        self.rows[index] = request
        at = bisect.bisect(self._length_keys, (base, index))
        self._length_keys.insert(at, (base, index))
        self._by_length.insert(at, request)
        self._length_pages.insert(at, 0)
        self._length_buckets.insert(at, 0)
        self._length_tops.insert(at, 0)
        self._length_needs.insert(at, 0)
        self.base_sum += base
        self.version += 1
        self._ordered = None
        heapq.heappush(self._finishes, (min(prompt + request.params.max_tokens, self.max_context) - base, index, request))
        self.push_need(request)
        if self.name_pages and request.public_pages is None:  # a row with a public_pages count names no decode page (its own)
            self._residues.setdefault(base % self.page_size, {})[index] = request
            self._num_naming += 1

    def unregister(self, request: LazyRequest) -> None:
        request.settle()
        index = request.admit_index
        del self.rows[index]
        at = bisect.bisect_left(self._length_keys, (request._total_base, index))
        del self._length_keys[at], self._by_length[at], self._length_pages[at], self._length_buckets[at], self._length_tops[at], self._length_needs[at]
        self.base_sum -= request._total_base
        self.version += 1
        self._ordered = None
        if self.name_pages and request.public_pages is None:
            del self._residues[request._total_base % self.page_size][index]
            self._num_naming -= 1

    def push_need(self, request: LazyRequest) -> bool:
        """Its next need of a page: the first tick whose token (at position base + tick - 1) is past its table;
        whether its page bucket changed since the last call (True at its registration)."""
        held = len(self.tables.get(request.request_id, ()))
        base, index = request._total_base, request.admit_index
        at, bucket = bisect.bisect_left(self._length_keys, (base, index)), self.page_bucket(held)
        self._length_pages[at] = held
        need = self._length_needs[at] = held * self.page_size - base + 1
        if need < self._first_need:
            self._first_need = need
        if self._length_buckets[at] != bucket:  # registered (its bucket was 0), or its table grew past its bucket: a new top
            self._length_buckets[at] = bucket
            self._length_tops[at] = bucket * self.page_size - base
            return True
        return False

    def use_page_buckets(self, buckets: tuple[int, ...]) -> None:
        """New decode page buckets (a table swap): every row's bucket and its end again, the memo forgotten."""
        self.page_buckets, self._buckets = buckets, {}
        for at, ((base, _), pages) in enumerate(zip(self._length_keys, self._length_pages)):
            bucket = self._length_buckets[at] = self.page_bucket(pages)
            self._length_tops[at] = bucket * self.page_size - base
        self.version += 1

    def page_bucket(self, pages: int) -> int:
        """pad_to_bucket(pages, page_buckets), memoised (forgotten by use_page_buckets)."""
        bucket = self._buckets.get(pages)
        if bucket is None:
            bucket = self._buckets[pages] = pad_to_bucket(pages, self.page_buckets)
        return bucket

    def min_finish(self) -> int | None:
        """The tick of the first row's last token (None: no row)."""
        finishes = self._finishes
        while finishes and not (finishes[0][2]._clock is not None and finishes[0][2].admit_index == finishes[0][1]):
            heapq.heappop(finishes)
        return finishes[0][0] if finishes else None

    def min_top(self) -> int | None:
        """min over rows of (tokens its page bucket holds - base): its computed tokens reach its bucket's end at
        that tick + 1 (None: no row). Kept per row beside its length (push_need sets it at each bucket change)."""
        tops = self._length_tops
        return min(tops) if tops else None

    def needing_pages(self, ticks: int) -> list[LazyRequest]:
        """Rows whose token at some tick up to `ticks` needs a page past their table, in running order."""
        if ticks < self._first_need:
            return []
        needs = self._length_needs
        if not needs:
            return []
        self._first_need = min(needs)
        if ticks < self._first_need:
            return []
        rows = [row for row, need in zip(self._by_length, needs) if need <= ticks]
        if len(rows) > 1:
            rows.sort(key=_admit_index)
        return rows

    def ordered(self) -> list[LazyRequest]:
        """The rows in running (admission) order."""
        if self._ordered is None:
            rows = self.rows
            self._ordered = list(rows.values()) if self._in_admission_order else [rows[i] for i in sorted(rows)]
        return self._ordered

    def by_length(self) -> tuple[list[LazyRequest], list[int], tuple[int, ...]]:
        """The rows sorted by length (tokens: base + ticks), ties in running order (`sorted(self.ordered(),
        key=total_base)`), the pages each holds and their page buckets; kept as rows register, grow and leave (new
        lists)."""
        return self._by_length[:], self._length_pages[:], tuple(self._length_buckets)

    def due_pages(self) -> list[LazyRequest]:
        """Rows whose next token (this tick's + 1) needs a page past their table, in running order."""
        return self.needing_pages(self.clock.ticks)

    def finishing(self) -> list[LazyRequest]:
        """Rows whose token of this tick is their last (taken from the heap)."""
        finishes, ticks, done = self._finishes, self.clock.ticks, []
        while finishes and finishes[0][0] <= ticks:
            _, index, request = heapq.heappop(finishes)
            if request._clock is not None and request.admit_index == index:
                done.append(request)
        return done

    def filled_within(self, ticks: int) -> list[LazyRequest]:
        """Rows whose tokens fill a page at one of the `ticks` ticks up to now, in running order (only rows that
        name their pages as they fill: with prefix caching, and no public_pages count)."""
        if not self._num_naming:
            return []
        if ticks >= self.page_size:
            return [r for r in self.ordered() if r.public_pages is None]
        now, residues, rows = self.clock.ticks, self._residues, []
        for tick in range(now - ticks + 1, now + 1):
            found = residues.get((1 - tick) % self.page_size)
            if found:
                rows += found.values()
        rows.sort(key=_admit_index)
        return rows

    def ticks_before_naming(self) -> int | float:
        """Ticks from now before the first at which a row that names its pages as they fill (filled_within) fills
        one, when two or more such rows run (equal whole prompts name their pages alike, and the first to fill a
        page keeps its name: they must name in the order they fill); math.inf with fewer."""
        if self._num_naming < 2:
            return math.inf
        ticks, size = self.clock.ticks, self.page_size
        return min((-residue - ticks) % size for residue, rows in self._residues.items() if rows)

    def filling(self) -> list[LazyRequest]:
        """Rows whose token of this tick fills a page (only rows that name their pages as they fill)."""
        if not self._num_naming:
            return []
        rows = self._residues.get((1 - self.clock.ticks) % self.page_size)
        return list(rows.values()) if rows else []


def in_order(rows: list[LazyRequest], order: list[LazyRequest]) -> list[tuple[int, LazyRequest]]:
    """(place in `order`, row) of each of these rows, by place."""
    return sorted([(order.index(r), r) for r in rows], key=_first) if rows else []


def _first(pair: tuple[int, LazyRequest]) -> int:
    return pair[0]


def end_plan(scheduler, filling: list[tuple[int, LazyRequest]], finishing: list[tuple[int, LazyRequest]], first: int, last: int) -> list[LazyRequest]:
    """After the step of a decode plan holding the rows at places [first, last) of the iteration's decode
    order: as the run loop's update and output processor would, name the pages its rows' tokens filled
    (`filling`'s rows of the plan) and then finish its rows whose token was their last (`finishing`'s), each
    in the plan's row order (both lists: (place, row) by place, in_order). Returns the finished rows."""
    if filling:
        rows = [r for place, r in filling if first <= place < last]
        if rows:
            scheduler.kv.cache_computed_pages_of(rows)
    done = []
    if finishing:
        done = [r for place, r in finishing if first <= place < last]
        for r in done:
            scheduler.finish(r, "length", r.error)
    return done
