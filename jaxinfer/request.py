"""User-facing request types: `SamplingParams` (validated where built), `Request` (host state of one
request) and the derived seed; no jax.

`SamplingParams` is what a user passes per prompt, from Python or from a JSONL line. It checks every
field where it is built (validation.py: type, range, finiteness) and names the field in its errors
(`FieldError`), so the API, the batch reader and the CLI share one set of rules. It never reaches a
traced function as Python values: `StepPlan.build` (plan.py) packs each step's parameters into arrays,
so a new temperature or seed never triggers a compile.
"""

import dataclasses
import hashlib
import math

from jaxinfer.validation import FieldError, check_bool, check_int, check_number, check_stop_strings, check_stop_token_ids, unknown_field_error

TRUNCATE_SIDES = ("none", "left", "right")  # what a prompt over the context does: an error, or cut (api.truncate_prompt)
MAX_SEED = 2**31  # seeds are int32 on the device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on the device


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
            "stop_token_ids": check_stop_token_ids(self.stop_token_ids),
            "stop": check_stop_strings(self.stop),
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
    first_scheduled_time: float | None = None  # when a step first computed any of its tokens (runloop)
    num_steps: int = 0  # engine steps that computed its tokens
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        return (self.prompt_ids + self.output_ids)[start:stop]
