"""Structured output: a grammar per request, turned into a token mask per step by llguidance. Host only.

`SamplingParams.structured_outputs` is one of {"json": schema}, {"regex": pattern}, {"choice": [strings]}
or {"grammar": Lark or GBNF text} (vLLM's kinds). `check_spec` normalizes and compiles it where the
params are built, so a schema that cannot be compiled is that request's error (a batch line's error
record), naming the problem. `Guides(tokenizer, vocab_size)` builds llguidance's tokenizer from
jaxinfer's once per LLM; `Guides.guide(params)` gives a request its `Guide`.

Each step, `StepPlan.build` asks every constrained request for its next token's bitmask
(`Guide.fill_mask`: bit t of word t // 32 is set when token t is allowed), and the device applies the masks
under a `lax.cond` taken only when some row is constrained (sampling.process). The output processor
feeds each drawn token to the guide (`Guide.advance`); a matcher that has stopped ends the request ('stop').
The same masks carry `allowed_token_ids` and `bad_words` (a `Guide` without a grammar), so a request
with any of them costs no program of its own. For a model that thinks (reasoning.py), a request's grammar
applies only after its thinking block closes (inside it, EOS is banned: an answer must follow), and a
`thinking_budget` makes the close tag the only token allowed once the budget is spent.

No constraint is broken silently: a spec is checked in a child process (grammar_check.py: a grammar deep
enough to overflow llguidance's stack is an error, not a crash), a matcher in an error state, and a step
whose grammar, allowed_token_ids, bad_words and -inf biases (min_tokens) leave no token, set `Guide.error`,
which the output processor turns into the request's error (stopping.py) instead of a 'stop'.
"""

import functools
import json

import numpy as np

from jaxinfer.scheduling import grammar_check, reasoning
from jaxinfer.validation import FieldError

SPEC_KINDS = ("json", "regex", "choice", "grammar")
_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def check_spec(value) -> tuple[str, str] | None:
    """{kind: source} -> (kind, source text), compiled once here to find errors; None stays None."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] in SPEC_KINDS:  # already normalized
        value = {value[0]: value[1] if value[0] in ("regex", "grammar") else _json_value(value[1])}
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in SPEC_KINDS:
        raise FieldError("structured_outputs", f"must be one of {{'json': schema}}, {{'regex': ...}}, {{'choice': [...]}}, {{'grammar': ...}}, got {value!r}")
    kind, source = next(iter(value.items()))
    if kind in ("json", "choice"):
        if kind == "choice" and (not isinstance(source, list) or not source or not all(isinstance(c, str) for c in source)):
            raise FieldError("structured_outputs", f"'choice' must be a non-empty list of strings, got {source!r}")
        text = source if isinstance(source, str) else _json_text(source)
    elif isinstance(source, str):
        text = source
    else:
        raise FieldError("structured_outputs", f"{kind!r} must be a string, got {source!r}")
    error = grammar_check.CHECKER.check(_FORMATS[kind], text)
    if error is not None:
        raise FieldError("structured_outputs", f"{kind} {error}")
    return kind, text


def _json_text(source) -> str:
    """A schema or choice list as JSON text; one nested past Python's recursion limit is the field's error."""
    try:
        return json.dumps(source, sort_keys=True, ensure_ascii=False)
    except RecursionError:
        raise FieldError("structured_outputs", "is nested too deeply to encode as JSON") from None


def _json_value(text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise FieldError("structured_outputs", "is nested too deeply to decode as JSON") from None
    except (TypeError, ValueError) as e:  # the (kind, JSON text) form with text that is not JSON
        raise FieldError("structured_outputs", f"holds {text!r}, which is not JSON: {e}") from None


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a checked spec (cached: a job's lines often share a schema)."""
    import llguidance

    return llguidance.grammar_from(_FORMATS[kind], text)


class Guides:
    """llguidance's view of one tokenizer (built once: about a second) and the guides made with it."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def _lltokenizer(self):
        import llguidance

        eos = self._tokenizer.eos_id
        return llguidance.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    @functools.cached_property
    def think_tokens(self) -> "reasoning.ThinkTokens | None":
        """The model's thinking tags (reasoning.THINK_TAGS), or None when it does not think."""
        hf = getattr(self._tokenizer, "tokenizer", None)
        return None if hf is None else reasoning.think_tokens(hf.token_to_id)

    def request_fields(self, params, prompt_ids) -> dict:
        """A new request's `guide` and `thinking` (its place relative to the thinking block), as Request fields."""
        thinking = reasoning.thinking_for(self.think_tokens, prompt_ids, params.thinking_budget)
        return {"guide": self.guide(params, thinking), "thinking": thinking}

    def guide(self, params, thinking: "reasoning.Thinking | None" = None) -> "Guide | None":
        """A fresh guide for a request's SamplingParams (its grammar, allowed_token_ids, bad_words), or
        None when it has none of them. Each request (each sample of n) gets its own: a guide has state.
        A matcher that cannot be made gives a guide in its error state (the request's error), never a raise."""
        spec, allowed, words = params.structured_outputs, params.allowed_token_ids, params.bad_words
        budget = thinking is not None and params.thinking_budget is not None
        if spec is None and allowed is None and not words and not budget:
            return None
        matcher, error = None, None
        if spec is not None:
            try:
                matcher = grammar_check.run_with_large_stack(self._matcher, *spec)
            except Exception as e:  # llguidance refused a spec its check passed: this request's error
                error = f"the grammar's matcher could not be made: {type(e).__name__}: {e}"
        guide = Guide(matcher, None if allowed is None else self._allowed_bits(allowed), self._bad_word_ids(words), self.vocab_size)
        guide.error, guide.thinking, guide.eos_id = error, thinking, getattr(self._tokenizer, "eos_id", None)
        return guide

    def _matcher(self, kind: str, text: str):
        import llguidance

        return llguidance.LLMatcher(self._lltokenizer, _grammar(kind, text), log_level=0)

    @functools.lru_cache(maxsize=64)
    def _allowed_bits(self, allowed: tuple[int, ...]) -> np.ndarray:
        bits = np.zeros(mask_words(self.vocab_size) * 32, bool)
        bits[list(allowed)] = True
        return np.packbits(bits, bitorder="little").view(np.int32)

    @functools.lru_cache(maxsize=64)
    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as it would be written at the start of the output and after a space (vLLM's rule)."""
        found = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self._tokenizer.encode(text, add_bos=False, parse_special=False))
                if ids:
                    found.add(ids)
        return tuple(sorted(found))


class Guide:
    """What one request may generate next: a grammar matcher, an allowed set of ids, banned word sequences.

    `error` is None while the request may go on; else why no allowed token can follow (the matcher failed,
    or the constraints together leave no token), which makes the request an error (stopping.py).
    """

    def __init__(self, matcher, allowed: np.ndarray | None, bad_words: tuple[tuple[int, ...], ...], vocab_size: int):
        self.matcher, self.allowed, self.bad_words, self.vocab_size = matcher, allowed, bad_words, vocab_size
        self.output: list[int] = []
        self.error: str | None = None
        self.thinking: reasoning.Thinking | None = None  # the request's thinking block, advanced by the output processor
        self.eos_id: int | None = None

    def fill_mask(self, row: np.ndarray, banned=()) -> None:
        """Write the bitmask of allowed next tokens into `row` (int32[mask_words], contiguous, all ones on
        entry). `banned`: ids whose logit bias is -inf at this step (min_tokens' EOS and stop ids), int[N].
        When nothing is left, `error` names the constraints that left nothing."""
        thinking = self.thinking
        if thinking is not None and thinking.forced_token is not None:  # the thinking budget is spent
            row[:] = 0
            _set_bit(row, thinking.forced_token)
            return
        if self.matcher is not None and (thinking is None or thinking.grammar_applies):
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if self.error is None and self.matcher.is_error():
                self.error = self._matcher_error()
            if thinking is not None and thinking.state == reasoning.BEFORE:
                _set_bit(row, thinking.tokens.open_id)  # the first token may open the block instead
        elif self.matcher is not None and self.eos_id is not None:  # inside the block: an answer must follow
            _clear_bit(row, self.eos_id)
        if self.allowed is not None:
            row &= self.allowed
            if thinking is not None and thinking.state == reasoning.THINKING:
                _set_bit(row, thinking.tokens.close_id)  # the block may always close
        for ids in self.bad_words:
            if len(ids) == 1 or tuple(self.output[-(len(ids) - 1) :]) == ids[:-1]:
                _clear_bit(row, ids[-1])
        for token in banned:
            _clear_bit(row, int(token))
        if self.error is None and not _any_below(row, self.vocab_size):
            self.error = self._nothing_left(banned)

    def advance(self, token: int) -> bool:
        """Feed the drawn token; True when the grammar is done (or cannot go on, `error`), so the request stops."""
        self.output.append(token)
        if self.matcher is None or self.error is not None:
            return self.error is not None
        if self.thinking is not None and self.thinking.last_was_thinking:
            return False  # the block's tokens are not the grammar's
        self.matcher.consume_token(token)
        if self.matcher.is_error():
            self.error = self._matcher_error()
        return self.matcher.is_stopped() or self.error is not None

    def _matcher_error(self) -> str:
        first_line = (self.matcher.get_error().strip().splitlines() or ["?"])[0]
        if first_line == "NoExtensionBias":  # llguidance: no string of the language continues the output
            return f"the grammar allows no string that continues the {len(self.output)} tokens so far (its language is empty or has no finite string)"
        return f"the grammar's matcher failed after {len(self.output)} tokens: {first_line[:300]}"

    def _nothing_left(self, banned) -> str:
        causes = [name for name, active in (("the grammar", self.matcher is not None), ("allowed_token_ids", self.allowed is not None),
                                             ("bad_words", bool(self.bad_words)), ("min_tokens (EOS and stop_token_ids are banned until it is reached)", len(banned) > 0))
                  if active]
        return f"no token may follow the {len(self.output)} tokens so far: {' + '.join(causes)} leave none allowed"


def fill_mask(row: np.ndarray, guide: "Guide | None", banned=()) -> None:
    """One slot's token mask (int32[mask_words], all ones on entry): its guide's, with the `banned` ids
    (min_tokens' EOS and stop ids, Request.next_token_bans) cleared; without a guide, only those cleared."""
    if guide is not None:
        guide.fill_mask(row, np.asarray(banned, np.int64))
        return
    for token in banned:
        _clear_bit(row, int(token))


def _set_bit(row: np.ndarray, token: int) -> None:
    row.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))


def _clear_bit(row: np.ndarray, token: int) -> None:
    row.view(np.uint32)[token // 32] &= ~np.uint32(1 << (token % 32))


def _any_below(row: np.ndarray, vocab_size: int) -> bool:
    """Whether some bit of a token id < vocab_size is set (the last word's higher bits are padding)."""
    full, rest = divmod(vocab_size, 32)
    return bool(row[:full].any()) or bool(rest and row.view(np.uint32)[full] & np.uint32((1 << rest) - 1))
