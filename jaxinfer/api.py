"""`LLM(...).generate(prompts, SamplingParams(...))` for notebooks and scripts.

`LLM` joins the tokenizer (text in and out), the host Scheduler (what runs each step), the Engine
(compiled programs over the donated pool) and the OutputProcessor (when a request is done, and its
text) through the one run loop, `runloop.run`. `prepare` is the request boundary that the API and the
batch reader share: it encodes, truncates on request, and checks token ids against the vocabulary and
the request against the engine's limits, raising a `ValueError` that names the problem. `stream()`
yields each request's output as soon as it finishes, which the batch CLI writes at once; `generate()`
collects them back into input order.
"""

import dataclasses
import functools
import heapq
import itertools
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence, Sized

from tqdm.auto import tqdm

from jaxinfer.scheduling import guided, runloop
from jaxinfer.loading import loading, tokenizer as tok
from jaxinfer.engine import profiling, tuning
from jaxinfer.model import sharding
from jaxinfer.scheduling.block_pool import BlockPool, page_hashes
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.options import LoadOptions
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.model.params import Params
from jaxinfer.scheduling.replicas import Replica, ReplicaLoad, route
from jaxinfer.scheduling.request import TRUNCATE_SIDES, Request, SamplingParams, derive_seed
from jaxinfer.validation import FieldError, check_bool, check_int, check_number, check_text, check_token_ids
from jaxinfer.scheduling.scheduler import Scheduler, check_request, check_sampling_limits

_PROGRESS_MIN_REQUESTS = 8  # show a progress bar for jobs at least this large
_INFLIGHT_PER_SEQ = 4  # LLM.stream's default in-flight prompts of a lazy input, per max_num_seqs per replica
_MAX_ROUTED_PAGES = 1 << 16  # prefix names a stream's router remembers before forgetting them (they are cached by then)


class _RouteState:
    """What `LLM._route` carries from one chunk of a stream to the next: the load routed to each replica
    and the prefix pages sent to it."""

    def __init__(self, num_replicas: int):
        self.loads: list[int] = [0] * num_replicas
        self.routed_pages: list[set[bytes]] = [set() for _ in range(num_replicas)]


class _Arrivals:
    """Replayed prompts (Prompt.arrival_s) not yet arrived, by due time; the stream admits each between
    steps once its time has come, and sleeps to the next one when nothing runs."""

    def __init__(self, start: float):
        self.start, self._heap, self._order = start, [], itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, prompts: list["Prompt"]) -> list["Prompt"]:
        """Keep the prompts that arrive later; return those due now (no arrival time, or already past)."""
        now = time.perf_counter()
        for prompt in prompts:
            if prompt.arrival_s is not None:
                heapq.heappush(self._heap, (self.start + prompt.arrival_s, next(self._order), prompt))
        return [p for p in prompts if p.arrival_s is None] + self.due(now)

    def due(self, now: float | None = None) -> list["Prompt"]:
        now = time.perf_counter() if now is None else now
        ready = []
        while self._heap and self._heap[0][0] <= now:
            ready.append(heapq.heappop(self._heap)[2])
        return ready

    def wait(self) -> None:
        time.sleep(max(0.0, self._heap[0][0] - time.perf_counter()))

    def time_of(self, prompt: "Prompt") -> float | None:
        return None if prompt.arrival_s is None else self.start + prompt.arrival_s


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
        scheduled = request.first_scheduled_time or finish
        first_token = request.first_token_time or finish
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


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One unit of work: token ids plus its sampling parameters. `index` orders the outputs.

    `identity` names the request stably across runs (a batch line's key); a request without its own
    seed derives one from it (or from `index` when it is None), so reruns draw the same tokens.
    """

    index: int
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first
    deadline_s: float | None = None  # seconds after submission by which it must start
    identity: str | None = None
    cache_salt: str | None = None  # prefix-cache pages are shared only between prompts with equal salts
    arrival_s: float | None = None  # replay: seconds after the stream starts at which it arrives (None: at once)

    def __post_init__(self):
        check_int("priority", self.priority, low=-(2**62), high=2**62)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise FieldError("cache_salt", f"must be a string, got {self.cache_salt!r}")
        if self.cache_salt is not None:
            check_text("cache_salt", self.cache_salt)
        if self.deadline_s is not None:
            object.__setattr__(self, "deadline_s", check_number("deadline_s", self.deadline_s, low=0.0, high=math.inf, low_open=True))
        if self.arrival_s is not None:
            object.__setattr__(self, "arrival_s", check_number("arrival_s", self.arrival_s, low=0.0, high=1e9))


def truncate_prompt(ids: list[int], max_context: int, max_tokens: int, side: str) -> list[int]:
    """Cut a prompt that does not fit the context; prompts that fit are never cut.

    A cut prompt keeps room for max_tokens of output, but at least half the context for itself. 'left'
    keeps the end of the prompt (the usual choice for chats), 'right' its start.
    """
    if side not in TRUNCATE_SIDES:
        raise FieldError("truncate", f"must be one of {TRUNCATE_SIDES}, got {side!r}")
    if len(ids) < max_context or side == "none":
        return ids
    keep = max_context - min(max_tokens, max_context // 2)
    return ids[-keep:] if side == "left" else ids[:keep]


class LLM:
    """A loaded model with a warmed-up paged engine.

    Args:
      model: a GGUF file, a Hugging Face folder, or None for the embedded SmolLM2-135M-Instruct.
      dtype: compute dtype: "auto" (the default: the runtime tuner measures float32 and bfloat16 on this
        machine and keeps the faster that passes its numerics check against float32, cached per machine;
        float32 with JAXINFER_TUNE=0), or "float32", "bfloat16", "float16", pinned (never changed).
        attention_impl and matmul_impl (EngineConfig fields, as keywords) left at "auto" are tuned too;
        `llm.choices` names what runs (tuning.Choice) and `llm.tuning` holds the tuner's table.
      quantization: how weights are held on the device: "auto" (the default: a GGUF file's blocks are kept
        where the tuner may multiply them W8A8 with the CPU quantized-matmul kernel, matmul_impl 'cpu_int8',
        and kept only if it measures that fastest; dense everywhere else, and with JAXINFER_TUNE=0), None
        (dense in `dtype`), "gguf" (a GGUF file's own blocks, dequantized one layer at a time inside the
        step, or read by that kernel), "int8" (per-channel) or "int4"
        (groups of `group_size` along the input: 32, the default, 64 or 128); see params.weight_format
        for which tensors.
      tensor_parallel: devices one model replica is sharded over (a `model` mesh, sharding.py): query and
        kv heads, MLP width and vocabulary split where they divide, replicated where they do not. 1 (the
        default) is one device with no mesh at all. The Pallas kernel runs on each device's own heads.
      data_parallel: model replicas, each on its own `tensor_parallel` devices with its own pool and
        scheduler; `route` assigns every request at admission by load (and prefix-cache affinity).
        Replicas step in turn in this one thread (no overlap between them yet).
      engine_config: an EngineConfig; keyword overrides of its fields may be passed instead or as well.
      parse_special: whether control-token text written in the input (e.g. "<|im_start|>") becomes the
        control token. None (the default): yes in plain prompts (as llama.cpp's `special=True`), never
        in chat message content, so a message cannot inject a role; False: never; True: in both.
      options: the fields above as one validated `LoadOptions` (what the CLI and the Ray actors pass).
    """

    def __init__(
        self, model=None, *, dtype: str = "auto", quantization: str | None = "auto", group_size: int | None = None,
        tensor_parallel: int = 1, data_parallel: int = 1, parse_special: bool | None = None, options: LoadOptions | None = None,
        engine_config: EngineConfig | None = None, warmup: bool = True, **engine_overrides,
    ):
        fields = dict(dtype=dtype, quantization=quantization, group_size=group_size, tensor_parallel=tensor_parallel, data_parallel=data_parallel, parse_special=parse_special)
        if options is not None and fields != dataclasses.asdict(LoadOptions()):
            raise FieldError("options", "replaces dtype, quantization, group_size, tensor_parallel, data_parallel and parse_special; pass one or the other")
        options = options or LoadOptions(**fields)
        engine_config = EngineConfig.with_overrides(engine_config, **engine_overrides)
        model_config, params = tuning.load_model(model, options, engine_config)
        self._start(model_config, params, tok.load_tokenizer(model), engine_config, options, warmup=warmup, dtype=options.dtype,
                    quantization=options.quantization)

    @classmethod
    def from_params(
        cls, model_config: ModelConfig, params: Params, tokenizer: tok.TextTokenizer, *, options: LoadOptions | None = None,
        engine_config: EngineConfig | None = None, warmup: bool = True, **engine_overrides,
    ) -> "LLM":
        """An LLM over a model already in memory (for experiments that build or transform params
        themselves); the same engines, checks and run loop as `LLM(path)`. `options` gives the
        parallel layout and parse_special (its dtype and quantization are the params' own: the dtype is
        pinned; attention_impl and matmul_impl left at "auto" are tuned)."""
        llm = cls.__new__(cls)
        llm._start(model_config, params, tokenizer, EngineConfig.with_overrides(engine_config, **engine_overrides), options or LoadOptions(),
                   warmup=warmup, quantization=None)
        return llm

    def _start(self, model_config, params, tokenizer, engine_config: EngineConfig, options: LoadOptions, *, warmup: bool, dtype: str | None = None,
               quantization: str | None = None) -> None:
        """`dtype`: the compute dtype asked for, "auto" (tuned) or pinned; None pins the params' own.
        `quantization`: what the params were loaded for (LoadOptions.quantization; None for params given as
        they are, whose quantized matrices are never made dense)."""
        pins = tuning.Pins(dtype or model_config.dtype, engine_config.attention_impl, engine_config.matmul_impl)
        self.tuning = tuning.choose_for_model(model_config, params, engine_config, pins, tokenizer=tokenizer, quantization=quantization, on_mesh=options.on_mesh)
        model_config, params, engine_config = tuning.apply_choice(self.tuning.choice, model_config, params, engine_config, quantization)
        self.model_config, self.tokenizer, self.engine_config, self.options = model_config, tokenizer, engine_config, options
        self.replicas: list[Replica] = [self._replica(r, params) for r in range(options.data_parallel)]
        self.engine, self.block_pool = self.replicas[0].engine, self.replicas[0].block_pool
        self.choices = dataclasses.replace(self.tuning.choice, attention_impl=self.engine.impl, matmul_impl=self.engine.matmul_impl)
        if warmup:
            for replica in self.replicas:
                replica.engine.warmup()
        self.last_stats = None
        self.replica_stats: list = []  # per replica, of the latest stream
        self.last_routes: list[int] = []  # replica of each prompt of the latest stream, in input order
        self._running = threading.Lock()  # one stream at a time: the replicas' pools are not shared safely

    def _replica(self, index: int, params: Params) -> Replica:
        mesh = None  # one device, no mesh: the programs of a plain engine
        if self.options.on_mesh:
            import jax

            tp = self.options.tensor_parallel
            mesh = sharding.make_mesh(tp, jax.devices()[index * tp : (index + 1) * tp])
        engine = Engine(self.model_config, params, self.engine_config, mesh=mesh)
        return Replica(engine, BlockPool(engine.num_pages))  # pools outlive each batch: cached prefixes persist

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (each replica gets an empty block pool), as vLLM's
        `LLM.reset_prefix_cache()`: the next batch computes every prompt page again. Benchmarks call it
        between timed repeats, so a repeat does not reuse the pages of the one before. Only between
        batches: the pages of a running batch are never dropped (generate/stream return when done)."""
        for replica in self.replicas:
            replica.block_pool = BlockPool(replica.engine.num_pages)
        self.block_pool = self.replicas[0].block_pool

    # ------------------------------------------------------------ the request boundary

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text or token ids -> token ids checked against the model's vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "is empty")
            return self.tokenizer.encode(check_text("prompt", prompt), parse_special=self.options.parse_special is not False)
        if not isinstance(prompt, Sequence):
            raise FieldError("prompt", f"must be text or a list of token ids, got {type(prompt).__name__}")
        return check_token_ids("prompt", prompt, self.model_config.vocab_size)

    def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True, continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation. Content may be a list of text parts; `chat_template_kwargs` reach
        the template (for example Qwen3's enable_thinking); `continue_final_message` (with
        add_generation_prompt false) ends the prompt inside the last message, for the model to continue."""
        messages = tok.normalize_messages(messages)
        tok.check_messages(messages)
        for i, message in enumerate(messages):
            check_text(f"messages[{i}].content", message["content"])
        check_bool("add_generation_prompt", add_generation_prompt)
        check_bool("continue_final_message", continue_final_message)
        variables = _template_kwargs(chat_template_kwargs)
        return self.tokenizer.encode_chat(
            messages, parse_special_content=bool(self.options.parse_special), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **variables,
        )

    def prepare(
        self, prompt, params: SamplingParams, *, index: int, chat: bool = False, truncate: str = "none", chat_options: dict | None = None, **request_fields,
    ) -> Prompt:
        """Validate one request and turn it into a Prompt; raises ValueError naming what is wrong.

        Args:
          prompt: text, token ids, or (with chat=True) a list of {'role', 'content'} messages.
          params: its sampling parameters.
          index: its position in the input; outputs carry it.
          truncate: 'none' (a prompt over the context is an error), 'left' or 'right' (see truncate_prompt).
          chat_options: encode_chat's add_generation_prompt, continue_final_message, chat_template_kwargs.
          request_fields: priority, deadline_s, identity (see Prompt).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        check_token_ids("logit_bias", [token for token, _ in params.logit_bias], self.model_config.vocab_size)
        check_token_ids("allowed_token_ids", params.allowed_token_ids or (), self.model_config.vocab_size)
        check_sampling_limits(self.engine_config, params)
        ids = self.encode_chat(prompt, **(chat_options or {})) if chat else self.encode(prompt)
        ids = truncate_prompt(ids, self.engine_config.max_context, params.max_tokens, truncate)
        check_request(self.engine_config, self.engine.num_pages, len(ids), params.max_tokens)
        return Prompt(index, ids, params, **request_fields)

    # ------------------------------------------------------------ running

    def stream(
        self, prompts: Iterable[Prompt], *, progress: bool | None = None, on_step: runloop.OnStep | None = None, max_inflight: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Run prepared prompts through the engine, yielding each output as soon as it finishes.

        `prompts` is consumed lazily (a generator works): at most `max_inflight` prompts are pulled
        ahead of the outputs yielded so far, so a job of any length holds a bounded number of requests.
        Default: every prompt of a sized input (a list) at once, so that priorities order the whole
        list; for any other iterable, 4 x max_num_seqs per replica (enough to keep every decode batch
        full while finished requests are replaced). A request's deadline and timings count from when
        it is pulled. `on_step(plan, tokens, seconds)` is called after every engine step (for timing
        and counting). One stream runs at a time: a second one, from another thread or while an
        earlier stream is left unfinished, raises RuntimeError at once.
        """
        total = len(prompts) if isinstance(prompts, Sized) else None
        if max_inflight is None:
            max_inflight = max(total, 1) if total is not None else _INFLIGHT_PER_SEQ * self.engine_config.max_num_seqs * len(self.replicas)
        max_inflight = check_int("max_inflight", max_inflight, low=1)
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating (in another thread, or an unfinished stream(): finish or close() it first)")
        try:
            yield from self._stream(iter(prompts), total=total, max_inflight=max_inflight, progress=progress, on_step=on_step)
        finally:
            self._running.release()

    def _stream(self, prompts: Iterator[Prompt], *, total: int | None, max_inflight: int, progress, on_step) -> Iterator[RequestOutput]:
        """Prompts are pulled in chunks that refill the in-flight set up to `max_inflight`; each goes to
        the replica `_route` picks (the one replica, without data parallelism). The replicas' run loops
        are advanced in turn, each output yielded as it finishes; a replica's loop that ran out of work
        is started again when new prompts reach it."""
        schedulers = [Scheduler(self.engine_config, r.engine.num_pages, block_pool=r.block_pool) for r in self.replicas]
        processors = [OutputProcessor(self._decode, self.tokenizer.eos_id, self.engine_config.max_context) for _ in self.replicas]
        self.last_routes = []
        routing = _RouteState(len(self.replicas))
        inflight, exhausted = 0, False
        show = progress if progress is not None else total is None or total >= _PROGRESS_MIN_REQUESTS
        bar = tqdm(total=total, unit="req", disable=not show)
        loops: dict[int, Iterator[Request]] = {}
        samples = _Samples()
        arrivals = _Arrivals(time.perf_counter())

        def submit(chunk: list[Prompt]) -> int:
            routes = self._route(chunk, routing)
            self.last_routes.extend(routes)
            return sum(len(self._submit(schedulers[i], [prompt], arrivals.time_of(prompt))) for prompt, i in zip(chunk, routes))  # n requests for n samples

        def admit() -> None:  # between steps: the prompts whose arrival time has come (a heap peek when none wait)
            nonlocal inflight
            if arrivals:
                inflight += submit(arrivals.due())

        try:
            while True:
                if not exhausted and inflight + len(arrivals) < max_inflight:
                    chunk = list(itertools.islice(prompts, max_inflight - inflight - len(arrivals)))
                    exhausted = len(chunk) < max_inflight - inflight - len(arrivals)
                    inflight += submit(arrivals.hold(chunk))
                for i, replica in enumerate(self.replicas):
                    if i not in loops and schedulers[i].has_work():
                        loops[i] = runloop.run(schedulers[i], replica.engine.step, processors[i], on_step=on_step, admit=admit)
                if not loops:
                    if not arrivals:
                        break
                    arrivals.wait()  # nothing runs until the next prompt arrives
                    admit()
                    continue
                for i in list(loops):
                    request = next(loops[i], None)
                    if request is None:
                        del loops[i]
                        continue
                    inflight -= 1
                    output = samples.add(self._output(request, processors[i].text(request)))
                    if output is not None:  # the prompt's last sample has finished
                        bar.update(1)
                        yield output
        finally:  # an interrupted or abandoned stream gives its pages back (cached ones stay named)
            for scheduler in schedulers:
                scheduler.abort_all("the run was stopped before this request finished")
            bar.close()
            self.replica_stats = [scheduler.stats for scheduler in schedulers]
            self.last_stats = self.replica_stats[0]

    def _route(self, prompts: list[Prompt], state: "_RouteState | None" = None) -> list[int]:
        """The replica of each prompt, by `replicas.route`: load plus what each replica caches of its
        prefix, counting the prefixes routed earlier in this stream. `state` carries the loads and the
        routed prefixes from one chunk of a stream to the next (None: a fresh one)."""
        if len(self.replicas) == 1:
            return [0] * len(prompts)
        state = state or _RouteState(len(self.replicas))
        page_size, caching = self.engine_config.page_size, self.engine_config.enable_prefix_caching
        loads, routed_pages = state.loads, state.routed_pages
        if sum(map(len, routed_pages)) > _MAX_ROUTED_PAGES:  # a long stream: what ran is in the pools' caches by now
            for pages in routed_pages:
                pages.clear()
        routes = []
        for prompt in prompts:
            names = page_hashes(prompt.token_ids, page_size, prompt.cache_salt) if caching else []
            states = []
            for i, replica in enumerate(self.replicas):
                cached = len(replica.block_pool.lookup(names))
                while cached < len(names) and names[cached] in routed_pages[i]:
                    cached += 1
                states.append(ReplicaLoad(loads[i], replica.block_pool.num_free, cached * page_size))
            i = route(states, len(prompt.token_ids), prompt.params.max_tokens)
            loads[i] += len(prompt.token_ids) - states[i].cached_tokens + prompt.params.max_tokens
            routed_pages[i].update(names)
            routes.append(i)
        return routes

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)

    def _submit(self, scheduler: Scheduler, prompts: list[Prompt], arrival: float | None = None) -> list[Request]:
        """One request per sample: n of a prompt share its prompt pages (the later ones wait for the
        first's prefill, scheduler._prompt_shared); sample i > 0 draws from a seed derived from the
        prompt's and i, so each sample is reproducible on its own and sample 0 is the n = 1 output.
        `arrival`: when they arrived (perf_counter; a replayed prompt's due time), else now."""
        now = time.perf_counter() if arrival is None else arrival
        requests = []
        for prompt in prompts:
            deadline = None if prompt.deadline_s is None else now + prompt.deadline_s
            identity = f"index:{prompt.index}" if prompt.identity is None else prompt.identity
            seed = prompt.params.seed if prompt.params.seed is not None else derive_seed(self.engine_config.seed, identity)
            first = None
            for sample in range(prompt.params.n):
                request = Request(
                    str(prompt.index) if sample == 0 else f"{prompt.index}:{sample}", prompt.token_ids, prompt.params,
                    seed if sample == 0 else derive_seed(seed, f"sample:{sample}"), priority=prompt.priority,
                    deadline=deadline, arrival_index=prompt.index, arrival_time=now, cache_salt=prompt.cache_salt,
                    eos_id=self.tokenizer.eos_id, guide=self._guides.guide(prompt.params),
                    fork_of=first, sample_index=sample,
                )
                first = first or request
                scheduler.add(request)
                requests.append(request)
        return requests

    @functools.cached_property
    def _guides(self) -> guided.Guides:
        """llguidance's tokenizer, built on the first constrained request (about a second)."""
        return guided.Guides(self.tokenizer, self.model_config.vocab_size)

    def _output(self, request: Request, text: str) -> RequestOutput:
        return RequestOutput(
            index=request.arrival_index,
            text=text,
            token_ids=list(request.output_ids),
            finish_reason=request.finish_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_generated_tokens=len(request.output_ids),
            time_to_first_token=(request.first_token_time or request.finish_time) - request.arrival_time,
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
        )

    def start_profile(self, directory) -> None:
        """Start a jax.profiler trace of what runs until stop_profile(), written under `directory` (TensorBoard, Perfetto)."""
        profiling.start(directory)

    def stop_profile(self) -> None:
        profiling.stop()

    def token_text(self, token_id: int) -> str:
        """One token's text, as a logprobs listing names it (special tokens included)."""
        return self.tokenizer.decode([token_id])

    def generate(
        self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, progress: bool | None = None,
        on_step: runloop.OnStep | None = None, arrival_times: Sequence[float] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one RequestOutput per prompt, in input order.

        Every prompt is checked before any work starts; a bad one raises ValueError naming its index.
        `arrival_times` replays arrivals: prompt i is admitted `arrival_times[i]` seconds after the start
        (between steps), and its timings (RequestOutput.metrics) count from then; traces.replay drives it
        from a trace and reports TTFT, TPOT and goodput.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._generate(list(prompts), sampling_params, chat=False, progress=progress, on_step=on_step, arrival_times=arrival_times)

    def chat(
        self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, progress: bool | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role', 'content'}) or a list of them; the
        chat options are encode_chat's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs}
        return self._generate(conversations, sampling_params, chat=True, progress=progress, chat_options=options)

    def _generate(self, prompts: list, sampling_params, *, chat: bool, progress, on_step=None, chat_options: dict | None = None, arrival_times=None) -> list[RequestOutput]:
        params = _broadcast_params(sampling_params, len(prompts))
        if arrival_times is not None and len(arrival_times) != len(prompts):
            raise ValueError(f"arrival_times holds {len(arrival_times)} times for {len(prompts)} prompts")
        arrivals = [None] * len(prompts) if arrival_times is None else [float(t) for t in arrival_times]
        work = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                work.append(self.prepare(prompt, sp, index=i, chat=chat, chat_options=chat_options, arrival_s=arrivals[i]))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return sorted(self.stream(work, progress=progress, on_step=on_step), key=lambda o: o.index)


_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "continue_final_message")


def _template_kwargs(value) -> dict:
    """chat_template_kwargs: a dict of template variables, none of them a name the template is given anyway."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise FieldError("chat_template_kwargs", f"must be an object of template variable names to values, got {value!r}")
    reserved = sorted(set(value) & set(_TEMPLATE_NAMES))
    if reserved:
        raise FieldError("chat_template_kwargs", f"cannot set {reserved}: give them as their own fields")
    return value


class _Samples:
    """Holds a prompt's samples until all n have finished; `add` returns the prompt's output then."""

    def __init__(self):
        self._waiting: dict[int, list[RequestOutput]] = {}

    def add(self, output: RequestOutput) -> RequestOutput | None:
        if output.num_samples == 1:
            return output
        done = self._waiting.setdefault(output.index, [])
        done.append(output)
        if len(done) < output.num_samples:
            return None
        ordered = sorted(self._waiting.pop(output.index), key=lambda o: o.sample_index)
        return dataclasses.replace(ordered[0], samples=ordered)


def _prompt_logprobs(request: Request) -> list | None:
    """Its prompt log-probabilities, one entry per prompt token (None for the first, and for any a failed
    request never reached)."""
    if request.params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs) or [None] * len(request.prompt_ids)


def _broadcast_params(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
