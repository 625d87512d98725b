"""A batch job's embedding lines: OpenAI `/v1/embeddings` lines, and jaxinfer lines with `"embed": true` (or
`{"pooling": "last" | "mean", "normalize": bool}`), run through `LLM.embed` in groups of max_num_seqs.

`LineRunner` (job.py) hands each such line to `EmbeddingLines.add` instead of the generation stream; a group
runs when it is full and at the end of the input, and its records join the error records the runner yields
between outputs, so the local job and the Ray actors write them alike. A line's record: jaxinfer's
{"id", "line", "key", "status": "ok", "embedding": [floats], "num_prompt_tokens", ...timings} or OpenAI's
embeddings `list` body (batch/openai.py). Imports no jax itself (LLM.embed runs the programs).
"""

import time

from jaxinfer.batch import openai as openai_batch
from jaxinfer.batch.input import InputLine
from jaxinfer.batch.records import error_record

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


class EmbeddingLines:
    """Embedding lines waiting for their group to run."""

    def __init__(self):
        self._waiting: list[tuple[InputLine, dict]] = []

    def add(self, llm, line: InputLine) -> list[dict]:
        """Queue a line; the records of its group when that group is now full (else none)."""
        options = options_of(line)
        if "error" in options:
            return [error_record(line, options["error"], param="embed")]
        if "messages" in line.obj:
            return [error_record(line, "an embedding takes a 'prompt', not 'messages'", param="messages")]
        self._waiting.append((line, options))
        return self.flush(llm) if len(self._waiting) >= llm.engine_config.max_num_seqs else []

    def flush(self, llm) -> list[dict]:
        """Run every waiting line (one LLM.embed call per pooling and normalize); their records."""
        waiting, self._waiting = self._waiting, []
        records = []
        for key in {(o["pooling"], o["normalize"]) for _, o in waiting}:
            group = [(line, o) for line, o in waiting if (o["pooling"], o["normalize"]) == key]
            records += self._run(llm, group, *key)
        return records

    def _run(self, llm, group: list, pooling: str, normalize: bool) -> list[dict]:
        records, ids = [], []
        for line, options in group:
            try:
                ids.append((line, options, llm.encode(line.obj["prompt"])))
            except ValueError as e:
                records.append(error_record(line, str(e), param="input" if line.endpoint else "prompt"))
        if not ids:
            return records
        start = time.perf_counter()
        try:
            outputs = llm.embed([x for _, _, x in ids], pooling=pooling, normalize=normalize)
        except ValueError as e:  # one line too long: run the group's lines one by one, so only it fails
            if len(ids) == 1:
                return records + [error_record(ids[0][0], str(e).removeprefix("prompt 0: "), param="input" if ids[0][0].endpoint else "prompt")]
            return records + [r for line, options in group for r in self._run(llm, [(line, options)], pooling, normalize)]
        seconds = round(time.perf_counter() - start, 4)
        metrics = {"queue_s": 0.0, "prefill_s": seconds, "decode_s": 0.0, "time_per_output_token_s": 0.0, "num_steps": 1, "num_preemptions": 0}
        for (line, options, _), output in zip(ids, outputs):
            records.append(_record(line, options, output, metrics, seconds))
        return records


def _record(line: InputLine, options: dict, output, metrics: dict, seconds: float) -> dict:
    if line.endpoint is not None:
        timings = metrics | {"time_to_first_token_s": seconds, "latency_s": seconds}
        return openai_batch.embedding_record(line.key, line.request_id, line.endpoint, output.embedding, output.num_prompt_tokens, timings)
    return {
        "id": line.request_id, "line": line.number, "key": line.key, "status": "ok", "embedding": [float(x) for x in output.embedding],
        "num_prompt_tokens": output.num_prompt_tokens, "num_generated_tokens": 0, "num_cached_tokens": 0,
        "time_to_first_token_s": seconds, "latency_s": seconds, "metrics": metrics,
    }
