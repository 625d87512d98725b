"""`LLM(...).generate(prompts, SamplingParams(...))` for notebooks and scripts.

`LLM` joins the tokenizer (text in and out), the host Scheduler (what runs each step), the Engine
(compiled programs over the donated pool) and the OutputProcessor (when a request is done, and its
text) through the one run loop, `runloop.run`. `prepare` is the request boundary that the API and the
batch reader share: it encodes, truncates on request, and checks token ids against the vocabulary and
the request against the engine's limits, raising a `ValueError` that names the problem. `stream()`
yields each request's output as soon as it finishes, which the batch CLI writes at once; `generate()`
collects them back into input order. With data parallelism each replica (`Replica`: an engine and its
block pool) has its own scheduler, and scheduling/replicas.py's `Router` picks each request's replica.
Owns: LLM and one stream's state (`_StreamRun`). What a request gives back is outputs.py's (`RequestOutput`);
`Prompt` and `truncate_prompt` are scheduling/request.py's (both re-exported here).
"""

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence, Sized

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import INFLIGHT_PER_SEQ, EngineConfig, ModelConfig
from jaxinfer.engine import profiling, tuning
from jaxinfer.engine.engine import Engine
from jaxinfer.loading import loading, tokenizer as tok
from jaxinfer.loading.tokenizer import MissingTokenizer
from jaxinfer.model import sharding
from jaxinfer.model.params import Params
from jaxinfer.options import LoadOptions
from jaxinfer.outputs import RequestOutput, Samples, output_of
from jaxinfer.scheduling import guided, runloop
from jaxinfer.scheduling.arrivals import Arrivals
from jaxinfer.scheduling.block_pool import BlockPool
from jaxinfer.scheduling.kv_manager import page_release_window
from jaxinfer.scheduling.replicas import Router
from jaxinfer.scheduling.request import Prompt, Request, SamplingParams, derive_seed, truncate_prompt
from jaxinfer.scheduling.scheduler import Scheduler, check_request, check_sampling_limits
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.validation import FieldError, check_bool, check_int, check_text, check_token_ids

__all__ = ["LLM", "Prompt", "Replica", "RequestOutput", "truncate_prompt"]  # Prompt, RequestOutput, truncate_prompt: re-exported

_PROGRESS_MIN_REQUESTS = 8  # show a progress bar for jobs at least this large
_TRUNCATE_MARGIN = 64  # tokens past the ones kept that a cut text prompt must still give (a cut changes only the last few)


class _TuningBar:
    """The tuner's progress (a bar counting its measurements, total unknown beforehand), opened at its first
    measurement: a cached or fixed choice measures nothing and shows no bar."""

    def __init__(self, show: bool):
        self.show, self.bar = show, None

    def update(self, measurement) -> None:
        if self.show and self.bar is None:
            self.bar = tqdm(desc="tuning on this machine (cached for later starts)", unit="measurement", leave=False)
        if self.bar is not None:
            self.bar.update(1)

    def __enter__(self) -> "_TuningBar":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class Replica:
    """One model replica: an engine on its own devices and the block pool of its KV pool."""

    engine: Engine
    block_pool: BlockPool


class LLM:
    """A loaded model with a warmed-up paged engine.

    Args:
      model: a GGUF file, a Hugging Face folder, or None for the embedded SmolLM2-135M-Instruct.
      dtype: compute dtype: "auto" (the default: the runtime tuner measures float32 and bfloat16 on this
        machine and keeps the faster that passes its numerics check against float32, cached per machine;
        float32 with JAXINFER_TUNE=0), or "float32", "bfloat16", "float16", pinned (never changed).
        attention_impl and matmul_impl (EngineConfig fields, as keywords) left at "auto" are tuned too;
        `llm.choices` names what runs (backends.Impls) and `llm.tuning` holds the tuner's table.
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
      warmup: compile every program now (False: call `warmup()` before the first request).
      progress: progress bars on stderr while a first start on this machine tunes (its measurements counted) and while
        warm-up compiles and times the programs (each bar with its total) (False: none).
    """

    def __init__(
        self, model=None, *, dtype: str = "auto", quantization: str | None = "auto", group_size: int | None = None,
        tensor_parallel: int = 1, data_parallel: int = 1, parse_special: bool | None = None, options: LoadOptions | None = None,
        engine_config: EngineConfig | None = None, warmup: bool = True, progress: bool = True, **engine_overrides,
    ):
        fields = dict(dtype=dtype, quantization=quantization, group_size=group_size, tensor_parallel=tensor_parallel, data_parallel=data_parallel, parse_special=parse_special)
        if options is not None and fields != dataclasses.asdict(LoadOptions()):
            raise FieldError("options", "replaces dtype, quantization, group_size, tensor_parallel, data_parallel and parse_special; pass one or the other")
        options = options or LoadOptions(**fields)
        engine_config = EngineConfig.with_overrides(engine_config, **engine_overrides)
        tokenizer = tok.tokenizer_or_missing(model)  # before the weights: a tokenizer that cannot load fails at once
        model_config, params = loading.load_for_engine(model, options, engine_config)
        self._start(model_config, params, tokenizer, engine_config, options, warmup=warmup, dtype=options.dtype,
                    quantization=options.quantization, progress=progress)

    @classmethod
    def from_params(
        cls, model_config: ModelConfig, params: Params, tokenizer: tok.TextTokenizer, *, options: LoadOptions | None = None,
        engine_config: EngineConfig | None = None, warmup: bool = True, progress: bool = True, **engine_overrides,
    ) -> "LLM":
        """An LLM over a model already in memory (for experiments that build or transform params
        themselves); the same engines, checks and run loop as `LLM(path)`. `options` gives the
        parallel layout and parse_special (its dtype and quantization are the params' own: the dtype is
        pinned; attention_impl and matmul_impl left at "auto" are tuned). `warmup`, `progress`: as LLM's."""
        llm = cls.__new__(cls)
        llm._start(model_config, params, tokenizer, EngineConfig.with_overrides(engine_config, **engine_overrides), options or LoadOptions(),
                   warmup=warmup, quantization=None, progress=progress)
        return llm

    def _start(self, model_config, params, tokenizer, engine_config: EngineConfig, options: LoadOptions, *, warmup: bool, dtype: str | None = None,
               quantization: str | None = None, progress: bool = True) -> None:
        """`dtype`: the compute dtype asked for, "auto" (tuned) or pinned; None pins the params' own.
        `quantization`: what the params were loaded for (LoadOptions.quantization; None for params given as
        they are, whose quantized matrices are never made dense)."""
        pins = tuning.Impls(dtype or model_config.dtype, engine_config.attention_impl, engine_config.matmul_impl)
        with _TuningBar(progress) as bar:
            self.tuning = tuning.choose_for_model(model_config, params, engine_config, pins, tokenizer=None if isinstance(tokenizer, MissingTokenizer) else tokenizer,
                                                  quantization=quantization, on_mesh=options.on_mesh, progress=bar.update)
        model_config, params, engine_config = tuning.apply_choice(self.tuning.choice, model_config, params, engine_config, quantization)
        if engine_config.release_window != page_release_window(model_config):  # a windowed model hands pages back (kv_manager)
            engine_config = EngineConfig.with_overrides(engine_config, release_window=page_release_window(model_config))
        self.model_config, self.tokenizer, self.engine_config, self.options = model_config, tokenizer, engine_config, options
        self.replicas: list[Replica] = [self._replica(r, params) for r in range(options.data_parallel)]
        self.engine, self.block_pool = self.replicas[0].engine, self.replicas[0].block_pool
        self.choices = dataclasses.replace(self.tuning.choice, attention_impl=self.engine.impl, matmul_impl=self.engine.matmul_impl)
        if warmup:
            self.warmup(progress)
        self.last_stats = None
        self.replica_stats: list = []  # per replica, of the latest stream
        self.last_routes: list[int] = []  # replica of each prompt of the latest stream, in input order
        self._running = threading.Lock()  # one stream at a time: the replicas' pools are not shared safely

    def warmup(self, progress: bool = True) -> None:
        """Compile every replica's programs and time those its step-cost table lacks, as `LLM(...)` does unless
        warmup=False; programs already compiled are kept. `progress`: a bar per phase with work, with its total."""
        bars = functools.partial(tqdm, unit="program", leave=False, disable=not progress)
        for replica in self.replicas:
            replica.engine.warmup(bars)

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

    @property
    def params(self) -> Params:
        """The weights as the engine holds them (cast, quantized, on the mesh): what `update_params` takes and
        `jaxinfer.logprobs` reads; `model_config` is their config."""
        return self.engine.params

    @property
    def weight_version(self) -> int:
        """`update_params` calls so far; every RequestOutput carries the version it was generated with."""
        return self.engine.weight_version

    def update_params(self, params: Params) -> int:
        """Swap the weights in place (same tree, shapes, dtypes): no compile, the tuner's choice and the pool
        kept, the prefix cache dropped; returns the new weight_version (engine/weights.py, docs/research.md)."""
        from jaxinfer.engine import weights  # noqa: PLC0415

        return weights.update_llm(self, params)

    def step_costs(self):
        """The step-cost table (scheduling/step_costs.py's StepCosts) of replica 0: seconds per program key, timed at
        warm-up and refined by every step since, and the host's seconds per step; what the simulator prices plans with."""
        return self.engine.step_costs

    # ------------------------------------------------------------ the request boundary

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text or token ids -> token ids checked against the model's vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "is empty")
            return self.tokenizer.encode(check_text("prompt", prompt), parse_special=self.options.parse_special is not False)
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
                raise FieldError("prompt", f"must be text or token ids (a list of ints or a 1-D integer array), got a {prompt.ndim}-D {prompt.dtype} array")
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):  # bytes are a sequence of ints, not token ids
            raise FieldError("prompt", f"must be text or a list of token ids, got {type(prompt).__name__}" + (": decode it to str" if isinstance(prompt, (bytes, bytearray)) else ""))
        return check_token_ids("prompt", prompt, self.model_config.vocab_size)

    def _encode_to_cut(self, text: str, side: str) -> list[int]:
        """`encode(text)` for truncate_prompt to cut on `side`, tokenizing only the part of a long text it can
        keep: its start ('right') or its end ('left'), `limit` characters at most (max_context +
        _TRUNCATE_MARGIN tokens, at max_token_chars characters a token at most), cut at a space between two
        words in the half of the part farther from the tokens kept. The pre-tokenizer splits there, so the
        part's tokens are the whole text's up to that word (a cut inside a word could change all its tokens:
        a run of one letter is chunked from the word's start). Without such a space, or when the part gives
        fewer than max_context + _TRUNCATE_MARGIN tokens (a normalizer that shrinks text), the whole text is
        tokenized."""
        check_text("prompt", text)  # the whole of it, as encode would
        need = self.engine_config.max_context + _TRUNCATE_MARGIN
        limit = need * self.tokenizer.max_token_chars
        if len(text) > limit:
            start = len(text) - limit
            cut = _word_gap(text, limit // 2, limit, last=True) if side == "right" else _word_gap(text, start, start + limit // 2, last=False)
            if cut is not None:
                ids = self.encode(text[:cut] if side == "right" else text[cut:])
                if len(ids) >= need:
                    return ids
        return self.encode(text)

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
        self._check_params(params)
        if chat:
            ids = self.encode_chat(prompt, **(chat_options or {}))
        elif isinstance(prompt, str) and truncate in ("left", "right"):
            ids = self._encode_to_cut(prompt, truncate)
        else:
            ids = self.encode(prompt)
        if chat or isinstance(prompt, str):  # the tokenizer's ids: one past the embedding's rows would read another row
            try:
                self._check_ids("prompt", ids)
            except FieldError as e:
                raise FieldError("prompt", f"was tokenized to an id outside the model's vocabulary (a tokenizer that does not match the weights?): {e}") from None
        ids = truncate_prompt(ids, self.engine_config.max_context, params.max_tokens, truncate)
        check_request(self.engine_config, self.engine.num_pages, len(ids), params.max_tokens)
        return Prompt(index, ids, params, **request_fields)

    def _check_params(self, params: SamplingParams) -> None:
        """Sampling parameters this model and engine can run: its token ids in the vocabulary, its logprobs and n within
        the engine's limits; TypeError or ValueError naming the field."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        check_token_ids("logit_bias", [token for token, _ in params.logit_bias], self.model_config.vocab_size)
        check_token_ids("allowed_token_ids", params.allowed_token_ids or (), self.model_config.vocab_size)
        check_sampling_limits(self.engine_config, params)
        if isinstance(self.tokenizer, MissingTokenizer):  # its outputs have no text to stop at, ban or constrain
            for name in ("stop", "bad_words", "structured_outputs"):
                if getattr(params, name):
                    raise FieldError(name, f"needs text: {self.tokenizer.error}")

    def _check_ids(self, field: str, token_ids) -> None:
        """Token ids in this model's vocabulary: a fast pass over a list of ints; anything else (a bool, a numpy int, an id
        out of range) goes through check_token_ids, which names the first bad one."""
        ids = np.asarray(token_ids) if isinstance(token_ids, list) and set(map(type, token_ids)) <= {int} else None
        if ids is None or ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.model_config.vocab_size)):
            check_token_ids(field, token_ids, self.model_config.vocab_size)

    def _checked(self, prompt) -> Prompt:
        """An item stream() pulled: a Prompt (as LLM.prepare makes; one built by hand is checked as prepare checks it),
        else TypeError; ValueError naming its index for a token id outside the vocabulary or a parameter over a limit."""
        if not isinstance(prompt, Prompt):
            raise TypeError(f"LLM.stream takes Prompts, as LLM.prepare makes them (LLM.generate takes texts and token ids), not a {type(prompt).__name__}")
        try:
            self._check_ids("token_ids", prompt.token_ids)
            self._check_params(prompt.params)
            check_request(self.engine_config, self.engine.num_pages, len(prompt.token_ids), prompt.params.max_tokens)
        except TypeError as e:
            raise TypeError(f"prompt {prompt.index}: {e}") from None
        except ValueError as e:
            raise ValueError(f"prompt {prompt.index}: {e}") from None
        return prompt

    # ------------------------------------------------------------ running

    def stream(
        self, prompts: Iterable[Prompt], *, progress: bool | None = None, on_step: runloop.OnStep | None = None, max_inflight: int | None = None,
        total: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Run prepared prompts through the engine, yielding each output as soon as it finishes.

        `prompts` is consumed lazily (a generator works): at most `max_inflight` prompts are pulled
        ahead of the outputs yielded so far, so a job of any length holds a bounded number of requests.
        Default: every prompt of a sized input (a list) at once, so that priorities order the whole
        list; for any other iterable, 4 x max_num_seqs per replica (enough to keep every decode batch
        full while finished requests are replaced). A request's deadline and timings count from when
        it is pulled. `on_step(plan, tokens, seconds)` is called after every engine step (for timing
        and counting). One stream runs at a time: a second one, from another thread or while an
        earlier stream is left unfinished, raises RuntimeError at once. `total`: the prompts expected, for
        the progress bar only (default: the length of a sized input; a lazy input's caller may know it).
        """
        size = len(prompts) if isinstance(prompts, Sized) else None
        if max_inflight is None:
            max_inflight = max(size, 1) if size is not None else INFLIGHT_PER_SEQ * self.engine_config.max_num_seqs * len(self.replicas)
        max_inflight = check_int("max_inflight", max_inflight, low=1)
        total = size if total is None else check_int("total", total, low=0)
        if not self._running.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating (in another thread, or an unfinished stream(): finish or close() it first)")
        try:
            yield from self._stream(iter(prompts), total=total, max_inflight=max_inflight, progress=progress, on_step=on_step)
        finally:
            self._running.release()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)

    def _stream(self, prompts: Iterator[Prompt], *, total: int | None, max_inflight: int, progress, on_step) -> Iterator[RequestOutput]:
        """Prompts are pulled in chunks that refill the in-flight set up to `max_inflight`; each goes to
        the replica the router picks (the one replica, without data parallelism). The replicas' run loops
        are advanced in turn, each output yielded as it finishes; a replica's loop that ran out of work
        is started again when new prompts reach it."""
        run = _StreamRun(self, on_step)
        self.last_routes, self.stream_run = run.routes, run  # stream_run: a bucket refit (batch/refit.py) swaps its schedulers' tables
        show = progress if progress is not None else total is None or total >= _PROGRESS_MIN_REQUESTS
        bar = tqdm(total=total, unit="req", disable=not show)
        try:
            while True:
                run.refill(prompts, max_inflight)
                if not run.start_loops():
                    if not run.arrivals:
                        break
                    run.arrivals.wait()  # nothing runs until the next prompt arrives
                    run.admit()
                    continue
                for output in run.advance():
                    bar.update(1)
                    yield output
        finally:  # an interrupted or abandoned stream gives its pages back (cached ones stay named)
            self.replica_stats = run.close()
            self.last_stats = self.replica_stats[0]
            bar.close()

    def _requests(self, prompt: Prompt, arrival: float | None = None) -> list[Request]:
        """One request per sample: n of a prompt share its prompt pages (the later ones wait for the
        first's prefill, scheduler._prompt_shared); sample i > 0 draws from a seed derived from the
        prompt's and i, so each sample is reproducible on its own and sample 0 is the n = 1 output.
        `arrival`: when it arrived (perf_counter; a replayed prompt's due time), else now."""
        now = time.perf_counter() if arrival is None else arrival
        deadline = None if prompt.deadline_s is None else now + prompt.deadline_s
        identity = f"index:{prompt.index}" if prompt.identity is None else prompt.identity
        seed = prompt.params.seed if prompt.params.seed is not None else derive_seed(self.engine_config.seed, identity)
        requests: list[Request] = []
        for sample in range(prompt.params.n):
            requests.append(Request(
                str(prompt.index) if sample == 0 else f"{prompt.index}:{sample}", prompt.token_ids, prompt.params,
                seed if sample == 0 else derive_seed(seed, f"sample:{sample}"), priority=prompt.priority,
                deadline=deadline, arrival_index=prompt.index, arrival_time=now, cache_salt=prompt.cache_salt,
                eos_id=self.tokenizer.eos_id, **self._guides.request_fields(prompt.params, prompt.token_ids),
                fork_of=requests[0] if requests else None, sample_index=sample,
            ))
        return requests

    @functools.cached_property
    def _guides(self) -> guided.Guides:
        """llguidance's tokenizer, built on the first constrained request (about a second)."""
        return guided.Guides(self.tokenizer, self.model_config.vocab_size)

    def start_profile(self, directory) -> None:
        """Start a jax.profiler trace of what runs until stop_profile(), written under `directory` (TensorBoard, Perfetto)."""
        profiling.start(directory)

    def stop_profile(self) -> None:
        profiling.stop()

    def embed(self, prompts, *, pooling: str = "last", normalize: bool = True) -> list:
        """One embedding per prompt (text or token ids), in input order: the final hidden states pooled
        ("last" token or "mean"), L2-normalized by default; jaxinfer/embedding.py's EmbeddingOutput."""
        from jaxinfer import embedding  # noqa: PLC0415  (jax programs of its own, built on first use)

        return embedding.embed(self, _prompt_list(prompts), pooling=pooling, normalize=normalize)

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
        return self._generate(_prompt_list(prompts), sampling_params, chat=False, progress=progress, on_step=on_step, arrival_times=arrival_times)

    def score(self, context, continuations, *, on_step: runloop.OnStep | None = None, progress: bool | None = False) -> list:
        """log P(continuation | context) per continuation (texts or token ids): scoring.ScoreResult each, with
        `logprob` and `token_logprobs`; the context is prefilled once, shared through the prefix cache."""
        from jaxinfer import scoring  # noqa: PLC0415  (scoring sits on LLM)

        return scoring.score(self, context, continuations, on_step=on_step, progress=progress)

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
            except TypeError as e:
                raise TypeError(f"prompt {i}: {e}") from None
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return sorted(self.stream(work, progress=progress, on_step=on_step), key=lambda o: o.index)


class _StreamRun:
    """One stream's state over the replicas: a scheduler and an output processor per replica, the router,
    the prompts in flight and those not yet arrived, the run loops under way, and samples not yet merged."""

    def __init__(self, llm: LLM, on_step: runloop.OnStep | None):
        cfg = llm.engine_config
        self.llm, self.on_step = llm, on_step
        self.schedulers = [Scheduler(cfg, r.engine.num_pages, block_pool=r.block_pool) for r in llm.replicas]
        self.processors = [OutputProcessor(llm._decode, llm.tokenizer.eos_id, cfg.max_context) for _ in llm.replicas]
        self.router = Router([r.block_pool for r in llm.replicas], page_size=cfg.page_size, enable_prefix_caching=cfg.enable_prefix_caching)
        self.arrivals = Arrivals(time.perf_counter())
        self.samples = Samples()
        self.loops: dict[int, Iterator[Request]] = {}  # replica -> its run loop, while it has work
        self.routes: list[int] = []  # replica of each prompt, in submission order
        self.inflight = 0  # requests submitted and not yet finished
        self.exhausted = False  # the input has no more prompts

    def refill(self, prompts: Iterator[Prompt], max_inflight: int) -> None:
        """Pull prompts until `max_inflight` are in flight or held for their arrival; submit those due."""
        room = max_inflight - self.inflight - len(self.arrivals)
        if self.exhausted or room <= 0:
            return
        chunk = [self.llm._checked(prompt) for prompt in itertools.islice(prompts, room)]
        self.exhausted = len(chunk) < room
        self.submit(self.arrivals.hold(chunk))

    def submit(self, prompts: list[Prompt]) -> None:
        """Each prompt's n requests go to the replica the router picks for its first."""
        groups = [self.llm._requests(prompt, self.arrivals.time_of(prompt)) for prompt in prompts]
        routes = self.router.assign([group[0] for group in groups])
        for group, replica in zip(groups, routes):
            for request in group:
                self.schedulers[replica].add(request)
        self.routes.extend(routes)
        self.inflight += sum(map(len, groups))

    def admit(self) -> None:
        """Between steps: the prompts whose arrival time has come (a heap peek when none wait)."""
        if self.arrivals:
            self.submit(self.arrivals.due())

    def start_loops(self) -> bool:
        """Start the run loop of each replica that has work and no loop; whether any loop runs."""
        for i, replica in enumerate(self.llm.replicas):
            if i not in self.loops and self.schedulers[i].has_work():
                self.loops[i] = runloop.run(self.schedulers[i], replica.engine.step, self.processors[i], on_step=self.on_step, admit=self.admit)
        return bool(self.loops)

    def advance(self) -> Iterator[RequestOutput]:
        """Advance each loop by one finished request; yield the output of each prompt whose last sample it was."""
        for i in list(self.loops):
            request = next(self.loops[i], None)
            if request is None:
                del self.loops[i]
                continue
            self.inflight -= 1
            output = self.samples.add(output_of(request, self.processors[i].text(request), weight_version=self.llm.replicas[i].engine.weight_version))
            if output is not None:
                yield output

    def close(self) -> list:
        """Abort what is left (its pages come back; cached ones stay named); the schedulers' stats."""
        for scheduler in self.schedulers:
            scheduler.abort_all("the run was stopped before this request finished")
        return [scheduler.stats for scheduler in self.schedulers]


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


def _word_gap(text: str, lo: int, hi: int, *, last: bool) -> int | None:
    """The last (or first) i in [lo, hi) where text[i] is a space between two characters that are not
    whitespace: every pre-tokenizer splits a text there (byte-level regexes, SentencePiece's `▁`); None if none."""
    i = text.rfind(" ", lo, hi) if last else text.find(" ", lo, hi)
    while i != -1:
        if 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i) if last else text.find(" ", i + 1, hi)
    return None


def _prompt_list(prompts) -> list:
    """generate's prompts as a list: one text, or one prompt's token ids (ints, numpy ints, a 1-D integer
    array), is one prompt; a 2-D array is a prompt per row; any other iterable is a prompt per item."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim > 2:
            raise FieldError("prompts", f"must be text, token ids or a list of them, got a {prompts.ndim}-D array")
        return [prompts] if prompts.ndim <= 1 else list(prompts)
    if isinstance(prompts, (str, bytes, bytearray)):  # bytes: one prompt, which encode refuses
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], (int, np.integer)):
        return [prompts]
    return prompts


def _broadcast_params(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
