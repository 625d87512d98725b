"""Bucket strategies: which padded lengths get a compiled program, and what that choice costs.

jaxinfer compiles one XLA program per bucket. A strategy is a small frozen dataclass whose `buckets`
property is a fixed, finite, sorted tuple of positive ints; `bucket_for(n)` returns the smallest bucket
>= n and `pad(lengths)` does the same for an array. "Length" means any positive size, so the same
strategies serve the token axis (prompt tokens in a prefill) and the batch axis (sequences in a step).

Owns: the strategies, the exact fitted strategy (`fit_buckets`, a dynamic programme over the distinct
lengths), cost models, and padding metrics per request, per batch and per packed step.
Must not import: jax, or anything that does. This module is host-only and imports numpy and the
runtime's table helpers (`pad_to_bucket`, `cut_table`, `sorted_table` of scheduling/bucket_tables.py; a
test enforces it), so offline tools can use it without a device. The runtime never imports this module:
`EngineConfig.buckets` is read by duck type.
Invariants: every bucket tuple is sorted, unique and positive; `bucket_for(n) >= n` for every n the
strategy accepts; a length above the largest bucket is either an error naming it or, where a policy
says so, chunked, and metrics always count such requests (`num_over_top`), never drop them silently.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import ClassVar, Literal, Protocol

import numpy as np

from jaxinfer.scheduling.bucket_tables import pad_to_bucket, sorted_table

CostFunction = Callable[[np.ndarray], np.ndarray]  # float64[N] cost of running N lengths, nondecreasing
Overflow = Literal["error", "chunk"]


class BucketStrategy(Protocol):
    """What the engine needs from a strategy: the table, and the mapping onto it."""

    @property
    def buckets(self) -> tuple[int, ...]: ...

    def bucket_for(self, n: int) -> int: ...

    def pad(self, lengths: np.ndarray) -> np.ndarray: ...


# ---------------------------------------------------------------------------------------------------------
# Cost models


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Cost of running one sequence of n tokens: linear·n + quadratic·n².

    The default counts tokens. Prefill also pays attention over the prompt, which grows like n²; see
    `prefill`.
    """

    linear: float = 1.0  # cost per token (matmuls)
    quadratic: float = 0.0  # cost per token pair (attention)
    name: str = "tokens"

    def __post_init__(self):
        if self.linear < 0 or self.quadratic < 0 or self.linear + self.quadratic == 0:
            raise ValueError(f"cost coefficients must be >= 0 and not both 0: {self.linear=} {self.quadratic=}")

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        sizes = np.asarray(lengths, dtype=np.float64)
        return self.linear * sizes + self.quadratic * sizes * sizes

    @classmethod
    def prefill(cls, crossover_length: int = 8192) -> "CostModel":
        """Prefill cost, in units of one token's matmul work.

        Args:
            crossover_length: the prompt length at which attention costs as much as the matmuls. For a
                decoder with P non-embedding parameters, L layers and width D it is about P / (L·D):
                about 6k for SmolLM2-135M, about 60k for an 8B Llama.
        """
        return cls(linear=1.0, quadratic=1.0 / crossover_length, name="prefill")


TOKENS = CostModel()
PREFILL = CostModel.prefill()


# ---------------------------------------------------------------------------------------------------------
# Lookup: length -> bucket


def _as_lengths(lengths, what: str = "lengths") -> np.ndarray:
    """Validates a sample: a non-empty 1-D array of positive integers, returned as int64."""
    values = np.asarray(lengths)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array, got shape {values.shape}")
    if not np.issubdtype(values.dtype, np.integer):
        if not np.issubdtype(values.dtype, np.floating) or not np.all(values == np.round(values)):
            raise ValueError(f"{what} must be integers, got dtype {values.dtype}")
    values = values.astype(np.int64)
    if values.min() < 1:
        raise ValueError(f"{what} must be positive, found {values.min()}")
    return values


def chunk_buckets(n: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Splits a length into chunks of the largest bucket plus a bucketed remainder (chunked prefill)."""
    if n < 1:
        raise ValueError(f"length must be positive, got {n=}")
    num_full, remainder = divmod(n, buckets[-1])
    tail = (pad_to_bucket(remainder, buckets),) if remainder else ()
    return (buckets[-1],) * num_full + tail


def padded_lengths(lengths, buckets: tuple[int, ...], overflow: Overflow = "error") -> np.ndarray:
    """Vectorised lookup: the padded length of every request.

    Args:
        lengths: int[N] positive lengths.
        buckets: sorted bucket table.
        overflow: "error" raises on the first length above the largest bucket; "chunk" pads it as
            `sum(chunk_buckets(n))`, i.e. full chunks of the largest bucket plus a bucketed remainder.

    Returns:
        int64[N] padded lengths, each >= the input length.
    """
    sizes = _as_lengths(lengths)
    table = np.asarray(buckets, dtype=np.int64)
    top = int(table[-1])
    over = sizes > top
    if over.any() and overflow == "error":
        first = int(sizes[over][0])
        raise ValueError(f"n={first} exceeds the largest bucket {top} ({int(over.sum())} lengths do)")
    num_full, remainder = np.divmod(sizes, top)
    within = np.where(over, remainder, sizes)
    index = np.searchsorted(table, within, side="left")  # within <= top, so index < table.size
    tail = np.where(within > 0, table[index], 0)
    return np.where(over, num_full * top, 0) + tail


class _TableLookup:
    """Shared `bucket_for` and `pad` for strategies that expose `buckets`."""

    name: ClassVar[str] = "strategy"
    overflow: ClassVar[Overflow] = "error"

    @property
    def num_programs(self) -> int:
        return len(self.buckets)

    def bucket_for(self, n: int) -> int:
        """Smallest bucket >= n. Under a "chunk" overflow policy, a longer n returns its padded total."""
        if self.overflow == "chunk" and n > self.buckets[-1]:
            return sum(chunk_buckets(n, self.buckets))
        return pad_to_bucket(n, self.buckets)

    def pad(self, lengths: np.ndarray) -> np.ndarray:
        """int64[N] padded length of each request, under this strategy's overflow policy."""
        return padded_lengths(lengths, self.buckets, self.overflow)


# ---------------------------------------------------------------------------------------------------------
# Strategies


def _evenly_spaced(top: int, count: int) -> tuple[int, ...]:
    """`count` boundaries spaced evenly up to `top` (fewer if they collide), ending at `top`."""
    return tuple(sorted({math.ceil(top * i / count) for i in range(1, count + 1)}))


@dataclasses.dataclass(frozen=True)
class PadToMax(_TableLookup):
    """One program at the maximum length: the fewest programs and the most padding."""

    name: ClassVar[str] = "pad-to-max"
    max_length: int

    def __post_init__(self):
        sorted_table((self.max_length,))

    @property
    def buckets(self) -> tuple[int, ...]:
        return (self.max_length,)

    @classmethod
    def from_sample(cls, lengths, budget: int = 1) -> "PadToMax":
        return cls(int(_as_lengths(lengths).max()))


@dataclasses.dataclass(frozen=True)
class PowersOfTwo(_TableLookup):
    """Powers of two from `min_bucket` to the first power >= `max_length`, as JAX engines do today."""

    name: ClassVar[str] = "powers-of-two"
    max_length: int
    min_bucket: int = 16  # rounded up to a power of two

    def __post_init__(self):
        if self.max_length < 1 or self.min_bucket < 1:
            raise ValueError(f"{self.max_length=} and {self.min_bucket=} must be >= 1")

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        smallest = 1 << (self.min_bucket - 1).bit_length()
        top = max(1 << (self.max_length - 1).bit_length(), smallest)
        return tuple(1 << e for e in range(smallest.bit_length() - 1, top.bit_length()))

    @classmethod
    def from_sample(cls, lengths, budget: int, min_bucket: int = 16) -> "PowersOfTwo":
        """Covers the sample's maximum; raises the minimum bucket until at most `budget` programs remain."""
        max_length = int(_as_lengths(lengths).max())
        top = 1 << (max_length - 1).bit_length()
        return cls(max_length, max(min_bucket, top >> (budget - 1), 1))


@dataclasses.dataclass(frozen=True)
class FixedList(_TableLookup):
    """A table given by the user, e.g. (64, 128, 256, 512, 1024, 2048). Quantile and Fitted are FixedLists
    too, differing only in how `from_sample` picks the table (and in their names, for reports)."""

    name: ClassVar[str] = "fixed"
    buckets: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "buckets", sorted_table(self.buckets))


@dataclasses.dataclass(frozen=True)
class Linear(_TableLookup):
    """Multiples of a fixed step, up to the first multiple >= `max_length`."""

    name: ClassVar[str] = "linear"
    step: int
    max_length: int

    def __post_init__(self):
        if self.step < 1 or self.max_length < 1:
            raise ValueError(f"{self.step=} and {self.max_length=} must be >= 1")

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.step * i for i in range(1, -(-self.max_length // self.step) + 1))

    @classmethod
    def from_sample(cls, lengths, budget: int) -> "Linear":
        max_length = int(_as_lengths(lengths).max())
        return cls(-(-max_length // budget), max_length)


class Quantile(FixedList):
    """A FixedList whose boundaries are the 1/K, 2/K, ..., 1 quantiles of a sample (duplicates merged)."""

    name: ClassVar[str] = "quantile"

    @classmethod
    def from_sample(cls, lengths, budget: int) -> "Quantile":
        sizes = _as_lengths(lengths)
        levels = np.arange(1, budget + 1) / budget
        # "inverted_cdf" returns sample values, so the 1.0 quantile is the maximum exactly.
        values = np.quantile(sizes, levels, method="inverted_cdf")
        return cls(tuple(sorted({int(v) for v in values})))


@dataclasses.dataclass(frozen=True)
class MeanKSigma(_TableLookup):
    """Evenly spaced buckets up to a cap at mean + k·σ of a sample, plus a policy for longer inputs.

    `policy="next_bucket"`: inputs above the cap overflow to the next bucket up, one overflow bucket at
    the sample maximum (it is one of the `num_buckets` programs). `policy="chunk"`: all programs sit at
    or below the cap, and longer inputs are chunked into cap-sized pieces. `describe_policy` reports how
    many inputs the policy touches; the policy is never applied silently.
    """

    name: ClassVar[str] = "mean+k-sigma"
    cap: int
    num_buckets: int
    policy: Literal["next_bucket", "chunk"] = "next_bucket"
    overflow_bucket: int | None = None  # only with policy="next_bucket"; above the cap

    def __post_init__(self):
        if self.policy not in ("next_bucket", "chunk"):
            raise ValueError(f"policy must be 'next_bucket' or 'chunk', got {self.policy!r}")
        if self.overflow_bucket is not None and (self.policy != "next_bucket" or self.overflow_bucket <= self.cap):
            raise ValueError(f"{self.overflow_bucket=} needs policy='next_bucket' and must exceed {self.cap=}")
        if self.cap < 1 or self.num_buckets < 1 + (self.overflow_bucket is not None):
            raise ValueError(f"{self.cap=} must be >= 1 and {self.num_buckets=} must leave a bucket at the cap")

    @property
    def overflow(self) -> Overflow:
        return "chunk" if self.policy == "chunk" else "error"

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        has_overflow = self.overflow_bucket is not None
        below_cap = _evenly_spaced(self.cap, self.num_buckets - has_overflow)
        return below_cap + ((self.overflow_bucket,) if has_overflow else ())

    @classmethod
    def from_sample(cls, lengths, budget: int, k: float = 2.0, policy="next_bucket") -> "MeanKSigma":
        sizes = _as_lengths(lengths)
        cap = math.ceil(sizes.mean() + k * sizes.std())
        max_length = int(sizes.max())
        if max_length <= cap:  # nothing overflows: spend every program below the maximum
            return cls(max_length, budget, policy)
        if policy == "chunk":
            return cls(cap, budget, policy)
        if budget == 1:  # the only program must hold the longest input
            return cls(max_length, budget, policy)
        return cls(cap, budget, policy, overflow_bucket=max_length)

    def describe_policy(self, lengths) -> str:
        """One line: the cap, and how many of `lengths` exceed it and what happens to them."""
        sizes = _as_lengths(lengths)
        num_above = int((sizes > self.cap).sum())
        if self.policy == "chunk":
            action = f"are chunked into pieces of {self.cap}"
        elif self.overflow_bucket is not None:
            action = f"overflow to the next bucket up, {self.overflow_bucket}"
        else:
            action = "have no bucket (error)"
        return f"cap {self.cap}: {num_above} of {sizes.size} lengths ({num_above / sizes.size:.1%}) {action}"


class Fitted(FixedList):
    """A FixedList of the K buckets that minimise the expected padded cost on a sample (see `fit_buckets`)."""

    name: ClassVar[str] = "fitted"

    @classmethod
    def from_sample(cls, lengths, budget: int, cost: CostFunction = TOKENS, multiple_of: int = 1) -> "Fitted":
        return cls(fit_buckets(lengths, budget, cost, multiple_of=multiple_of))


def strategies_at_budget(
    lengths, budget: int, cost: CostFunction = TOKENS, *, multiple_of: int = 1
) -> tuple[BucketStrategy, ...]:
    """Every sample-derived strategy with at most `budget` programs, built from `lengths`.

    `cost` and `multiple_of` apply to the fitted strategy; the others do not optimise anything.
    """
    return (
        PadToMax.from_sample(lengths),
        PowersOfTwo.from_sample(lengths, budget),
        Linear.from_sample(lengths, budget),
        Quantile.from_sample(lengths, budget),
        MeanKSigma.from_sample(lengths, budget),
        Fitted.from_sample(lengths, budget, cost, multiple_of),
    )


# ---------------------------------------------------------------------------------------------------------
# The exact fit
#
# Let v_1 < ... < v_M be the distinct lengths, W_j the number of requests with length <= v_j and c the
# cost. A table whose buckets are v_{j_1} < ... < v_{j_K} = v_M costs sum over groups of
# (W_j - W_i)·c(v_j), where the group (i, j] is padded to v_j. Optimal boundaries lie on sample values
# (lowering a boundary to the largest length it serves never costs more, c being nondecreasing), so
#     best_k(j) = min_{k-1 <= i < j} best_{k-1}(i) + (W_j - W_i)·c(v_j).
# The group cost C(i, j) = (W_j - W_i)·c(v_j) is Monge: for i < i', j < j',
#     C(i, j) + C(i', j') - C(i, j') - C(i', j) = (W_i' - W_i)·(c(v_j) - c(v_j')) <= 0,
# so the leftmost minimising i is nondecreasing in j, and each layer can be solved by divide and conquer:
# solve the middle j over its whole allowed i range, then recurse left and right with the i range split
# at that optimum. Every recursion depth touches O(M) candidates, so a layer is O(M log M) and the fit is
# O(K·M·log M) time, O(K·M) memory. All segments of one depth are solved in one numpy pass.


def _segment_argmins(previous, cumulative, costs, columns, starts, stops):
    """For each column j, min and leftmost argmin over i in [start, stop] of the layer recurrence."""
    widths = stops - starts + 1
    offsets = np.cumsum(widths) - widths
    segment = np.repeat(np.arange(columns.size), widths)
    rows = np.arange(int(widths.sum())) - offsets[segment] + starts[segment]
    targets = columns[segment]
    values = previous[rows] + (cumulative[targets] - cumulative[rows]) * costs[targets - 1]
    minima = np.minimum.reduceat(values, offsets)
    positions = np.where(values == minima[segment], np.arange(values.size), values.size)
    return minima, rows[np.minimum.reduceat(positions, offsets)]


def _solve_layer(previous, cumulative, costs, layer):
    """One DP layer by divide and conquer over the monotone optimum; returns (best, argmin) per j."""
    num_candidates = costs.size
    best = np.full(num_candidates + 1, np.inf)
    choice = np.zeros(num_candidates + 1, dtype=np.int64)
    lows, highs = np.array([layer]), np.array([num_candidates])  # j ranges still to solve
    starts, stops = np.array([layer - 1]), np.array([num_candidates - 1])  # their allowed i ranges
    while lows.size:
        middles = (lows + highs) // 2
        minima, argmins = _segment_argmins(previous, cumulative, costs, middles, starts, np.minimum(stops, middles - 1))
        best[middles], choice[middles] = minima, argmins
        left, right = lows < middles, middles < highs
        lows = np.concatenate([lows[left], middles[right] + 1])
        highs = np.concatenate([middles[left] - 1, highs[right]])
        starts, stops = np.concatenate([starts[left], argmins[right]]), np.concatenate([argmins[left], stops[right]])
    return best, choice


def _candidate_costs(cost: CostFunction, candidates: np.ndarray) -> np.ndarray:
    costs = np.asarray(cost(candidates), dtype=np.float64)
    if costs.shape != candidates.shape or not np.all(np.isfinite(costs)):
        raise ValueError("cost must map an int[N] array to N finite values")
    if np.any(np.diff(costs) < 0):
        raise ValueError("cost must be nondecreasing in length (the fit relies on it)")
    return costs


def fit_buckets(lengths, budget: int, cost: CostFunction = TOKENS, *, multiple_of: int = 1) -> tuple[int, ...]:
    """Exact minimum-cost bucket table with at most `budget` programs for a sample of lengths.

    Minimises sum_i cost(bucket(n_i)), equivalently the padded cost minus the fixed real cost, by the
    divide-and-conquer DP described above: O(K·M·log M) time and O(K·M) memory for M distinct lengths.

    Args:
        lengths: int[N] positive sample lengths (token counts, or batch sizes).
        budget: K, the maximum number of buckets (compiled programs).
        cost: nondecreasing vectorised cost of one sequence of each length; tokens by default.
        multiple_of: every bucket is a multiple of this (e.g. a page size or 8 for tensor cores).

    Returns:
        The sorted bucket table. Its top is the sample maximum (rounded up to `multiple_of`), so no
        sample length exceeds it; it has min(K, M) buckets.
    """
    if budget < 1 or multiple_of < 1:
        raise ValueError(f"budget and multiple_of must be >= 1: {budget=} {multiple_of=}")
    sizes = _as_lengths(lengths)
    candidates, counts = np.unique(-(-sizes // multiple_of) * multiple_of, return_counts=True)
    if candidates.size <= budget:
        return tuple(int(v) for v in candidates)
    costs = _candidate_costs(cost, candidates)
    cumulative = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])  # W_0 .. W_M
    best = np.concatenate([[np.inf], cumulative[1:] * costs])  # one bucket covering the first j lengths
    choices = [np.zeros(candidates.size + 1, dtype=np.int64)]  # layer 1 always starts at i = 0
    for layer in range(2, budget + 1):
        best, choice = _solve_layer(best, cumulative, costs, layer)
        choices.append(choice)
    boundary_ends, end = [], candidates.size
    for choice in reversed(choices):
        boundary_ends.append(end)
        end = int(choice[end])
    return tuple(int(candidates[j - 1]) for j in reversed(boundary_ends))


# ---------------------------------------------------------------------------------------------------------
# Metrics


@dataclasses.dataclass(frozen=True)
class PaddingMetrics:
    """What a strategy costs on a sample of requests, each padded on its own.

    Requests above the largest bucket are counted in `num_over_top` and padded as the scheduler would
    run them: in chunks of the largest bucket plus a bucketed remainder.
    """

    strategy: str
    num_programs: int
    num_requests: int
    real_tokens: int
    padded_tokens: int
    token_waste: float  # (padded - real) / padded, in tokens
    cost_waste: float  # the same ratio in the cost model: (Σc(padded) - Σc(real)) / Σc(padded)
    mean_padding: float  # tokens of padding per request
    max_padding: int  # worst request, tokens
    num_over_top: int  # requests longer than the largest bucket


def padding_metrics(strategy: BucketStrategy, lengths, cost: CostFunction = TOKENS) -> PaddingMetrics:
    """Padding waste of `strategy` on a sample of request lengths.

    A chunked request's cost is taken as c(total padded length): its chunks still attend to the whole
    prefix, so chunking does not remove the quadratic term.
    """
    sizes = _as_lengths(lengths)
    padded = padded_lengths(sizes, strategy.buckets, overflow="chunk")
    padding = padded - sizes
    real_cost, padded_cost = float(np.sum(cost(sizes))), float(np.sum(cost(padded)))
    return PaddingMetrics(
        strategy=getattr(strategy, "name", type(strategy).__name__),
        num_programs=len(strategy.buckets),
        num_requests=int(sizes.size),
        real_tokens=int(sizes.sum()),
        padded_tokens=int(padded.sum()),
        token_waste=float(padding.sum() / padded.sum()),
        cost_waste=(padded_cost - real_cost) / padded_cost,
        mean_padding=float(padding.mean()),
        max_padding=int(padding.max()),
        num_over_top=int((sizes > strategy.buckets[-1]).sum()),
    )


@dataclasses.dataclass(frozen=True)
class BatchMetrics:
    """Padding when requests share a step: a padded batch, or a packed token buffer."""

    num_steps: int
    real_tokens: int
    padded_tokens: int

    @property
    def waste(self) -> float:
        return (self.padded_tokens - self.real_tokens) / self.padded_tokens


def batch_indices(lengths, batch_size: int, *, sort: bool = False) -> list[np.ndarray]:
    """Request indices per batch: in arrival order, or sorted by length (offline jobs; stable sort)."""
    if batch_size < 1:
        raise ValueError(f"{batch_size=} must be >= 1")
    sizes = _as_lengths(lengths)
    order = np.argsort(sizes, kind="stable") if sort else np.arange(sizes.size)
    return [order[i : i + batch_size] for i in range(0, sizes.size, batch_size)]


def batch_padding(lengths, batch_size: int, strategy: BucketStrategy | None = None, *, sort=False) -> BatchMetrics:
    """Every batch is padded to its longest member, or to that member's bucket if `strategy` is given.

    Args:
        lengths: int[N] request lengths.
        batch_size: sequences per batch; the last batch may be short and is not padded on the batch axis.
        strategy: optional bucket strategy for the token axis (chunking what exceeds its top).
        sort: sort by length first (sorted batching for offline jobs) instead of arrival order.
    """
    if batch_size < 1:
        raise ValueError(f"{batch_size=} must be >= 1")
    sizes = _as_lengths(lengths)
    arranged = np.sort(sizes) if sort else sizes
    starts = np.arange(0, sizes.size, batch_size)
    longest = np.maximum.reduceat(arranged, starts)
    if strategy is not None:
        longest = padded_lengths(longest, strategy.buckets, overflow="chunk")
    rows = np.diff(np.append(starts, sizes.size))
    return BatchMetrics(starts.size, int(sizes.sum()), int((rows * longest).sum()))


def packing(lengths, token_budget: int) -> BatchMetrics:
    """Ragged packing in arrival order into steps of `token_budget` tokens; padding only fills each step.

    A request that does not fit in the current step starts the next one. A request longer than the
    budget fills whole steps with its first chunks, and its remainder is packed like a request.
    """
    if token_budget < 1:
        raise ValueError(f"{token_budget=} must be >= 1")
    sizes = _as_lengths(lengths)
    num_full, remainders = np.divmod(sizes, token_budget)
    num_steps, used = int(num_full.sum()), 0
    for remainder in remainders[remainders > 0].tolist():
        if used + remainder > token_budget:
            num_steps, used = num_steps + 1, 0
        used += remainder
    num_steps += used > 0
    return BatchMetrics(num_steps, int(sizes.sum()), num_steps * token_budget)


# ---------------------------------------------------------------------------------------------------------
# Strategies on the engine

STRATEGY_KINDS: dict[str, type] = {
    cls.name: cls for cls in (PadToMax, PowersOfTwo, Linear, Quantile, MeanKSigma, Fitted)
}  # the sample-derived strategies, by name (FixedList is given its table directly)


def strategy_from_sample(kind: str, lengths, budget: int) -> BucketStrategy:
    """The strategy `kind` (a key of STRATEGY_KINDS) built from a sample under a program budget."""
    if kind not in STRATEGY_KINDS:
        raise ValueError(f"unknown bucket strategy {kind!r}; known: {', '.join(STRATEGY_KINDS)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"a program budget must be a positive int, got {budget!r}")
    return STRATEGY_KINDS[kind].from_sample(lengths, budget)


@dataclasses.dataclass(frozen=True)
class EngineBuckets:
    """A strategy per bucketed dimension of the engine, for `EngineConfig(buckets=...)`.

    chunk: prefill tokens per row; rows: sequences per decode step; pages: pages read per row. A
    dimension left None keeps EngineConfig's default table. Each strategy's table is cut to the engine's
    limits (`cut_table`): rows and pages always reach max_num_seqs and max_context / page_size; chunks
    stop at the strategy's largest bucket (longer prompts are chunked) or at the prefill budget.
    """

    chunk: BucketStrategy | None = None
    rows: BucketStrategy | None = None
    pages: BucketStrategy | None = None

    def __post_init__(self):
        for name in ("chunk", "rows", "pages"):
            strategy = getattr(self, name)
            if strategy is not None and not hasattr(strategy, "buckets"):
                raise ValueError(f"EngineBuckets.{name} must be a jaxinfer.bucketing.strategies strategy, got {strategy!r}")

    @classmethod
    def from_samples(cls, kind: str, budget: int, *, chunk=None, rows=None, pages=None) -> "EngineBuckets":
        """One strategy kind for every dimension that has a sample (chunk lengths, decode batch sizes,
        pages per row), each with `budget` buckets."""
        build = lambda sample: None if sample is None else strategy_from_sample(kind, sample, budget)  # noqa: E731
        return cls(build(chunk), build(rows), build(pages))

    def describe(self) -> dict[str, str]:
        """Each dimension's strategy and table in words, for logs and experiment tables."""
        strategies = {"chunk": self.chunk, "rows": self.rows, "pages": self.pages}
        return {n: "default" if s is None else f"{s.name} {list(s.buckets)}" for n, s in strategies.items()}
