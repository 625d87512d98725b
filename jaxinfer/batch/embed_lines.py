"""A batch job's embedding lines: OpenAI `/v1/embeddings` lines, and jaxinfer lines with `"embed": true` (or
`{"pooling": "last" | "mean", "normalize": bool}`), run in the job's one stream beside its generation lines.

`LineRunner` (job.py) turns such a line into a Prompt with `prompt_of` (SamplingParams(max_tokens=0,
pooling=...): it prefills on the paged programs and generates nothing, as LLM.embed's prompts do, on the
replica the router picks) and its RequestOutput, which carries the pooled vector, into a record with
`record_of` (records.record_of hands it over), so the local job and the Ray actors write them alike. A
line's record: jaxinfer's {"id", "line", "key", "status": "ok", "embedding": [floats], "num_prompt_tokens",
...timings} or OpenAI's embeddings `list` body (batch/openai.py). Imports no jax.
"""

from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.input import InputLine, LineError
from jaxinfer.embedding import normalized
from jaxinfer.scheduling.request import SamplingParams

_DEFAULTS = {"pooling": "last", "normalize": True}


def options_of(line: InputLine) -> dict | None:
    """The embedding options of a line that asks for one ({"pooling", "normalize"}, + OpenAI's
    encoding_format), else None. A bad jaxinfer `embed` value is returned as {"error": why}."""
    if line.obj is None:
        return None
    if line.endpoint is not None:
        return line.endpoint.get("embedding")
    embed = line.obj.get("embed")
    if embed is None or embed is False:
        return None
    if embed is True:
        return dict(_DEFAULTS)
    if not isinstance(embed, dict) or set(embed) - set(_DEFAULTS):
        return {"error": f"embed must be true or {{'pooling': 'last' | 'mean', 'normalize': bool}}, got {embed!r}"}
    return _DEFAULTS | embed


def prompt_of(llm, line: InputLine, *, index: int):
    """The Prompt (api.Prompt) of an embedding line; a line that cannot run raises LineError naming its field.
    A prompt over the context is an error, never cut (--truncate applies to generation lines only)."""
    options = options_of(line)
    if "error" in options:
        raise LineError(options["error"], param="embed")
    if "messages" in line.obj:
        raise LineError("an embedding takes a 'prompt', not 'messages'", param="messages")
    field = "input" if line.endpoint is not None else "prompt"
    try:
        params = SamplingParams(max_tokens=0, temperature=0.0, pooling=options["pooling"])
        return llm.prepare(line.obj["prompt"], params, index=index, identity=line.key)
    except (TypeError, ValueError) as e:
        raise LineError(str(e), param=field) from None


def record_of(line: InputLine, output) -> dict:
    """The record of an embedding line that ran, from its RequestOutput (`embedding` set), in its format."""
    options = options_of(line)
    vector = normalized(output.embedding) if options["normalize"] else output.embedding
    metrics = output.metrics.as_record()
    timings = {"time_to_first_token_s": round(output.time_to_first_token, 4), "latency_s": round(output.latency, 4)}
    if line.endpoint is not None:
        return openai_batch.embedding_record(line.key, line.request_id, line.endpoint, vector, output.num_prompt_tokens, metrics | timings)
    return {
        "id": line.request_id, "line": line.number, "key": line.key, "status": "ok", "embedding": [float(x) for x in vector],
        "num_prompt_tokens": output.num_prompt_tokens, "num_generated_tokens": 0, "num_cached_tokens": output.num_cached_tokens,
        **timings, "metrics": metrics,
    }
