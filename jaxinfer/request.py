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
    number = float(value)
    if not math.isfinite(number) or number > high or number < low or (low_open and number == low):
        bracket = "(" if low_open else "["
        interval = f"{bracket}{low:g}, {high:g}]" if math.isfinite(high) else f"{'>' if low_open else '>='} {low:g}"
        raise FieldError(field, f"must be a finite number {'in ' if math.isfinite(high) else ''}{interval}, got {value!r}")
    return number


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

    R rows, T tokens per row, P pages per row, J sequences per row (1, or a packed row's sequences, see
    bucket_tables.py). Sequence slot i (row i // J, slot i % J) holds `request_ids[i]`: its logits come from
    token `logit_indices[row, slot]` and its sampling parameters from index i. Padding tokens write to the
    null page (0); padding slots' tokens are ignored.
    """

    phase: str  # "prefill" | "decode"
    token_ids: np.ndarray  # i32[R, T]
    positions: np.ndarray  # i32[R, T]
    block_tables: np.ndarray  # i32[R, P]
    slot_pages: np.ndarray  # i32[R, T]
    slot_offsets: np.ndarray  # i32[R, T]
    page_positions: np.ndarray  # i32[R, P]; position of each table entry's first slot
    page_segments: np.ndarray  # i32[R, P]; sequence (of the row) each table entry belongs to; -1 padding
    token_segments: np.ndarray  # i32[R, T]; sequence (of the row) each token belongs to; -2 padding
    logit_indices: np.ndarray  # i32[R, J]; token index whose logits each sequence slot samples
    temperature: np.ndarray  # f32[R * J]
    top_k: np.ndarray  # i32[R * J]
    top_p: np.ndarray  # f32[R * J]
    seeds: np.ndarray  # i32[R * J]
    steps: np.ndarray  # i32[R * J]; index of the output token each slot draws
    request_ids: tuple[str, ...]  # the real sequences, in slot order
    num_new_tokens: tuple[int, ...]  # tokens of each real sequence computed by this step
    samples: tuple[bool, ...]  # whether each real sequence's drawn token is kept

    @classmethod
    def build(cls, phase: str, rows: list[RowChunk], shape: BucketKey, page_size: int, *, packed: int = 0) -> "StepPlan":
        """Lay the chunks out in arrays of the bucket's shape, one per row, or with `packed` (J) all in
        row 0, back to back; the rest is padding on the null page."""
        slots = packed or 1
        arrays = _padding_arrays(shape.num_rows, shape.num_tokens, shape.num_pages, slots, page_size, packed=bool(packed))
        cursor = _Cursor()
        for index, chunk in enumerate(rows):
            _place(arrays, chunk, cursor, index, page_size)
            cursor = cursor.after(chunk) if packed else _Cursor(row=index + 1)
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


@dataclasses.dataclass(frozen=True)
class _Cursor:
    """Where the next chunk of a plan goes: its row, first token and first table entry."""

    row: int = 0
    token: int = 0
    page: int = 0

    def after(self, chunk: RowChunk) -> "_Cursor":
        return _Cursor(self.row, self.token + chunk.length, self.page + len(chunk.pages))


def _padding_arrays(num_rows: int, num_tokens: int, width: int, slots: int, page_size: int, *, packed: bool) -> dict[str, np.ndarray]:
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    samples = num_rows * slots
    return {
        "token_ids": zeros(num_rows, num_tokens),
        "positions": zeros(num_rows, num_tokens),
        "block_tables": np.full((num_rows, width), NULL_PAGE, np.int32),
        "slot_pages": np.full((num_rows, num_tokens), NULL_PAGE, np.int32),
        "slot_offsets": zeros(num_rows, num_tokens),
        "page_positions": np.broadcast_to(np.arange(width, dtype=np.int32) * page_size, (num_rows, width)).copy(),
        "page_segments": np.full((num_rows, width), -1 if packed else 0, np.int32),
        "token_segments": np.full((num_rows, num_tokens), -2 if packed else 0, np.int32),
        "logit_indices": zeros(num_rows, slots),
        "temperature": np.zeros(samples, np.float32),
        "top_k": zeros(samples),
        "top_p": np.ones(samples, np.float32),
        "seeds": zeros(samples),
        "steps": zeros(samples),
    }


def _place(arrays: dict[str, np.ndarray], chunk: RowChunk, at: _Cursor, index: int, page_size: int) -> None:
    """Write `chunk` (the `index`-th sequence of the plan) at `at`; its segment is its slot in the row."""
    row, tokens, table = at.row, slice(at.token, at.token + chunk.length), slice(at.page, at.page + len(chunk.pages))
    slot = index - row * arrays["logit_indices"].shape[1]
    pages = np.asarray(chunk.pages, np.int32)
    positions = np.arange(chunk.start, chunk.start + chunk.length, dtype=np.int32)
    arrays["token_ids"][row, tokens] = chunk.request.tokens_between(chunk.start, chunk.start + chunk.length)
    arrays["positions"][row, tokens] = positions
    arrays["slot_pages"][row, tokens] = pages[positions // page_size]
    arrays["slot_offsets"][row, tokens] = positions % page_size
    arrays["token_segments"][row, tokens] = slot
    arrays["block_tables"][row, table] = pages
    arrays["page_positions"][row, table] = np.arange(len(pages), dtype=np.int32) * page_size
    arrays["page_segments"][row, table] = slot
    arrays["logit_indices"][row, slot] = at.token + chunk.length - 1
    params = chunk.request.params
    arrays["temperature"][index] = params.temperature
    arrays["top_k"][index] = params.top_k
    arrays["top_p"][index] = params.top_p
    arrays["seeds"][index] = chunk.request.seed
    arrays["steps"][index] = len(chunk.request.output_ids)
