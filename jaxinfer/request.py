"""User-facing request types and the one validation boundary of sampling parameters; no jax.

`SamplingParams` is what a user passes per prompt, from Python or from a JSONL line. It checks every
field where it is built (type, range, finiteness) and names the field in its errors (`FieldError`), so
the API, the batch reader and the CLI share one set of rules. It never reaches a traced function as
Python values: `StepPlan.build` packs each step's parameters into arrays, so a new temperature or seed
never triggers a compile. Token ids (prompts, stop tokens) are checked against the vocabulary on the
host by `check_token_ids`, because the embedding gather clamps out-of-range ids silently.
"""

import dataclasses
import difflib
import hashlib
import math
from typing import NamedTuple

import numpy as np

from jaxinfer.block_pool import NULL_PAGE

MAX_SEED = 2**31  # seeds are int32 on the device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on the device


class FieldError(ValueError):
    """A user-set field (a SamplingParams, request or EngineConfig field) has a bad value.

    `field` is the field's name; `str()` reads "<field> <problem>", and the CLI renames the field to the
    flag the user typed.
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


def check_int(field: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int in [low, high]; bools, floats and strings are refused, never coerced."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise FieldError(field, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise FieldError(field, f"must be in [{low}, {high}], got {value}" if high is not None else f"must be >= {low}, got {value}")
    return int(value)


def check_number(field: str, value, *, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with low_open); NaN and inf are refused."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise FieldError(field, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        interval = f"{bracket}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise FieldError(field, f"must be a finite number {'in ' if math.isfinite(high) else ''}{interval}, got {value!r}")
    return value


def check_bool(field: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise FieldError(field, f"must be true or false, got {value!r}")
    return bool(value)


def _check_stop_strings(value) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise FieldError("stop", f"must be a string or a list of strings, got {value!r}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise FieldError("stop", f"must hold non-empty strings, got {s!r}")
        check_text("stop", s)
    return tuple(strings)


def _check_stop_token_ids(value) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise FieldError("stop_token_ids", f"must be a list of integers, got {value!r}")
    return tuple(check_int("stop_token_ids", t, low=0) for t in value)


def check_text(field: str, text: str) -> str:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as '\\ud800' from JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(field, f"holds a lone surrogate {text[e.start]!r} at character {e.start}; it is not valid Unicode text") from None
    return text


def check_token_ids(field: str, ids, vocab_size: int) -> list[int]:
    """Token ids as ints in [0, vocab_size); anything else is an error naming the first bad id."""
    ids = list(ids)
    for i, t in enumerate(ids):
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)) or not 0 <= t < vocab_size:
            raise FieldError(field, f"holds {t!r} at index {i}; token ids must be integers in [0, {vocab_size})")
    return [int(t) for t in ids]


def unknown_field_error(field: str, known) -> FieldError:
    """An error for a field nobody defines, with a close match when there is one (a typo)."""
    close = difflib.get_close_matches(field, list(known), n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
    return FieldError(field, f"is not a known field{hint}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Defaults follow vLLM, except max_tokens."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None  # None: derived from the engine seed and the request's identity
    max_tokens: int = 128  # generated tokens at most
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated (it is kept in the output)
    stop: tuple[str, ...] = ()  # finish when the text contains one of these (the text is cut before it)
    ignore_eos: bool = False  # keep going past the end-of-sequence token

    def __post_init__(self):
        checked = {
            "temperature": check_number("temperature", self.temperature, low=0.0, high=math.inf),
            "top_k": check_int("top_k", self.top_k, low=0, high=MAX_TOP_K),
            "top_p": check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True),
            "seed": None if self.seed is None else check_int("seed", self.seed, low=0, high=MAX_SEED - 1),
            "max_tokens": check_int("max_tokens", self.max_tokens, low=1),
            "stop_token_ids": _check_stop_token_ids(self.stop_token_ids),
            "stop": _check_stop_strings(self.stop),
            "ignore_eos": check_bool("ignore_eos", self.ignore_eos),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_fields(cls, fields: dict, defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """Build from a dict of field values (a JSONL line) over `defaults`; unknown names are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in fields:
            if name not in names:
                raise unknown_field_error(name, names)
        return dataclasses.replace(defaults or cls(), **fields)


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def derive_seed(base_seed: int, identity: str) -> int:
    """A request's seed from the engine seed and a stable identity (its input index, or its batch key),
    so that the same request draws the same tokens in every run, resumed or not."""
    digest = hashlib.blake2b(f"{base_seed}\x00{identity}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


class RequestStatus:
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request's host state. `num_computed_tokens` counts tokens of prompt + output whose K/V is in
    the pool; a preempted request drops to 0 and recomputes, keeping the tokens it already generated."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0  # lower runs first
    deadline: float | None = None  # time.perf_counter() by which it must start, else it times out
    arrival_index: int = 0
    arrival_time: float = 0.0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: str = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed, when finish_reason is "error"
    cache_salt: str | None = None  # prefix-cache isolation: pages are shared only between equal salts
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at first admission
    admit_index: int = -1  # order of the latest admission; preemption takes the largest first
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        return (self.prompt_ids + self.output_ids)[start:stop]


class BucketKey(NamedTuple):
    """The shape of a step's program: phase, rows, tokens per row, pages per row."""

    phase: str
    num_rows: int
    num_tokens: int
    num_pages: int


@dataclasses.dataclass(frozen=True)
class RowChunk:
    """One real row of a step: `length` tokens of `request` from position `start`, reading `pages`."""

    request: Request
    start: int
    length: int
    pages: list[int]
    sample: bool  # whether the token drawn after the chunk is kept


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything one jitted step needs, as numpy arrays whose shapes are the bucket key.

    R rows (sequences, padded to a bucket), T tokens per row, P pages per row. Padding rows and padding
    tokens write to the null page (0) and their sampled tokens are ignored.
    """

    phase: str  # "prefill" | "decode"
    token_ids: np.ndarray  # i32[R, T]
    positions: np.ndarray  # i32[R, T]
    block_tables: np.ndarray  # i32[R, P]
    slot_pages: np.ndarray  # i32[R, T]
    slot_offsets: np.ndarray  # i32[R, T]
    logit_indices: np.ndarray  # i32[R]; token index whose logits are sampled
    temperature: np.ndarray  # f32[R]
    top_k: np.ndarray  # i32[R]
    top_p: np.ndarray  # f32[R]
    seeds: np.ndarray  # i32[R]
    steps: np.ndarray  # i32[R]; index of the output token each row draws
    request_ids: tuple[str, ...]  # the real rows, in order
    num_new_tokens: tuple[int, ...]  # tokens of each real row computed by this step
    samples: tuple[bool, ...]  # whether each real row's drawn token is kept

    @classmethod
    def build(cls, phase: str, rows: list[RowChunk], shape: BucketKey, page_size: int) -> "StepPlan":
        """Lay the real rows out in arrays of the bucket's shape; the rest is padding on the null page."""
        arrays = _padding_arrays(shape.num_rows, shape.num_tokens, shape.num_pages)
        for row, chunk in enumerate(rows):
            _fill_row(arrays, row, chunk, page_size)
        return cls(
            phase=phase,
            request_ids=tuple(c.request.request_id for c in rows),
            num_new_tokens=tuple(c.length for c in rows),
            samples=tuple(c.sample for c in rows),
            **arrays,
        )

    @property
    def bucket(self) -> BucketKey:
        rows, tokens = self.token_ids.shape
        return BucketKey(self.phase, rows, tokens, self.block_tables.shape[1])

    @property
    def num_real_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_padded_tokens(self) -> int:
        return self.token_ids.size


def _padding_arrays(num_rows: int, num_tokens: int, width: int) -> dict[str, np.ndarray]:
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


def _fill_row(arrays: dict[str, np.ndarray], row: int, chunk: RowChunk, page_size: int) -> None:
    pages = np.asarray(chunk.pages, np.int32)
    positions = np.arange(chunk.start, chunk.start + chunk.length, dtype=np.int32)
    arrays["token_ids"][row, : chunk.length] = chunk.request.tokens_between(chunk.start, chunk.start + chunk.length)
    arrays["positions"][row, : chunk.length] = positions
    arrays["slot_pages"][row, : chunk.length] = pages[positions // page_size]
    arrays["slot_offsets"][row, : chunk.length] = positions % page_size
    arrays["block_tables"][row, : len(pages)] = pages
    arrays["logit_indices"][row] = chunk.length - 1
    params = chunk.request.params
    arrays["temperature"][row] = params.temperature
    arrays["top_k"][row] = params.top_k
    arrays["top_p"][row] = params.top_p
    arrays["seeds"][row] = chunk.request.seed
    arrays["steps"][row] = len(chunk.request.output_ids)
