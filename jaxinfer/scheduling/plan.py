"""The step plan: `BucketKey` (a program's shape), `RowChunk` (one sequence's slice of a step) and
`StepPlan`, the only thing the scheduler hands the engine, which lays out its own numpy arrays. No jax.

Padding lanes point at the null page (block_pool.NULL_PAGE), so padded slots never touch real data.
`place_sampling` is the ONE per-row sampling packer: a request's SamplingParams and host state (seed, step,
bias, prompt length) into one slot of the sampling arrays. `StepPlan.build` calls it per
chunk, and the dense reference generator (engine/generate.py) per step through `pack_sampling`.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxinfer.scheduling.block_pool import NULL_PAGE
from jaxinfer.scheduling.request import Request
from jaxinfer.validation import FieldError


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
    min_p: np.ndarray  # f32[R * J]
    presence: np.ndarray  # f32[R * J]
    frequency: np.ndarray  # f32[R * J]
    repetition: np.ndarray  # f32[R * J]
    bias_ids: np.ndarray  # i32[R * J, NB]; the slot's logit_bias, padded with (0, 0)
    bias_values: np.ndarray  # f32[R * J, NB]
    num_logprobs: np.ndarray  # i32[R * J]; log-probabilities wanted per slot, -1 none
    prompt_lens: np.ndarray  # i32[R * J]; positions below are prompt tokens (the penalties' split)
    targets: np.ndarray  # i32[R, T]; the prompt token after each token, where its prompt logprobs are wanted; -1 else
    request_ids: tuple[str, ...]  # the real sequences, in slot order
    num_new_tokens: tuple[int, ...]  # tokens of each real sequence computed by this step
    samples: tuple[bool, ...]  # whether each real sequence's drawn token is kept
    guides: tuple = ()  # each real sequence's guide.Guide (Request.guide) or None; the engine fills the masks
    bans: tuple = ()  # each real sequence's ids banned from its next token (min_tokens: Request.next_token_bans), in the masks too
    pooled: tuple = ()  # each real sequence's SamplingParams.pooling (an embedding's) or None; the engine copies pooled states for them

    @classmethod
    def build(cls, phase: str, rows: list[RowChunk], shape: BucketKey, page_size: int, *, packed: int = 0, bias_width: int = 1) -> "StepPlan":
        """Lay the chunks out in arrays of the bucket's shape, one per row, or with `packed` (J) all in
        row 0, back to back; the rest is padding on the null page. `bias_width`: NB, the engine's
        max_logit_bias."""
        slots = packed or 1
        arrays = _padding_arrays(shape.num_rows, shape.num_tokens, shape.num_pages, slots, page_size, packed=bool(packed), bias_width=bias_width)
        cursor = _Cursor()
        for index, chunk in enumerate(rows):
            _place(arrays, chunk, cursor, index, page_size)
            cursor = cursor.after(chunk) if packed else _Cursor(row=index + 1)
        return cls(
            phase=phase,
            request_ids=tuple(c.request.request_id for c in rows),
            num_new_tokens=tuple(c.length for c in rows),
            samples=tuple(c.sample for c in rows),
            guides=tuple(c.request.guide for c in rows),
            bans=tuple(c.request.next_token_bans() for c in rows),
            pooled=tuple(c.request.params.pooling for c in rows),
            **arrays,
        )

    @property
    def bucket(self) -> BucketKey:
        rows, tokens = self.token_ids.shape
        return BucketKey(self.phase, rows, tokens, self.block_tables.shape[1])

    @property
    def wants_logprobs(self) -> bool:
        return bool((self.num_logprobs >= 0).any())

    @property
    def wants_prompt_logprobs(self) -> bool:
        return bool((self.targets >= 0).any())

    @property
    def wants_pooled(self) -> bool:
        return any(p is not None for p in self.pooled)

    def chunk_starts(self) -> list[tuple[int, int]]:
        """(row, token index) where each real sequence's chunk begins: back to back in row 0 when packed."""
        if self.logit_indices.shape[1] == 1:
            return [(i, 0) for i in range(len(self.request_ids))]
        ends = np.cumsum(self.num_new_tokens)
        return [(0, int(end - n)) for end, n in zip(ends, self.num_new_tokens)]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_padded_tokens(self) -> int:
        return self.token_ids.size


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Host copy of log-probabilities: per entry, a token's log-probability and the top K (sampling.Logprobs)."""

    token: np.ndarray  # f32[N]
    top_ids: np.ndarray  # i32[N, K]
    top: np.ndarray  # f32[N, K]

    def entry(self, i: int, k: int) -> tuple[float, dict[int, float]]:
        """Entry i with its top k: (log-probability, {token id: log-probability}, most likely first)."""
        return float(self.token[i]), {int(t): float(v) for t, v in zip(self.top_ids[i, :k], self.top[i, :k])}


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step returns: the drawn tokens (one per sequence slot), and when the plan asked for them
    their log-probabilities (per slot) and the prompt tokens' (per token of the plan, [R * T]), and for an
    embedding's chunk its final hidden states (after the final norm) pooled per slot."""

    tokens: np.ndarray  # i32[R * J]
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    pooled_last: np.ndarray | None = None  # f32[R * J, D]; each slot's hidden state at its logit index (its chunk's last token)
    pooled_sum: np.ndarray | None = None  # f32[R * J, D]; each slot's hidden states summed over its chunk's tokens

    @classmethod
    def of(cls, result: "StepResult | np.ndarray") -> "StepResult":
        """A bare token array (a fake step in tests) is a result without log-probabilities."""
        return result if isinstance(result, StepResult) else cls(np.asarray(result))


@dataclasses.dataclass(frozen=True)
class _Cursor:
    """Where the next chunk of a plan goes: its row, first token and first table entry."""

    row: int = 0
    token: int = 0
    page: int = 0

    def after(self, chunk: RowChunk) -> "_Cursor":
        return _Cursor(self.row, self.token + chunk.length, self.page + len(chunk.pages))


def _padding_arrays(num_rows: int, num_tokens: int, width: int, slots: int, page_size: int, *, packed: bool, bias_width: int) -> dict[str, np.ndarray]:
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
        **sampling_padding(samples, bias_width),
        "targets": np.full((num_rows, num_tokens), -1, np.int32),
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
    place_sampling(arrays, index, chunk.request)
    params = chunk.request.params
    if params.prompt_logprobs is not None:  # each prompt token's successor, where it is a prompt token from logprob_start on
        prompt = chunk.request.prompt_ids
        scored = (positions < len(prompt) - 1) & (positions + 1 >= params.logprob_start)
        arrays["targets"][row, at.token + np.flatnonzero(scored)] = np.asarray(prompt, np.int32)[positions[scored] + 1]


def sampling_padding(num_slots: int, bias_width: int) -> dict[str, np.ndarray]:
    """The sampling arrays (StepPlan's names) of `num_slots` padding slots: greedy, no cut, no logit
    processing, no log-probabilities. `bias_width`: NB, the sparse bias entries a slot can hold."""
    floats = lambda value: np.full(num_slots, value, np.float32)  # noqa: E731
    ints = lambda value, *shape: np.full((num_slots, *shape), value, np.int32)  # noqa: E731
    return {
        "temperature": floats(0.0),  # f32[S]; 0 = greedy
        "top_k": ints(0),  # i32[S]; 0 = off
        "top_p": floats(1.0),  # f32[S]; 1 = off
        "seeds": ints(0),  # i32[S]
        "steps": ints(0),  # i32[S]; index of the output token the slot draws
        "min_p": floats(0.0),  # f32[S]; 0 = off
        "presence": floats(0.0),  # f32[S]
        "frequency": floats(0.0),  # f32[S]
        "repetition": floats(1.0),  # f32[S]; 1 = off
        "bias_ids": ints(0, bias_width),  # i32[S, NB]; padding entries are token 0 with bias 0
        "bias_values": np.zeros((num_slots, bias_width), np.float32),  # f32[S, NB]
        "num_logprobs": ints(-1),  # i32[S]; -1: none wanted
        "prompt_lens": ints(0),  # i32[S]; positions below are prompt tokens (the penalties' split)
    }


def place_sampling(arrays: dict[str, np.ndarray], index: int, request: Request) -> None:
    """THE per-row sampling packer: write `request`'s sampling into slot `index` of `arrays` (from
    `sampling_padding`): its parameters, its seed and step (the output token it draws next), its sparse
    bias (logit_bias), its log-probability request and its prompt length. Every SamplingParams field that
    acts on the logits or the draw is packed here but those of the token mask, which the engine fills: the
    grammar, allowed_token_ids and bad_words (the request's guide, `Request.guide`) and min_tokens' bans on
    EOS and the stop ids (`Request.next_token_bans`, StepPlan.bans); stop conditions stay on the host (stopping.py)."""
    params = request.params
    arrays["temperature"][index] = params.temperature
    arrays["top_k"][index] = params.top_k
    arrays["top_p"][index] = params.top_p
    arrays["seeds"][index] = request.seed
    arrays["steps"][index] = len(request.output_ids)
    arrays["min_p"][index] = params.min_p
    arrays["presence"][index] = params.presence_penalty
    arrays["frequency"][index] = params.frequency_penalty
    arrays["repetition"][index] = params.repetition_penalty
    bias = params.logit_bias
    if len(bias) > arrays["bias_ids"].shape[1]:
        raise FieldError("logit_bias", f"holds {len(bias)} tokens; the arrays hold {arrays['bias_ids'].shape[1]}")
    arrays["bias_ids"][index, : len(bias)] = [token for token, _ in bias]
    arrays["bias_values"][index, : len(bias)] = [value for _, value in bias]
    arrays["num_logprobs"][index] = -1 if params.logprobs is None else params.logprobs
    arrays["prompt_lens"][index] = len(request.prompt_ids)


def pack_sampling(requests: list[Request], *, bias_width: int) -> dict[str, np.ndarray]:
    """The sampling arrays of `requests`, one slot each (S = len(requests)), by `place_sampling`."""
    arrays = sampling_padding(len(requests), bias_width)
    for index, request in enumerate(requests):
        place_sampling(arrays, index, request)
    return arrays
