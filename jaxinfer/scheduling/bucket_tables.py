"""The one owner of bucket geometry: which program shapes exist, and which one a step gets.

`BucketTables` is frozen and derived by `BucketTables.from_config(cfg)` (memoised per EngineConfig) from
the config's limits and whatever tables it was given: the default tables, deterministic mode's fixed
ones and a bucket strategy's are all derived here, never in EngineConfig. The scheduler asks it for the
key of every plan it builds (`prefill_key`, `decode_key`) and the engine compiles `all_keys()` at
warm-up, so the two can never disagree: a plan's key is always one of the compiled keys.

A key is a `BucketKey` (phase, rows, tokens per row, pages per row). Prefill comes in two layouts:
- packed (the default): one row holds the chunks of up to `packed_seqs` sequences back to back, each
  with its own positions, slots and pages (segment-aware causal mask, see attention.py); the row's
  table is the concatenation of the sequences' pages. Keys are ("prefill", 1, T, W).
- unpacked: one sequence per row, `prefill_rows` rows, every row padded to the longest chunk.
Decode is one token per row: ("decode", R, 1, W).
Host-only: imports the stdlib, config, validation and plan; never jax, and never jaxinfer.bucketing (a
bucket strategy, `EngineConfig.buckets`, is read by duck type: its `chunk`/`rows`/`pages` each have
`.buckets`). `pad_to_bucket` and `cut_table` live here, and the offline strategies use them.
"""

import bisect
import dataclasses
import functools
from collections.abc import Sequence

from jaxinfer.config import DETERMINISTIC_PAGES_PER_BLOCK, TABLE_FIELDS, EngineConfig, check_table
from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.validation import FieldError

# The default prefill chunk buckets, chosen by experiments/buckets_on_engine.py (fitted and quantile pad least
# at each program budget; README "Bucket strategies on the engine"): the fit of tests/bucketing/test_config_defaults.py
# (which checks that it still gives them), plus a 32-token bucket for short chat prompts typed alone; cut at
# min(max_prefill_tokens, max_context), which is always added as the largest.
DEFAULT_CHUNK_BUCKETS = (32, 80, 160, 224, 304, 416, 512)
# Sequences per decode step, cut at max_num_seqs. One row serves a lone request (a chat, a batch's last
# sequence) at the weight-read bound: on a 1B Q4_0 GGUF a 1-row step took 37.9 ms and a 4-row one 46.7 ms
# (experiments/profile_steps.py, AMD EPYC 2 cores).
_DEFAULT_DECODE_BATCH_BUCKETS = (1, 4, 8, 16, 32)
_DETERMINISTIC_CHUNK = 64  # the one prefill chunk length of deterministic mode (tokens)
_DETERMINISTIC_ROWS = 8  # rows of every decode program in deterministic mode; more rows run as more programs


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableLimits:
    """What bounds the tables (EngineConfig's limits, in its names)."""

    page_size: int
    max_num_seqs: int
    max_prefill_tokens: int
    max_context: int
    max_prefill_seqs: int

    @property
    def max_chunk(self) -> int:
        return min(self.max_prefill_tokens, self.max_context)

    @property
    def max_pages_per_seq(self) -> int:
        return self.max_context // self.page_size


@dataclasses.dataclass(frozen=True)
class BucketTables:
    page_size: int  # tokens per KV page
    chunk_tokens: tuple[int, ...]  # prefill tokens per row
    prefill_rows: tuple[int, ...]  # rows of an unpacked prefill step; (1,) when packed
    decode_rows: tuple[int, ...]  # sequences per decode step
    pages: tuple[int, ...]  # table widths, pages per row (decode and prefill)
    packed_seqs: int = 0  # sequences one packed prefill row holds at most; 0: unpacked prefill

    # Derived once (the tables are frozen): the scheduler reads these at every step.
    @functools.cached_property
    def packed(self) -> bool:
        return self.packed_seqs > 0

    @functools.cached_property
    def max_chunk(self) -> int:
        return self.chunk_tokens[-1]

    @functools.cached_property
    def max_prefill_rows(self) -> int:
        """Sequences one prefill step holds at most."""
        return self.packed_seqs if self.packed else self.prefill_rows[-1]

    @functools.cached_property
    def max_decode_rows(self) -> int:
        return self.decode_rows[-1]

    @functools.cached_property
    def max_pages(self) -> int:
        return self.pages[-1]

    def samples_per_row(self, phase: str) -> int:
        """Logit positions a row of this phase samples: a packed prefill row samples each sequence's last token."""
        return self.packed_seqs if phase == "prefill" and self.packed else 1

    def first_chunk_width(self, tokens: int) -> int:
        """Narrowest table of a prefill program with `tokens` tokens per row: enough pages to hold them."""
        return pad_to_bucket(min(-(-tokens // self.page_size), self.max_pages), self.pages)

    def prefill_widths(self, tokens: int) -> tuple[int, ...]:
        return tuple(w for w in self.pages if w >= self.first_chunk_width(tokens))

    def prefill_key(self, num_rows: int, num_tokens: int, num_pages: int) -> BucketKey:
        """Key of a prefill step: `num_rows` rows (1 when packed), the longest row's tokens, and the most
        pages a row's table holds (the sum over a packed row's sequences)."""
        tokens = pad_to_bucket(num_tokens, self.chunk_tokens)
        width = max(pad_to_bucket(num_pages, self.pages), self.first_chunk_width(tokens))
        return BucketKey("prefill", pad_to_bucket(num_rows, self.prefill_rows), tokens, width)

    def decode_key(self, num_rows: int, num_pages: int) -> BucketKey:
        return BucketKey("decode", pad_to_bucket(num_rows, self.decode_rows), 1, pad_to_bucket(num_pages, self.pages))

    @functools.cached_property
    def _keys(self) -> tuple[BucketKey, ...]:
        prefill = [BucketKey("prefill", r, t, w) for r in self.prefill_rows for t in self.chunk_tokens for w in self.prefill_widths(t)]
        decode = [BucketKey("decode", r, 1, w) for r in self.decode_rows for w in self.pages]
        return tuple(prefill + decode)

    def all_keys(self) -> list[BucketKey]:
        """Every key a plan can have, prefill first; warm-up compiles exactly these."""
        return list(self._keys)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "BucketTables":
        """The tables of an engine with this config (memoised: equal configs share one BucketTables)."""
        return _tables_of_config(cfg)

    @classmethod
    def from_limits(
        cls, limits: TableLimits, *, prefill_chunk_buckets=None, prefill_seq_buckets=(1,), decode_batch_buckets=None, decode_page_buckets=None,
        prefill_packing: bool | None = None, buckets=None, deterministic: bool = False,
    ) -> "BucketTables":
        """The tables of an engine: those given, and the others derived from the limits (deterministic
        mode's fixed tables, a bucket strategy's, or the defaults). Raises FieldError in EngineConfig's
        field names for tables that cannot work."""
        given = {"prefill_chunk_buckets": prefill_chunk_buckets, "decode_batch_buckets": decode_batch_buckets, "decode_page_buckets": decode_page_buckets}
        tables = dict(given)
        if deterministic:
            tables |= _deterministic_tables(limits, given, prefill_seq_buckets)
        if buckets is not None:
            tables |= _strategy_tables(limits, given, buckets, deterministic)
        tables = _default_tables(limits) | {name: table for name, table in tables.items() if table is not None}
        if prefill_packing is None:
            prefill_packing = not deterministic and tuple(prefill_seq_buckets) == (1,)
        tables = _checked(limits, tables | {"prefill_seq_buckets": prefill_seq_buckets}, packing=prefill_packing, deterministic=deterministic)
        return cls(
            page_size=limits.page_size, chunk_tokens=tables["prefill_chunk_buckets"], prefill_rows=tables["prefill_seq_buckets"],
            decode_rows=tables["decode_batch_buckets"], pages=tables["decode_page_buckets"], packed_seqs=limits.max_prefill_seqs if prefill_packing else 0,
        )


@functools.lru_cache(maxsize=64)
def _tables_of_config(cfg: EngineConfig) -> BucketTables:
    limits = TableLimits(
        page_size=cfg.page_size, max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens,
        max_context=cfg.max_context, max_prefill_seqs=cfg.max_prefill_seqs,
    )
    return BucketTables.from_limits(
        limits, prefill_chunk_buckets=cfg.prefill_chunk_buckets, prefill_seq_buckets=cfg.prefill_seq_buckets,
        decode_batch_buckets=cfg.decode_batch_buckets, decode_page_buckets=cfg.decode_page_buckets,
        prefill_packing=cfg.prefill_packing, buckets=cfg.buckets, deterministic=cfg.deterministic,
    )


def pad_to_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Returns the smallest bucket >= n; raises ValueError naming n and the largest bucket if none is."""
    if n < 0:
        raise ValueError(f"length must be non-negative, got {n=}")
    index = bisect.bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n=} exceeds the largest bucket {buckets[-1]}; chunk it or refit the buckets")
    return buckets[index]


def sorted_table(buckets: Sequence[int]) -> tuple[int, ...]:
    """`buckets` as a tuple of ints; ValueError unless non-empty, strictly increasing and positive."""
    table = tuple(int(b) for b in buckets)
    if not table or table[0] < 1 or any(b >= c for b, c in zip(table, table[1:])):
        raise ValueError(f"buckets must be a non-empty, strictly increasing tuple of positive ints: {table}")
    return table


def cut_table(buckets: Sequence[int], top: int, *, reach: bool) -> tuple[int, ...]:
    """A strategy's table for a dimension whose largest size is `top`: buckets above it dropped, and
    `top` added when the table must reach it (`reach`) or some bucket was over it."""
    table = sorted_table(buckets)
    below = tuple(b for b in table if b < top)
    return below + (top,) if reach or table[-1] >= top else below


def _default_tables(limits: TableLimits) -> dict[str, tuple[int, ...]]:
    """Default chunks cut at the largest chunk (always added); rows 1, 4, 8, 16, 32 cut at max_num_seqs; page
    widths powers of two up to a whole context."""
    return {
        "prefill_chunk_buckets": tuple(b for b in DEFAULT_CHUNK_BUCKETS if b < limits.max_chunk) + (limits.max_chunk,),
        "decode_batch_buckets": tuple(b for b in _DEFAULT_DECODE_BATCH_BUCKETS if b < limits.max_num_seqs) + (limits.max_num_seqs,),
        "decode_page_buckets": _powers_of_two_to(limits.max_pages_per_seq),
    }


def _strategy_tables(limits: TableLimits, given: dict, buckets, deterministic: bool) -> dict[str, tuple[int, ...]]:
    """The tables a bucket strategy (an EngineBuckets, by duck type) gives, each cut to its limit
    (cut_table); a table given too must be that same cut."""
    if deterministic:
        raise FieldError("buckets", "deterministic mode fixes the bucket tables itself; leave buckets unset")
    dimensions = (
        ("chunk", "prefill_chunk_buckets", limits.max_chunk, False),
        ("rows", "decode_batch_buckets", limits.max_num_seqs, True),
        ("pages", "decode_page_buckets", limits.max_pages_per_seq, True),
    )
    tables = {}
    for dimension, name, top, reach in dimensions:
        strategy = getattr(buckets, dimension)
        if strategy is None:
            continue
        cut = cut_table(strategy.buckets, top, reach=reach)
        if given[name] is not None and tuple(given[name]) != cut:
            raise FieldError("buckets", f"sets the {dimension} table, so leave {name} unset (got {given[name]!r})")
        tables[name] = cut
    return tables


def _deterministic_tables(limits: TableLimits, given: dict, prefill_seq_buckets) -> dict[str, tuple[int, ...]]:
    """Fixed row counts and chunk length, because XLA's CPU matmuls round differently for different
    row counts (measured); page widths stay bucketed (multiples of the attention block), because
    attention_over_page_blocks is exact under extra masked blocks. Decode programs have one row count,
    _DETERMINISTIC_ROWS (or max_num_seqs if smaller); the scheduler runs a larger decode batch as
    several of them, so a padded 32-row program never runs for a few rows."""
    named = sorted(name for name, table in given.items() if table is not None)
    if named or tuple(prefill_seq_buckets) != (1,):
        raise FieldError("deterministic", f"fixes the bucket tables itself; leave them unset (got {named or ['prefill_seq_buckets']})")
    return {
        "prefill_chunk_buckets": (min(_DETERMINISTIC_CHUNK, limits.max_chunk),),
        "decode_batch_buckets": (min(_DETERMINISTIC_ROWS, limits.max_num_seqs),),
        "decode_page_buckets": _block_multiples(limits.max_pages_per_seq),
    }


def _checked(limits: TableLimits, tables: dict, *, packing: bool, deterministic: bool) -> dict[str, tuple[int, ...]]:
    """Each table as an increasing tuple of positive integers that reaches (or stays within) its limit."""
    out = {}
    for name, table in tables.items():
        out[name] = check_table(name, table)
    if out["decode_batch_buckets"][-1] < limits.max_num_seqs and not deterministic:
        raise FieldError("decode_batch_buckets", f"must reach max_num_seqs ({limits.max_num_seqs}); its largest is {out['decode_batch_buckets'][-1]}")
    if out["prefill_chunk_buckets"][-1] > limits.max_chunk:
        raise FieldError("prefill_chunk_buckets", f"must not exceed max_prefill_tokens ({limits.max_prefill_tokens}) or max_context ({limits.max_context}); its largest is {out['prefill_chunk_buckets'][-1]}")
    if packing and out["prefill_seq_buckets"] != (1,):
        raise FieldError("prefill_seq_buckets", f"must be (1,) with prefill_packing, whose one row holds several sequences; got {out['prefill_seq_buckets']}")
    if out["decode_page_buckets"][-1] < limits.max_pages_per_seq:
        raise FieldError("decode_page_buckets", f"must reach max_context / page_size ({limits.max_pages_per_seq} pages); its largest is {out['decode_page_buckets'][-1]}")
    return out


def _block_multiples(max_pages: int) -> tuple[int, ...]:
    """Page widths for deterministic mode: powers of two times the attention block, up to max_pages
    (which must be a multiple of the block, or smaller than it)."""
    if max_pages <= DETERMINISTIC_PAGES_PER_BLOCK:
        return (max_pages,)
    if max_pages % DETERMINISTIC_PAGES_PER_BLOCK:
        raise FieldError("deterministic", f"needs max_context / page_size ({max_pages} pages) to be a multiple of {DETERMINISTIC_PAGES_PER_BLOCK}")
    widths, width = [], DETERMINISTIC_PAGES_PER_BLOCK
    while width < max_pages:
        widths.append(width)
        width *= 2
    return tuple(w for w in widths if max_pages % w == 0) + (max_pages,)


def _powers_of_two_to(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `top`, then `top`."""
    return tuple(1 << e for e in range(max(top - 1, 0).bit_length()) if 1 << e < top) + (top,)
