"""The OpenAI Batch file format, in and out, as `vllm run-batch` reads and writes it. Host only, no jax.

Input, one request a line:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [...], "max_tokens": 16}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "Once upon", "temperature": 0}}
    {"custom_id": "r3", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "Once upon", "pooling": "mean"}}

Output, one line per input line (in the order they finish):

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_...", "body": <chat.completion>}, "error": null, ...}

where the body is an OpenAI `chat.completion` or `text_completion` object, or an embeddings `list` (batch/embed_lines.py
runs those lines, batched, through LLM.embed). A completions body may set `echo`:
the prompt comes back before the text and, with `logprobs`, its tokens before the completion's (the first
one null, as OpenAI's); with `max_tokens: 0` that scores the prompt alone (prompt_logprobs). A line that cannot run gets the
status code an OpenAI server would answer (400 a bad body, 404 an unknown url, 405 a method other than
POST, 408 a deadline passed before it started, 500 a failed step); its body is OpenAI's error object
`{"error": {"message", "type", "param", "code"}}` and its `error` the same as a batch error
`{"code", "message", "line", "param"}`. Every line also carries two jaxinfer fields: `key`, the resume key
(`custom_id:<the custom_id as JSON>`, as batch.py's keys), and `metrics`, the request's timings.

This module only translates: batch.py reads the lines (bytes, JSON, keys, field checks) and runs and writes
them, for both formats. `parse_request` turns a parsed line into jaxinfer's request fields;
`result_record` and `error_record` build the output lines. The body of a result is built in one place,
`response_body`, from the RequestOutput.
"""

import base64
import hashlib
import itertools
import time

import numpy as np

FORMAT = "openai"
INPUT_FORMATS = ("auto", "jaxinfer", FORMAT)  # a batch job's input formats (auto: detected from the lines that parse)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
POOLINGS = ("last", "mean")  # an embeddings body's jaxinfer fields: pooling (default "last") and normalize (default true)
_ENVELOPE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
# Body fields OpenAI marks nullable: null there means the default, as if the field were absent.
NULLABLE_FIELDS = frozenset({
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "logit_bias", "presence_penalty", "frequency_penalty",
    "seed", "logprobs", "top_logprobs", "response_format", "echo",
})
_MODEL_DEFAULT = "jaxinfer"  # the body's `model` when a request names none
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 408: "timeout", 500: "server_error"}


class RequestError(ValueError):
    """A request line that cannot run, with the HTTP status an OpenAI server would answer and the parameter at fault."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.param, self.code = status_code, param, code


_JAXINFER_FIELDS = frozenset({"id", "prompt", "messages"})  # what marks a jaxinfer line


def line_format(obj) -> str | None:
    """The format a parsed line is written in (the format detection): 'openai' when it holds a custom_id, or the
    envelope's other fields (method, url, body) and none of jaxinfer's; 'jaxinfer' when it holds id, prompt or
    messages without a custom_id (a jaxinfer line may carry a field named url or body: an unknown field, warned
    of and ignored); None when it says neither (not an object, or neither format's fields)."""
    if not isinstance(obj, dict):
        return None
    if "custom_id" in obj:
        return FORMAT
    if not _JAXINFER_FIELDS.isdisjoint(obj):
        return "jaxinfer"
    return FORMAT if not _ENVELOPE_FIELDS.isdisjoint(obj) else None


def valid_custom_id(value) -> bool:
    return isinstance(value, str) and bool(value) and _is_unicode(value)


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (a JSON escape like \\ud800 that is no character)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_request(obj) -> tuple[dict, dict]:
    """(jaxinfer's request fields, the endpoint {"url", "model"}) of a parsed line; RequestError otherwise.

    The fields are `messages` (chat) or `prompt` (completions) and every other body field as given, for
    batch.py to check (supported, unsupported, misspelt or unknown) exactly as it checks its own lines."""
    if not isinstance(obj, dict):
        raise RequestError(f"expected a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if isinstance(custom_id, str) and custom_id and not _is_unicode(custom_id):
        raise RequestError("'custom_id' is not valid Unicode (it holds a lone surrogate escape)", param="custom_id")
    if not valid_custom_id(custom_id):
        raise RequestError("missing or invalid 'custom_id' (a non-empty string is required)", param="custom_id")
    extra = sorted(set(obj) - _ENVELOPE_FIELDS)
    if extra:
        raise RequestError(f"unknown request field {extra[0]!r} (a line holds custom_id, method, url and body)", param=extra[0])
    if obj.get("method", "POST") != "POST":
        raise RequestError(f"method {obj.get('method')!r} is not allowed; batch requests are POST", status_code=405, param="method")
    url = obj.get("url")
    if not isinstance(url, str) or url not in ENDPOINTS:  # a list or an object is unhashable: not an endpoint either
        raise RequestError(f"url {url!r} is not supported; use one of {', '.join(ENDPOINTS)}", status_code=404, param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object (the request's parameters)", param="body")
    model = body.get("model", _MODEL_DEFAULT)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", param="model")
    fields = {name: value for name, value in body.items() if name != "model" and not (value is None and name in NULLABLE_FIELDS)}
    if ENDPOINTS[url] == "embeddings":
        return _embedding_request(fields, url, model)
    if ENDPOINTS[url] == "chat":
        if "prompt" in fields or "messages" not in fields:
            raise RequestError(f"{url} needs 'messages' (and no 'prompt')", param="messages")
    else:
        if "messages" in fields or "prompt" not in fields:
            raise RequestError(f"{url} needs 'prompt' (and no 'messages')", param="prompt")
        prompt = fields["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            fields["prompt"] = prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            raise RequestError("a list of several prompts in one request is not supported; give one prompt per line", param="prompt")
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise RequestError("'prompt' must be a non-empty string or list of token ids", param="prompt")
        if _echo(fields):
            return fields, {"url": url, "model": model, "echo": prompt}
    return fields, {"url": url, "model": model}


def _embedding_request(fields: dict, url: str, model: str) -> tuple[dict, dict]:
    """An embeddings body: `input` (one text or one list of token ids), `encoding_format` float | base64,
    and jaxinfer's `pooling` and `normalize`; `dimensions` and every other field are errors naming it."""
    options = {"pooling": fields.pop("pooling", "last"), "normalize": fields.pop("normalize", True), "encoding_format": fields.pop("encoding_format", "float")}
    if options["pooling"] not in POOLINGS:
        raise RequestError(f"pooling must be one of {POOLINGS}, got {options['pooling']!r}", param="pooling")
    if not isinstance(options["normalize"], bool):
        raise RequestError(f"normalize must be true or false, got {options['normalize']!r}", param="normalize")
    if options["encoding_format"] not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {options['encoding_format']!r}", param="encoding_format")
    prompt = fields.pop("input", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise RequestError("'input' must be one non-empty string or list of token ids (one input per line)", param="input")
    for name in fields:
        raise RequestError(f"{name} is not supported by {url} (it takes input, encoding_format, pooling, normalize)", param=name)
    return {"prompt": prompt}, {"url": url, "model": model, "embedding": options}


def embedding_body(endpoint: dict, vector, num_prompt_tokens: int) -> dict:
    """OpenAI's embeddings `list` object of one input; base64 is the float32 little-endian bytes, as OpenAI's."""
    values = [float(x) for x in vector]
    if endpoint["embedding"]["encoding_format"] == "base64":
        values = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": values}], "model": endpoint["model"],
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def embedding_record(key: str, custom_id: str, endpoint: dict, vector, num_prompt_tokens: int, metrics: dict) -> dict:
    """The output line of an embeddings request that ran."""
    digest = _digest(key)
    return {
        "id": f"batch_req_{digest}", "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{digest}", "body": embedding_body(endpoint, vector, num_prompt_tokens)},
        "error": None, "key": key, "metrics": metrics,
    }


def _echo(fields: dict) -> bool:
    """A completion's `echo` (taken out of `fields`): the text starts with the prompt and, with `logprobs`,
    the logprobs with the prompt's tokens (prompt_logprobs; `max_tokens: 0` then scores the prompt alone)."""
    echo = fields.pop("echo", False)
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {echo!r}", param="echo")
    if echo and isinstance(fields.get("logprobs"), int) and not isinstance(fields["logprobs"], bool):
        fields.setdefault("prompt_logprobs", fields["logprobs"])
    return echo


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def response_body(key: str, endpoint: dict, output, token_text=None, token_bytes=None) -> dict:
    """The OpenAI `chat.completion` or `text_completion` object of a finished RequestOutput: one choice
    per sample (n), each with its logprobs in the endpoint's shape when they were asked for.
    `token_text` (token id -> text) names the tokens there; `token_bytes` (token id -> its own bytes)
    fills a chat logprob's `bytes` (default: its text's UTF-8)."""
    samples = output.samples or [output]
    completion = sum(sample.num_generated_tokens for sample in samples)
    usage = {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": completion, "total_tokens": output.num_prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}  # OpenAI's field: prompt tokens served from the prefix cache
    chat = ENDPOINTS[endpoint["url"]] == "chat"
    token_text = token_text or str
    token_bytes = token_bytes or (lambda token: token_text(token).encode("utf-8", "surrogatepass"))
    choices = [_choice(sample, chat, token_text, token_bytes, endpoint.get("echo")) for sample in samples]
    kind, prefix = ("chat.completion", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    return {"id": prefix + _digest(key), "object": kind, "created": int(time.time()), "model": endpoint["model"], "choices": choices, "usage": usage}


def _choice(sample, chat: bool, token_text, token_bytes, echo=None) -> dict:
    """One sample's choice; `echo` (a completion's prompt, text or ids) puts the prompt before its text
    and its tokens (null log-probability first, as OpenAI's) before its logprobs."""
    choice = {"index": sample.sample_index, "finish_reason": sample.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": sample.text}
        if sample.reasoning_content is not None:  # a model that thinks (vLLM's field): content is the answer after the block
            choice["message"]["reasoning_content"] = sample.reasoning_content
    else:
        prompt_text = "" if echo is None else echo if isinstance(echo, str) else "".join(token_text(t) for t in sample.prompt_token_ids)
        choice["text"] = prompt_text + sample.text
    if sample.logprobs is not None:
        if chat:
            choice["logprobs"] = _chat_logprobs(sample.token_ids, sample.logprobs, token_text, token_bytes)
        elif echo is not None:
            prompt_entries = sample.prompt_logprobs or [None] * len(sample.prompt_token_ids)
            choice["logprobs"] = _completion_logprobs(sample.prompt_token_ids + sample.token_ids, prompt_entries + sample.logprobs, token_text)
        else:
            choice["logprobs"] = _completion_logprobs(sample.token_ids, sample.logprobs, token_text)
    return choice


def _chat_logprobs(token_ids: list[int], entries: list, token_text, token_bytes) -> dict:
    """A chat choice's logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(token))}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(u, v) for u, v in top.items()]} for t, (lp, top) in zip(token_ids, entries)]}


def _completion_logprobs(token_ids: list[int], entries: list, token_text) -> dict:
    """A completion choice's logprobs: parallel lists tokens, token_logprobs, top_logprobs, text_offset
    (an entry that is None, an echoed prompt's first token, is null in both lists)."""
    texts = [token_text(t) for t in token_ids]
    offsets = [0, *itertools.accumulate(len(t) for t in texts)][: len(texts)]
    tops = [None if entry is None else {token_text(u): v for u, v in entry[1].items()} for entry in entries]
    return {"tokens": texts, "token_logprobs": [None if entry is None else entry[0] for entry in entries], "top_logprobs": tops, "text_offset": offsets}


def result_record(key: str, custom_id: str, endpoint: dict, output, token_text=None, token_bytes=None) -> dict:
    """The output line of a request that ran."""
    digest = _digest(key)
    metrics = output.metrics.as_record() | {"time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4)}
    if len(output.samples or ()) > 1:  # usage sums the choices: what each generated (for a replay of the job: whatif)
        metrics["generated_tokens_per_sample"] = [sample.num_generated_tokens for sample in output.samples]
    return {
        "id": f"batch_req_{digest}", "custom_id": custom_id, "response": {"status_code": 200, "request_id": f"req_{digest}", "body": response_body(key, endpoint, output, token_text, token_bytes)},
        "error": None, "key": key, "metrics": metrics,
    }


def error_record(key: str, custom_id: str | None, number: int, reason: str, status_code: int = 400, param: str | None = None, code: str | None = None) -> dict:
    """The output line of a request that could not run: OpenAI's error object in the response body, and as the batch error."""
    digest, kind = _digest(key), _ERROR_TYPES.get(status_code, "invalid_request_error")
    message = f"line {number}: {reason}"
    return {
        "id": f"batch_req_{digest}", "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": f"req_{digest}", "body": {"error": {"message": message, "type": kind, "param": param, "code": code}}},
        "error": {"code": code or kind, "message": message, "line": number, "param": param}, "key": key,
    }


def summary_fields(record: dict) -> dict | None:
    """What a job's summary counts of an output line, in the names of jaxinfer's records (with n > 1, `samples`: each
    choice's generated tokens); None for an error."""
    response = record.get("response") or {}
    if response.get("status_code") != 200:
        return None
    usage, metrics = response["body"]["usage"], record["metrics"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    fields = {"num_prompt_tokens": usage["prompt_tokens"], "num_generated_tokens": completion, "num_cached_tokens": cached,
              "time_to_first_token_s": metrics["time_to_first_token_s"], "metrics": metrics}
    per_sample = _tokens_per_choice(metrics.get("generated_tokens_per_sample"), completion, len(response["body"].get("choices") or ()))
    if len(per_sample) > 1:
        fields["samples"] = [{"num_generated_tokens": tokens} for tokens in per_sample]
    return fields


def _tokens_per_choice(recorded, completion: int, num_choices: int) -> list[int]:
    """Each choice's generated tokens: as the record's metrics give them, else (a record written before they were)
    the usage's completion tokens shared evenly among the choices."""
    if isinstance(recorded, list) and len(recorded) > 1 and all(isinstance(n, int) and not isinstance(n, bool) for n in recorded):
        return recorded
    if num_choices < 2 or not isinstance(completion, int):
        return [completion]
    each, extra = divmod(completion, num_choices)
    return [each + (i < extra) for i in range(num_choices)]
