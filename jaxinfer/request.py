"""User-facing request types; plain Python and numpy, no jax.

`SamplingParams` is what a user passes per prompt. It never reaches a traced function as Python values:
the engine packs each batch's parameters into arrays (sampling.SamplingArrays), so a new temperature or
seed never triggers a compile.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Defaults follow vLLM, except max_tokens."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None  # None: derived from the engine seed and the request's index
    max_tokens: int = 128  # generated tokens at most
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated (it is kept in the output)
    stop: tuple[str, ...] = ()  # finish when the text contains one of these (the text is cut before it)
    ignore_eos: bool = False  # keep going past the end-of-sequence token

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop) if not isinstance(self.stop, str) else (self.stop,))



def stop_reason(token_ids: list[int], params: SamplingParams, eos_id: int | None) -> str | None:
    """'stop' if the last token ends the request, 'length' if max_tokens is reached, else None."""
    last = token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and eos_id is not None and last == eos_id):
        return "stop"
    if len(token_ids) >= params.max_tokens:
        return "length"
    return None


def seeds_for(params: list[SamplingParams], base_seed: int, first_index: int = 0) -> np.ndarray:
    """int32[B] seeds: the request's own, or one derived from the engine seed and its index."""
    derived = [(base_seed * 1_000_003 + first_index + i) % (2**31) for i in range(len(params))]
    return np.array([p.seed if p.seed is not None else d for p, d in zip(params, derived)], np.int32)


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

    @property
    def in_decode(self) -> bool:
        """All tokens but the newest are in the pool: the next step decodes the newest one."""
        return bool(self.output_ids) and self.num_computed_tokens == self.num_tokens - 1


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything one jitted step needs, as numpy arrays whose shapes are the bucket key.

    R rows (sequences, padded to a bucket), T tokens per row, P pages per row. Padding rows and padding
    tokens write to the null page and their sampled tokens are ignored.
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

    @property
    def bucket(self) -> tuple[str, int, int, int]:
        rows, tokens = self.token_ids.shape
        return (self.phase, rows, tokens, self.block_tables.shape[1])

    @property
    def num_real_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_padded_tokens(self) -> int:
        return self.token_ids.size
