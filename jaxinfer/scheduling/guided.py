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
with any of them costs no program of its own.
"""

import functools
import json

import numpy as np

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
        value = {value[0]: value[1] if value[0] in ("regex", "grammar") else json.loads(value[1])}
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in SPEC_KINDS:
        raise FieldError("structured_outputs", f"must be one of {{'json': schema}}, {{'regex': ...}}, {{'choice': [...]}}, {{'grammar': ...}}, got {value!r}")
    kind, source = next(iter(value.items()))
    if kind in ("json", "choice"):
        if kind == "choice" and (not isinstance(source, list) or not source or not all(isinstance(c, str) for c in source)):
            raise FieldError("structured_outputs", f"'choice' must be a non-empty list of strings, got {source!r}")
        text = source if isinstance(source, str) else json.dumps(source, sort_keys=True, ensure_ascii=False)
    elif isinstance(source, str):
        text = source
    else:
        raise FieldError("structured_outputs", f"{kind!r} must be a string, got {source!r}")
    _compile(kind, text)
    return kind, text


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str) -> str:
    """The llguidance grammar of a spec (cached: a job's lines often share a schema)."""
    import llguidance

    try:
        grammar = llguidance.grammar_from(_FORMATS[kind], text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, RuntimeError, TypeError) as e:
        raise FieldError("structured_outputs", f"{kind} cannot be compiled: {e}") from None
    if is_error:
        raise FieldError("structured_outputs", f"{kind} cannot be compiled: {'; '.join(messages)}")
    return grammar


class Guides:
    """llguidance's view of one tokenizer (built once: about a second) and the guides made with it."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def _lltokenizer(self):
        import llguidance

        eos = self._tokenizer.eos_id
        return llguidance.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def guide(self, params) -> "Guide | None":
        """A fresh guide for a request's SamplingParams (its grammar, allowed_token_ids, bad_words), or
        None when it has none of them. Each request (each sample of n) gets its own: a guide has state."""
        spec, allowed, words = params.structured_outputs, params.allowed_token_ids, params.bad_words
        if spec is None and allowed is None and not words:
            return None
        matcher = None
        if spec is not None:
            import llguidance

            matcher = llguidance.LLMatcher(self._lltokenizer, _compile(*spec), log_level=0)
        return Guide(matcher, None if allowed is None else self._allowed_bits(allowed), self._bad_word_ids(words))

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
    """What one request may generate next: a grammar matcher, an allowed set of ids, banned word sequences."""

    def __init__(self, matcher, allowed: np.ndarray | None, bad_words: tuple[tuple[int, ...], ...]):
        self.matcher, self.allowed, self.bad_words, self.output = matcher, allowed, bad_words, []

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the bitmask of allowed next tokens into `row` (int32[mask_words], contiguous, all ones on entry)."""
        if self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.allowed is not None:
            row &= self.allowed
        for ids in self.bad_words:
            if len(ids) == 1 or tuple(self.output[-(len(ids) - 1) :]) == ids[:-1]:
                row.view(np.uint32)[ids[-1] // 32] &= ~np.uint32(1 << (ids[-1] % 32))

    def advance(self, token: int) -> bool:
        """Feed the drawn token; True when the grammar is done (or cannot go on), so the request stops."""
        self.output.append(token)
        if self.matcher is None:
            return False
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()
