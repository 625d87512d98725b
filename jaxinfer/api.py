"""`LLM(...).generate(prompts, SamplingParams(...))` for notebooks and scripts.

The run loop joins the three pieces: the tokenizer (text in and out), the host Scheduler (what runs
each step) and the Engine (compiled programs over the donated pool). `stream()` yields each request's
output as soon as it finishes, which the batch CLI writes at once; `generate()` collects them back into
input order.
"""

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from jaxinfer import loading, tokenizer as tok
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.request import Request, SamplingParams, seeds_for
from jaxinfer.scheduler import Scheduler

_PROGRESS_MIN_REQUESTS = 8  # show a progress bar for jobs at least this large


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    index: int  # position in the input
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "timeout" (its deadline passed before it started)
    num_prompt_tokens: int
    num_generated_tokens: int
    time_to_first_token: float  # seconds from submission
    latency: float  # seconds from submission to finish
    num_preemptions: int = 0


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One unit of work: token ids plus its sampling parameters. `index` orders the outputs."""

    index: int
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    deadline_s: float | None = None  # seconds after submission by which it must start


class LLM:
    """A loaded model with a warmed-up paged engine.

    Args:
      model: a GGUF file, a Hugging Face folder, or None for the embedded SmolLM2-135M-Instruct.
      dtype: compute dtype, "float32" (default, best on CPU) or "bfloat16".
      engine_config: an EngineConfig; keyword overrides of its fields may be passed instead.
    """

    def __init__(self, model=None, *, dtype: str = "float32", engine_config: EngineConfig | None = None, warmup: bool = True, **engine_overrides):
        engine_config = dataclasses.replace(engine_config or EngineConfig(), **engine_overrides)
        self.model_config, params = loading.load_model(model, dtype=dtype)
        self.tokenizer = tok.load_tokenizer(model)
        self.engine_config = engine_config
        self.engine = Engine(self.model_config, params, engine_config)
        if warmup:
            self.engine.warmup()
        self.last_stats = None

    # ------------------------------------------------------------ inputs

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    # ------------------------------------------------------------ running

    def stream(self, prompts: Iterable[Prompt], *, progress: bool | None = None) -> Iterator[RequestOutput]:
        """Run prompts through the engine, yielding each output as soon as it finishes."""
        scheduler = Scheduler(self.engine_config, self.engine.num_pages, eos_id=self.tokenizer.eos_id, detokenize=self.tokenizer.decode)
        submitted = self._submit(scheduler, list(prompts))
        bar = tqdm(total=len(submitted), unit="req", disable=not (progress if progress is not None else len(submitted) >= _PROGRESS_MIN_REQUESTS))
        try:
            while scheduler.has_work():
                for request in scheduler.expire():
                    bar.update(1)
                    yield self._output(request)
                for plan in scheduler.schedule():
                    for request in scheduler.update(plan, self.engine.step(plan)):
                        bar.update(1)
                        yield self._output(request)
        finally:
            bar.close()
            self.last_stats = scheduler.stats

    def _submit(self, scheduler: Scheduler, prompts: list[Prompt]) -> list[Request]:
        now = time.perf_counter()
        seeds = seeds_for([p.params for p in prompts], self.engine_config.seed)
        requests = []
        for prompt, seed in zip(prompts, seeds):
            deadline = None if prompt.deadline_s is None else now + prompt.deadline_s
            request = Request(
                str(prompt.index), prompt.token_ids, prompt.params, int(seed), priority=prompt.priority,
                deadline=deadline, arrival_index=prompt.index, arrival_time=now,
            )
            scheduler.add(request)
            requests.append(request)
        return requests

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_ids, skip_special=True)
        for stop in request.params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        return RequestOutput(
            index=int(request.request_id),
            text=text,
            token_ids=list(request.output_ids),
            finish_reason=request.finish_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_generated_tokens=len(request.output_ids),
            time_to_first_token=(request.first_token_time or request.finish_time) - request.arrival_time,
            latency=request.finish_time - request.arrival_time,
            num_preemptions=request.num_preemptions,
        )

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, progress: bool | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one RequestOutput per prompt, in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _broadcast_params(sampling_params, len(prompts))
        work = [Prompt(i, self.encode(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        outputs = sorted(self.stream(work, progress=progress), key=lambda o: o.index)
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, progress: bool | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role', 'content'}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.encode_chat(m) for m in conversations], sampling_params, progress=progress)


def _broadcast_params(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
