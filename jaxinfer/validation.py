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


FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32; below it a value flushes or loses its digits


def check_number(field: str, value, *, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with low_open); NaN and inf are refused, and so
    is a value the device cannot hold: float32 overflows past FLOAT32_MAX and flushes below FLOAT32_TINY (a
    repetition_penalty of 1e-300 would reach the sampler as 0, a division by zero)."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise FieldError(field, f"must be a number, got {value!r}")
    number = float(value)
    if math.isfinite(number) and (abs(number) > FLOAT32_MAX or 0 < abs(number) < FLOAT32_TINY):
        raise FieldError(field, f"must be 0 or of magnitude in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (float32, as the device computes), got {value!r}")
    if not math.isfinite(number) or number > high or number < low or (low_open and number == low):
        bracket = "(" if low_open else "["
        interval = f"{bracket}{low:g}, {high:g}]" if math.isfinite(high) else f"{'>' if low_open else '>='} {low:g}"
        raise FieldError(field, f"must be a finite number {'in ' if math.isfinite(high) else ''}{interval}, got {value!r}")
    return number


def check_bool(field: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise FieldError(field, f"must be true or false, got {value!r}")
    return bool(value)


def check_stop_strings(value, field: str = "stop") -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise FieldError(field, f"must be a string or a list of strings, got {value!r}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise FieldError(field, f"must hold non-empty strings, got {s!r}")
        check_text(field, s)
    return tuple(strings)


def check_token_list(field: str, value, *, nonempty: bool = False) -> tuple[int, ...]:
    """A list of token ids (non-negative ints; checked against the vocabulary with the request, check_token_ids)."""
    if not isinstance(value, (list, tuple)) or (nonempty and not value):
        raise FieldError(field, f"must be a {'non-empty ' if nonempty else ''}list of integers, got {value!r}")
    return tuple(check_int(field, t, low=0) for t in value)


def check_stop_token_ids(value) -> tuple[int, ...]:
    return check_token_list("stop_token_ids", value)


def check_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (JSON's string keys too) or (id, bias) pairs -> sorted pairs; biases in [-100, 100]
    as OpenAI's. The ids are checked against the vocabulary with the request (check_token_ids)."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = list(value)
    else:
        raise FieldError("logit_bias", f"must map token ids to numbers, got {value!r}")
    checked = {}
    for token, bias in pairs:
        if isinstance(token, str) and token.strip().isascii() and token.strip().isdigit():  # "²" and "٣" are digits to str, not ids
            token = int(token)
        token = check_int("logit_bias", token, low=0)
        checked[token] = check_number(f"logit_bias[{token}]", bias, low=-100.0, high=100.0)
    return tuple(sorted(checked.items()))


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


# Request fields of vLLM's and OpenAI's APIs that jaxinfer does not implement: a line that sets one is that
# line's error (never dropped silently). A name that becomes supported leaves this table in one edit; names
# the caller supports (`unsupported_field_error`'s `supported`, e.g. SamplingParams' fields) never count.
UNSUPPORTED_REQUEST_FIELDS = {
    "best_of": "best-of-n sampling", "use_beam_search": "beam search",
    "skip_special_tokens": "keeping special tokens in the text", "spaces_between_special_tokens": "detokenizer options",
    "truncate_prompt_tokens": "per-request prompt truncation (use --truncate)", "guided_decoding_backend": "choosing the grammar backend",
    "user": "end-user ids", "tools": "tool calling", "tool_choice": "tool calling", "parallel_tool_calls": "tool calling",
    "functions": "function calling", "function_call": "function calling", "stream": "streaming responses", "stream_options": "streaming responses",
    "echo": "echoing the prompt", "suffix": "insertion (suffix)", "audio": "audio output", "modalities": "output modalities",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning options", "service_tier": "service tiers", "store": "stored completions",
    "metadata": "stored completions", "web_search_options": "web search", "lora_request": "LoRA adapters", "documents": "chat documents",
}
_NEUTRAL_VALUES = {"best_of": 1, "use_beam_search": False, "stream": False, "echo": False, "store": False, "skip_special_tokens": True}


def unsupported_field_error(fields: dict, supported) -> FieldError | None:
    """The error for the first field of `fields` that vLLM or OpenAI define but jaxinfer does not implement
    (UNSUPPORTED_REQUEST_FIELDS), or None. A field in `supported`, null, or at its no-op value (n=1,
    stream=false, ...) is not an error."""
    for name, value in fields.items():
        if name not in UNSUPPORTED_REQUEST_FIELDS or name in supported or value is None:
            continue
        neutral = _NEUTRAL_VALUES.get(name, _NO_VALUE)
        if type(value) is type(neutral) and value == neutral:
            continue
        return FieldError(name, f"is not supported by jaxinfer ({UNSUPPORTED_REQUEST_FIELDS[name]}); remove it from the request")
    return None


_NO_VALUE = object()
