"""User-facing request types: `SamplingParams` (validated where built), `Prompt` (one prepared unit of
work, and `truncate_prompt`), `Request` (host state of one request) and the derived seed; no jax.

`SamplingParams` is what a user passes per prompt, from Python or from a JSONL line. It checks every
field where it is built (validation.py: type, range, finiteness) and names the field in its errors
(`FieldError`), so the API, the batch reader and the CLI share one set of rules. It never reaches a
traced function as Python values: `StepPlan.build` (plan.py) packs each step's parameters into arrays,
so a new temperature or seed never triggers a compile.
"""

import dataclasses
import hashlib
import math

import numpy as np

from jaxinfer.scheduling import guided
from jaxinfer.validation import (
    FieldError, check_bool, check_int, check_logit_bias, check_number, check_stop_strings, check_stop_token_ids, check_text,
    check_token_list, unknown_field_error,
)

TRUNCATE_SIDES = ("none", "left", "right")  # what a prompt over the context does: an error, or cut (truncate_prompt)
MAX_SEED = 2**31  # seeds are int32 on the device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on the device
MAX_N = 1024  # samples per prompt at most


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Defaults follow vLLM, except max_tokens."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None  # None: derived from the engine seed and the request's identity; any 64-bit integer (device_seed)
    max_tokens: int = 128  # generated tokens at most; 0 (with prompt_logprobs) scores the prompt and generates nothing
    stop_token_ids: tuple[int, ...] = ()  # finish when one of these is generated (it is kept in the output)
    stop: tuple[str, ...] = ()  # finish when the text contains one of these (the text is cut before it)
    ignore_eos: bool = False  # keep going past the end-of-sequence token
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings not looked for, until this many tokens are generated
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far (vLLM, OpenAI)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: divided if > 0, multiplied if < 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit; a dict is accepted
    logprobs: int | None = None  # per generated token: its log-probability and the top `logprobs` (0: its own only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (scoring)
    # With prompt_logprobs: the first prompt token scored (0 and 1: every token after the first). Only the
    # positions from logprob_start - 1 need logits, so the prefix cache may serve the tokens before them.
    logprob_start: int = 0
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    n: int = 1  # samples of the prompt; they share its KV pages (computed once), sample i seeded from i
    # A grammar the output must follow (guided.py): {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": Lark/GBNF}
    structured_outputs: tuple[str, str] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated (None: any)
    bad_words: tuple[str, ...] = ()  # never generated: a word's last token is banned where its other tokens end the output
    # A model that thinks (reasoning.py): tokens inside its thinking block after which the close tag is forced (None: no limit)
    thinking_budget: int | None = None
    # An embedding (LLM.embed): the prompt's final hidden states (after the final norm) pooled, "last" token
    # or "mean" over the prompt, kept in Request.pooled; it generates nothing (max_tokens 0). None: no embedding.
    pooling: str | None = None

    def __post_init__(self):
        checked = {
            "temperature": check_number("temperature", self.temperature, low=0.0, high=math.inf),
            "top_k": check_int("top_k", self.top_k, low=0, high=MAX_TOP_K),
            "top_p": check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True),
            "seed": None if self.seed is None else device_seed(self.seed),
            "max_tokens": check_int("max_tokens", self.max_tokens, low=0 if self.prompt_logprobs is not None or self.pooling is not None else 1),
            "stop_token_ids": check_stop_token_ids(self.stop_token_ids),
            "stop": check_stop_strings(self.stop),
            "ignore_eos": check_bool("ignore_eos", self.ignore_eos),
            "min_tokens": check_int("min_tokens", self.min_tokens, low=0),
            "min_p": check_number("min_p", self.min_p, low=0.0, high=1.0),
            "presence_penalty": check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0),
            "frequency_penalty": check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0),
            "repetition_penalty": check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=math.inf, low_open=True),
            "logit_bias": check_logit_bias(self.logit_bias),
            "logprobs": None if self.logprobs is None else check_int("logprobs", self.logprobs, low=0),
            "prompt_logprobs": None if self.prompt_logprobs is None else check_int("prompt_logprobs", self.prompt_logprobs, low=0),
            "logprob_start": check_int("logprob_start", self.logprob_start, low=0),
            "include_stop_str_in_output": check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
            "structured_outputs": guided.check_spec(self.structured_outputs),
            "allowed_token_ids": None if self.allowed_token_ids is None else check_token_list("allowed_token_ids", self.allowed_token_ids, nonempty=True),
            "bad_words": check_stop_strings(self.bad_words, "bad_words"),
            "thinking_budget": None if self.thinking_budget is None else check_int("thinking_budget", self.thinking_budget, low=0),
            "pooling": _check_pooling(self.pooling, self.max_tokens),
        }
        checked["n"] = check_int("n", self.n, low=1, high=MAX_N)
        if checked["n"] > 1 and checked["temperature"] == 0:
            raise FieldError("n", f"({checked['n']}) with greedy sampling (temperature 0) gives {checked['n']} identical outputs; set a temperature > 0")
        if checked["n"] > 1 and checked["pooling"] is not None:
            raise FieldError("n", f"({checked['n']}) with pooling: an embedding samples nothing, so its {checked['n']} copies would be identical; use n=1")
        if checked["logprob_start"] and checked["prompt_logprobs"] is None:
            raise FieldError("logprob_start", f"({checked['logprob_start']}) applies to prompt_logprobs, which is not set")
        if checked["min_tokens"] > checked["max_tokens"]:
            raise FieldError("min_tokens", f"({checked['min_tokens']}) exceeds max_tokens ({checked['max_tokens']})")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_fields(cls, fields: dict, defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """Build from a dict of field values (a JSONL line) over `defaults`; unknown names are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = resolve_aliases(fields)
        for name in fields:
            if name not in names:
                raise unknown_field_error(name, names | SAMPLING_ALIASES.keys())
        return dataclasses.replace(defaults or cls(), **fields)

    @property
    def needs_processing(self) -> bool:
        """Whether its logits change before sampling (penalties, bias, min_p, min_tokens)."""
        return bool(self.min_tokens or self.min_p or self.presence_penalty or self.frequency_penalty or self.logit_bias) or self.repetition_penalty != 1.0


# OpenAI's name for a field -> jaxinfer's (vLLM's). Giving both with different values is an error.
SAMPLING_ALIASES = {"max_completion_tokens": "max_tokens"}
# vLLM's older structured-output fields -> the structured_outputs kind each one gives.
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# OpenAI's fields whose meaning is translated (_translate_openai), not only renamed.
OPENAI_FIELDS = ("response_format", "top_logprobs")
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | SAMPLING_ALIASES.keys() | GUIDED_ALIASES.keys() | set(OPENAI_FIELDS)


def resolve_aliases(fields: dict) -> dict:
    """The fields in SamplingParams' names: OpenAI's and vLLM's other spellings translated, the one owner."""
    fields = _translate_openai(dict(fields))
    renames = SAMPLING_ALIASES | {alias: "structured_outputs" for alias in GUIDED_ALIASES}
    for alias, name in renames.items():
        if alias not in fields:
            continue
        value = fields.pop(alias)
        if name == "structured_outputs" and value is not None:
            value = {GUIDED_ALIASES[alias]: value}
        if fields.get(name) is not None and fields[name] != value:
            raise FieldError(alias, f"({value!r}) disagrees with {name} ({fields[name]!r}); give one of them")
        fields[name] = value
    return fields


def _translate_openai(fields: dict) -> dict:
    """OpenAI's chat fields: `logprobs: true` with `top_logprobs: k` is logprobs=k; `response_format`
    {"type": "json_schema", "json_schema": {"schema": ...}} or {"type": "json_object"} is a JSON grammar."""
    top = fields.pop("top_logprobs", None)
    if isinstance(fields.get("logprobs"), bool):
        fields["logprobs"] = (0 if top is None else top) if fields["logprobs"] else None
    elif top is not None:
        raise FieldError("top_logprobs", "needs logprobs: true")
    if "response_format" in fields:
        spec = _response_format_spec(fields.pop("response_format"))
        if spec is not None:
            fields["structured_outputs"] = spec
    return fields


def _response_format_spec(value) -> dict | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json": {"type": "object"}}
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict) and "schema" in value["json_schema"]:
        return {"json": value["json_schema"]["schema"]}
    raise FieldError("response_format", f"must be {{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {{'schema': ...}}}}, got {value!r}")


_SEED_LOW, _SEED_HIGH = -(2**63), 2**64  # a seed as OpenAI and vLLM take one: any 64-bit integer, signed or unsigned


def device_seed(seed) -> int:
    """A seed as the device draws with it (0 <= seed < MAX_SEED): one in that range is kept, any other 64-bit integer
    is folded into it by a hash (equal seeds draw equal tokens); FieldError for anything else. The one rule for the
    API, the CLI and both line formats."""
    seed = check_int("seed", seed, low=_SEED_LOW, high=_SEED_HIGH - 1)
    if 0 <= seed < MAX_SEED:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


def derive_seed(base_seed: int, identity: str) -> int:
    """A request's seed from the engine seed and a stable identity (its input index, or its batch key),
    so that the same request draws the same tokens in every run, resumed or not."""
    digest = hashlib.blake2b(f"{base_seed}\x00{identity}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


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
        if self.params.logprob_start > len(self.token_ids):
            raise FieldError("logprob_start", f"({self.params.logprob_start}) is past the prompt's {len(self.token_ids)} tokens")


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


POOLINGS = ("last", "mean")  # SamplingParams.pooling's values


def _check_pooling(pooling, max_tokens) -> str | None:
    if pooling is None:
        return None
    if pooling not in POOLINGS:
        raise FieldError("pooling", f"must be one of {POOLINGS}, got {pooling!r}")
    if max_tokens != 0:
        raise FieldError("pooling", f"an embedding generates nothing: max_tokens must be 0, got {max_tokens!r}")
    return pooling


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
    admit_index: int = -1  # order of the latest admission; preemption takes the largest of the least urgent priority first
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when a step first computed any of its tokens (runloop)
    num_steps: int = 0  # engine steps that computed its tokens
    first_token_time: float | None = None
    finish_time: float | None = None
    eos_id: int | None = None  # the model's end-of-sequence id, which min_tokens masks
    fork_of: "Request | None" = None  # sample 0 of its prompt, for samples 1.. of n (they share its prompt pages)
    sample_index: int = 0  # which of its prompt's n samples
    guide: object | None = None  # what it may generate next (guided.Guide), with a grammar, allowed_token_ids or bad_words
    thinking: object | None = None  # for a model that thinks: its place relative to the thinking block (reasoning.Thinking)
    # Per generated token with params.logprobs: (its log-probability, {token id: log-probability} of the top ones)
    logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] = dataclasses.field(default_factory=list)  # per prompt token; None for the first
    # Names of its full pages so far (the prefix cache's hash chain, kv_manager.name_pages), shared by the
    # scheduler and the replica router; extended as pages fill, valid across preemption (tokens never change).
    page_names: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    # With params.pooling: f32[D], the last prompt token's final hidden state, or ("mean") the sum of the prompt's
    # so far; pooled_tokens counts the positions that sum covers (a recompute from position 0 starts it again).
    pooled: np.ndarray | None = dataclasses.field(default=None, repr=False)
    pooled_tokens: int = 0

    def next_token_bans(self) -> tuple[int, ...]:
        """The ids its next token may not be: the stop ids and EOS while fewer than min_tokens are generated
        (min_tokens' bans; stopping.OutputProcessor holds back stop strings as long). They reach the draw in the token mask (engine.token_masks), apart
        from logit_bias's slots, so any number of stop ids fits."""
        if len(self.output_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.eos_id is None or self.params.ignore_eos else (self.eos_id,)
        return tuple(dict.fromkeys((*self.params.stop_token_ids, *eos)))

    def first_logits_position(self, prefill_end: int) -> int:
        """The first position of a prefill up to `prefill_end` whose logits are needed: its last token's
        (the draw), or with prompt_logprobs the token before the first one scored (logprob_start). The
        prefix cache may serve only the full pages before it (kv_manager.share_cached_prefix), the one rule
        by which a scoring request shares cached pages like any other."""
        first = prefill_end - 1
        if self.params.pooling == "mean":  # every prompt token's hidden state is summed: none may come from the cache
            return 0
        if self.params.prompt_logprobs is not None:
            first = min(first, max(self.params.logprob_start, 1) - 1)
        return first

    def keep_pooled(self, start: int, last: np.ndarray, chunk_sum: np.ndarray, length: int) -> None:
        """Keep a prefill chunk's pooled hidden states (`length` prompt tokens from position `start`; f32[D] each):
        its last token's, or with "mean" its sum added to the prompt's (started again by a chunk at position 0)."""
        if self.params.pooling == "last":
            self.pooled, self.pooled_tokens = last, start + length
            return
        if start == 0 or self.pooled is None:
            self.pooled, self.pooled_tokens = np.zeros_like(chunk_sum, np.float64), 0
        if start != self.pooled_tokens:
            raise RuntimeError(f"request {self.request_id}: a chunk from position {start} after {self.pooled_tokens} pooled tokens")
        self.pooled, self.pooled_tokens = self.pooled + chunk_sum, start + length

    def embedding(self) -> np.ndarray | None:
        """f32[D]: the pooled prompt (with params.pooling, once every prompt token is computed), else None."""
        if self.params.pooling is None or self.pooled is None or self.pooled_tokens != len(self.prompt_ids):
            return None
        mean = self.params.pooling == "mean"
        return (self.pooled / len(self.prompt_ids) if mean else self.pooled).astype(np.float32)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def has_started(self) -> bool:
        """Admitted once (one preempted since, with or without a token, has started), or a later sample of n whose first
        sample was: it waits only for that sample's prompt pages. A request that started never times out."""
        return self.admit_index >= 0 or (self.fork_of is not None and self.fork_of.admit_index >= 0)

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output (0 <= start <= stop), without joining the two lists."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]
