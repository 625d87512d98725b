"""What a finished request gives back: `RequestOutput`, its `RequestMetrics`, and the merging of a prompt's
n samples into one output (`Samples`).

`output_of(request, text)` is the one place a finished `Request` (host state) becomes a `RequestOutput`;
the text is the output processor's (stopping.py). Host-only: imports the stdlib and
scheduling/request.py, never jax. Invariant: every request that comes in leaves as exactly one output;
a prompt of n samples leaves as one output (sample 0's) whose `samples` holds all n in order.
"""

import dataclasses

import numpy as np

from jaxinfer.scheduling import reasoning
from jaxinfer.scheduling.request import Request


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Where a request's time went, in seconds from its submission. queue + prefill + decode is its
    latency exactly: queue until a step first computed its tokens, prefill from there to its first
    token, decode from there to its end. A request that never ran spends it all queued."""

    queue_s: float
    prefill_s: float
    decode_s: float
    time_per_output_token_s: float  # decode_s per token after the first (0.0 with one token or none)
    num_steps: int  # engine steps that computed its tokens
    num_preemptions: int

    @classmethod
    def of(cls, request: Request) -> "RequestMetrics":
        arrival, finish = request.arrival_time, request.finish_time
        scheduled = finish if request.first_scheduled_time is None else request.first_scheduled_time
        first_token = finish if request.first_token_time is None else request.first_token_time
        decode = finish - first_token
        per_token = decode / (len(request.output_ids) - 1) if len(request.output_ids) > 1 else 0.0
        return cls(scheduled - arrival, first_token - scheduled, decode, per_token, request.num_steps, request.num_preemptions)

    def as_record(self) -> dict:
        return {name: round(value, 6) if isinstance(value, float) else value for name, value in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    index: int  # position in the input
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "timeout" (its deadline passed before it started) | "error"
    num_prompt_tokens: int
    num_generated_tokens: int
    time_to_first_token: float  # seconds from submission
    latency: float  # seconds from submission to finish
    num_preemptions: int = 0
    error: str | None = None  # why it failed, when finish_reason is "error"
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = None  # where its latency went
    # With SamplingParams.logprobs: per generated token, (its log-probability, {token id: log-probability}
    # of the top `logprobs`, most likely first). With prompt_logprobs: the same per prompt token, None for
    # the first (nothing scores it). EngineConfig.logprobs_mode says which distribution.
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # With SamplingParams.n > 1 the prompt's output is sample 0's, and `samples` holds all n in order.
    sample_index: int = 0
    num_samples: int = 1
    samples: "list[RequestOutput] | None" = None
    prompt_token_ids: list[int] | None = None  # the prompt as the engine saw it (after the chat template, truncation)
    # A model that thinks (scheduling/reasoning.py): the text inside its thinking block, tags left out; `text`
    # is then the answer after the block. None when the request never thought.
    reasoning_content: str | None = None
    weight_version: int = 0  # the LLM's weight_version it was generated with (LLM.update_params bumps it)
    embedding: np.ndarray | None = None  # f32[D] with SamplingParams.pooling: the pooled prompt, not normalized (LLM.embed)


def output_of(request: Request, text: str, *, weight_version: int = 0) -> RequestOutput:
    """The output of a finished request whose text (stop strings applied) is `text`; for a model that
    thinks, split into the answer (`text`) and its `reasoning_content`."""
    reasoning_content, text = reasoning.split(text, request.thinking)
    return RequestOutput(
        index=request.arrival_index,
        text=text,
        reasoning_content=reasoning_content,
        token_ids=list(request.output_ids),
        finish_reason=request.finish_reason,
        num_prompt_tokens=len(request.prompt_ids),
        num_generated_tokens=len(request.output_ids),
        time_to_first_token=(request.finish_time if request.first_token_time is None else request.first_token_time) - request.arrival_time,
        latency=request.finish_time - request.arrival_time,
        num_preemptions=request.num_preemptions,
        error=request.error,
        num_cached_tokens=request.num_cached_tokens,
        metrics=RequestMetrics.of(request),
        logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
        prompt_logprobs=_prompt_logprobs(request),
        sample_index=request.sample_index,
        num_samples=request.params.n,
        prompt_token_ids=list(request.prompt_ids),
        weight_version=weight_version,
        embedding=request.embedding(),
    )


def _prompt_logprobs(request: Request) -> list | None:
    """Its prompt log-probabilities, one entry per prompt token (None for the first, and for any a failed
    request never reached)."""
    if request.params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs) or [None] * len(request.prompt_ids)


class Samples:
    """Holds a prompt's samples until all n have finished; `add` returns the prompt's output then."""

    def __init__(self):
        self._waiting: dict[int, list[RequestOutput]] = {}  # prompt index -> its finished samples

    def add(self, output: RequestOutput) -> RequestOutput | None:
        if output.num_samples == 1:
            return output
        done = self._waiting.setdefault(output.index, [])
        done.append(output)
        if len(done) < output.num_samples:
            return None
        ordered = sorted(self._waiting.pop(output.index), key=lambda o: o.sample_index)
        return dataclasses.replace(ordered[0], samples=ordered)
