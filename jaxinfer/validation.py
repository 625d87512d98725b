"""The one set of field checks: every user-set value (SamplingParams, request, EngineConfig and CLI fields)
is checked by these, and a bad one raises `FieldError` naming the field. Standard library and numpy only.

Token ids (prompts, stop tokens) are checked against the vocabulary on the host by `check_token_ids`,
because the embedding gather clamps out-of-range ids silently.
"""

import difflib
import math

import numpy as np

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


def check_stop_strings(value) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise FieldError("stop", f"must be a string or a list of strings, got {value!r}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise FieldError("stop", f"must hold non-empty strings, got {s!r}")
        check_text("stop", s)
    return tuple(strings)


def check_stop_token_ids(value) -> tuple[int, ...]:
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
