"""Output processing: the one owner of stop handling and of a request's text. Host only, no jax.

Every sampled token goes through `OutputProcessor.check`, which decides whether the request is done:
a stop token id or EOS (unless `ignore_eos`), `max_tokens`, the context limit, or a stop string in the
text so far. Text is detokenized incrementally (`IncrementalDetokenizer`): each token decodes a short
window of ids rather than the whole output, so a long generation costs O(n), not O(n^2), and the final
text equals decoding all ids at once. A stop string cuts the text just before it.

A request whose guide has an error (guided.Guide.error: its matcher failed, or its constraints left no
token to draw) finishes with reason 'error' and that cause in `Request.error`, never as a 'stop'; a token
drawn when no token was allowed is dropped, since no constraint allowed it.
"""

import dataclasses
from collections.abc import Callable

from jaxinfer.scheduling.request import Request, SamplingParams

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def token_stop_reason(output_ids: list[int], params: SamplingParams, eos_id: int | None) -> str | None:
    """'stop' if the last token ends the request, 'length' if max_tokens is reached, else None."""
    last = output_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and eos_id is not None and last == eos_id):
        return "stop"
    if len(output_ids) >= params.max_tokens:
        return "length"
    return None


@dataclasses.dataclass
class IncrementalDetokenizer:
    """Text of a growing list of ids, decoding only the tail window at each step.

    `prefix_offset:read_offset` is the window already emitted; a new token's text is decode(window +
    new ids) minus decode(window), emitted once it no longer ends in an incomplete UTF-8 sequence.
    Decoding with the window in front keeps tokenizers that strip a leading space (SentencePiece) right.
    """

    decode: Callable[[list[int]], str]
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly complete text (may be empty)."""
        self.ids.extend(new_ids)
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """Emit what is held back (an incomplete sequence at the very end decodes as U+FFFD)."""
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new_text
        return new_text


@dataclasses.dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop_at: int | None = None  # character index where a stop string begins
    stop_end: int | None = None  # and where that stop string ends


def _guide_failed(request: Request) -> bool:
    """Whether the guide had no allowed token for the draw just made (its error set while filling the
    mask); if so the drawn token, which nothing allowed, is dropped and `request.error` names the cause."""
    if request.guide.error is None:
        return False
    request.output_ids.pop()
    if len(request.logprobs) > len(request.output_ids):
        request.logprobs.pop()
    request.error = request.guide.error
    return True


class OutputProcessor:
    """Decides when each request is done and owns its text.

    Args:
      decode: ids -> text with special tokens skipped, or None when no tokenizer is known (token ids
        only; a request with stop strings is then refused).
      eos_id: end-of-sequence id, or None.
      max_context: tokens per sequence (prompt + output) at most.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, eos_id: int | None, max_context: int):
        self.decode, self.eos_id, self.max_context = decode, eos_id, max_context
        self._texts: dict[str, _TextState] = {}

    def check(self, request: Request) -> str | None:
        """After a new output token: the finish reason ('stop' | 'length' | 'error', with `request.error`
        set), or None to go on. A prompt scored with max_tokens=0 ends with its prefill, as 'length'."""
        if not request.output_ids:
            return "length"
        if request.guide is not None and _guide_failed(request):
            return "error"
        reason = token_stop_reason(request.output_ids, request.params, self.eos_id)
        if request.thinking is not None:  # before the guide, which reads where the token fell
            request.thinking.advance(request.output_ids[-1])
        if request.guide is not None and request.guide.advance(request.output_ids[-1]):
            if request.guide.error is not None:  # the matcher failed on this (allowed) token
                request.error = request.guide.error
                return "error"
            reason = reason or "stop"  # the grammar is complete: nothing more may follow
        if self.decode is not None and self._stop_string_found(request):
            reason = "stop"
        if reason is None and request.num_tokens >= self.max_context:
            reason = "length"
        return reason

    def _state(self, request: Request) -> _TextState:
        state = self._texts.get(request.request_id)
        if state is None:
            state = self._texts[request.request_id] = _TextState(IncrementalDetokenizer(self.decode))
        return state

    def _stop_string_found(self, request: Request) -> bool:
        """Whether a stop string ends in the text the newest tokens added; none is looked for until min_tokens tokens
        are out (vLLM's rule), and then not in the text before: a stop string completed earlier does not count."""
        state = self._state(request)
        start = len(state.detokenizer.text)
        new_ids = request.output_ids[len(state.detokenizer.ids) :]
        state.detokenizer.add(new_ids)
        return len(request.output_ids) > request.params.min_tokens and self._find_stop(state, request.params.stop, start)

    def _find_stop(self, state: _TextState, stops: tuple[str, ...], start: int) -> bool:
        """Look for a stop string that ends in the text added after `start`."""
        text = state.detokenizer.text
        hits = [(i, i + len(s)) for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits and (state.stop_at is None or min(hits)[0] < state.stop_at):
            state.stop_at, state.stop_end = min(hits)
        return bool(hits)

    def text(self, request: Request) -> str:
        """The request's final text (cut before a stop string, or after it with include_stop_str_in_output);
        releases its state."""
        if self.decode is None:
            return ""
        state = self._state(request)
        state.detokenizer.add(request.output_ids[len(state.detokenizer.ids) :])
        start = len(state.detokenizer.text)
        state.detokenizer.flush()
        if len(request.output_ids) > request.params.min_tokens:
            self._find_stop(state, request.params.stop, start)
        del self._texts[request.request_id]
        text = state.detokenizer.text
        if state.stop_at is None:
            return text
        return text[: state.stop_end] if request.params.include_stop_str_in_output else text[: state.stop_at]
