"""A batch job's output records, in jaxinfer's format or OpenAI's (batch.openai builds those), and
`JobSummary`, what a run counts of the records it wrote. Host only, no jax: imports numpy, batch.openai
and batch.input (InputLine); api's RequestOutput is only read (imported for type checking).
"""

import array
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.batch import embed_lines, openai as openai_batch
from jaxinfer.batch.input import InputLine

if TYPE_CHECKING:
    from jaxinfer.api import RequestOutput


@dataclasses.dataclass
class JobSummary:
    num_ok: int = 0
    num_errors: int = 0
    num_skipped: int = 0  # already in the output (resume)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    # Per ok record, as float32 arrays (4 bytes a record, not a list's 32: a million-line job's summary stays small)
    ttfts: array.array = dataclasses.field(default_factory=lambda: array.array("f"))
    tpots: array.array = dataclasses.field(default_factory=lambda: array.array("f"))  # time per output token
    queue_times: array.array = dataclasses.field(default_factory=lambda: array.array("f"))
    ignored_fields: dict[str, int] = dataclasses.field(default_factory=dict)  # unknown field -> lines (to do) that hold it
    interrupted: bool = False

    def add(self, record: dict) -> None:
        """Count one written record (of either format)."""
        fields = openai_batch.summary_fields(record) if "custom_id" in record else record if record["status"] == "ok" else None
        if fields is None:
            self.num_errors += 1
            return
        self.num_ok += 1
        self.prompt_tokens += fields["num_prompt_tokens"]
        self.generated_tokens += sum(sample["num_generated_tokens"] for sample in fields.get("samples") or [fields])  # every sample of n
        self.ttfts.append(fields["time_to_first_token_s"])
        self.tpots.append(fields["metrics"]["time_per_output_token_s"])
        self.queue_times.append(fields["metrics"]["queue_s"])

    def request_counts(self) -> dict:
        """The lines this run wrote, as OpenAI's batch request counts {"completed", "failed", "total"}."""
        return {"completed": self.num_ok, "failed": self.num_errors, "total": self.num_ok + self.num_errors}

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def ttft_percentile(self, q: float) -> float:
        return _percentile(self.ttfts, q)

    def tpot_percentile(self, q: float) -> float:
        return _percentile(self.tpots, q)

    def queue_percentile(self, q: float) -> float:
        return _percentile(self.queue_times, q)


def _percentile(values: array.array, q: float) -> float:
    return float(np.percentile(np.frombuffer(values, np.float32), q)) if values else float("nan")


def token_bytes_of(tokenizer) -> Callable[[int], bytes] | None:
    """token id -> the token's own bytes (what an OpenAI logprobs entry's `bytes` holds, so characters split
    across tokens can be rebuilt), from the vocabulary of `tokenizer` (a TextTokenizer): a byte-level BPE
    token through GPT-2's byte alphabet, a byte-fallback token `<0xNN>` as its byte, a SentencePiece
    piece with its word mark as a space; a special token as its text. None for a tokenizer without a
    Hugging Face vocabulary (the records then give each token's text's UTF-8)."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None or not hasattr(hf, "id_to_token"):
        return None
    byte_level = type(hf.decoder).__name__ == "ByteLevel"
    alphabet = _byte_alphabet()
    special = {token.content for token in hf.get_added_tokens_decoder().values()} if hasattr(hf, "get_added_tokens_decoder") else set()

    def token_bytes(token_id: int) -> bytes:
        piece = hf.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in special:
            return piece.encode("utf-8")
        if byte_level and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    return token_bytes


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def error_record(line: InputLine, reason: str, status_code: int = 400, param: str | None = None, output: "RequestOutput | None" = None) -> dict:
    """The record of a line that could not run, in its format; with the `output` of one the engine queued (it timed
    out, or a step failed), also its finish_reason and num_prompt_tokens, which `jaxinfer whatif` replays."""
    queued = {} if output is None else {"finish_reason": output.finish_reason, "num_prompt_tokens": output.num_prompt_tokens}
    if line.fmt == openai_batch.FORMAT:
        return openai_batch.error_record(line.key, line.request_id, line.number, reason, status_code, param) | queued
    return {"id": line.request_id, "line": line.number, "key": line.key, "status": "error", "error": f"line {line.number}: {reason}"} | queued


def record_of(line: InputLine, output: "RequestOutput", token_text=None, token_bytes=None) -> dict:
    """The record of a line that ran (or timed out, or failed in a step), in its format. `token_text`
    (token id -> its text) names the tokens of an OpenAI record's logprobs, `token_bytes` gives their bytes."""
    if output.finish_reason == "timeout":
        return error_record(line, "timed out: its deadline passed before it started", 408, output=output)
    if output.finish_reason == "error":
        return error_record(line, output.error, 500, output=output)
    failed = next((sample for sample in output.samples or () if sample.finish_reason in ("timeout", "error")), None)
    if failed is not None:  # a later sample of n timed out or failed in a step: the line did not give its n samples
        why = "timed out: its deadline passed before it started" if failed.finish_reason == "timeout" else f"failed: {failed.error}"
        return error_record(line, f"sample {failed.sample_index} of {output.num_samples} {why}", 408 if failed.finish_reason == "timeout" else 500, output=failed)
    if output.embedding is not None:
        record = embed_lines.record_of(line, output)
    elif line.fmt == openai_batch.FORMAT:
        record = openai_batch.result_record(line.key, line.request_id, line.endpoint, output, token_text, token_bytes)
    else:
        record = _result_record(line, output)
    return record | {"weight_version": output.weight_version}  # LLM.update_params between lines: which weights made it


def _result_record(line: InputLine, output: "RequestOutput") -> dict:
    """The JSONL record of a line that finished, built from its RequestOutput (jaxinfer's format). With
    n > 1 its text and tokens are sample 0's and `samples` holds all n; with logprobs / prompt_logprobs,
    `logprobs` / `prompt_logprobs` list {"token_id", "logprob", "top": [[id, logprob], ...]} per token."""
    record = {
        "id": line.request_id, "line": line.number, "key": line.key, "status": "ok",
        **_sample_fields(output),
        "num_prompt_tokens": output.num_prompt_tokens, "num_cached_tokens": output.num_cached_tokens,
        "time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4),
        "metrics": output.metrics.as_record(),
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = _logprob_records(output.prompt_token_ids, output.prompt_logprobs)
    if output.samples is not None:
        record["samples"] = [_sample_fields(sample) for sample in output.samples]
    return record


def _sample_fields(output) -> dict:
    fields = {"text": output.text, "token_ids": output.token_ids, "finish_reason": output.finish_reason, "num_generated_tokens": output.num_generated_tokens}
    if output.reasoning_content is not None:  # a model that thinks: text is the answer after the block
        fields["reasoning_content"] = output.reasoning_content
    if output.logprobs is not None:
        fields["logprobs"] = _logprob_records(output.token_ids, output.logprobs)
    return fields


def _logprob_records(token_ids: list[int], entries: list) -> list:
    """RequestOutput's (logprob, {id: logprob}) per token as JSON-ready records (None stays None)."""
    return [
        None if entry is None else {"token_id": token, "logprob": round(entry[0], 6), "top": [[t, round(lp, 6)] for t, lp in entry[1].items()]}
        for token, entry in zip(token_ids, entries)
    ]
