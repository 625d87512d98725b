"""Workloads and how two runs' outputs compare: the trace -> request scaler over real text, greedy
sampling params, token agreement and the relative error norm. numpy at import; jaxinfer where used.

A workload is {"trace", "seed", "scale", "text", "requests"}; each request is {"prompt_ids",
"max_tokens"} plus the trace row it came from. The seed's one generator draws the rows, then the text
offsets, so a (trace, seed, scale) names one workload.
"""

import os
import pathlib

import numpy as np

from common.paths import TEXT_FILE, trace_or_default


def text_ids(tokenizer, path: pathlib.Path = TEXT_FILE) -> list[int]:
    """The real-text passages as token ids (no BOS)."""
    return tokenizer.encode(path.read_text(), add_bos=False)


def prefix_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the passages (repeated if the file is shorter)."""
    ids = text_ids(tokenizer)
    return (ids * -(-num_tokens // len(ids)))[:num_tokens]


def sample_rows(num_rows: int, num_requests: int, rng: np.random.Generator) -> np.ndarray:
    """`num_requests` distinct rows of a trace, drawn from `rng` and kept in arrival order."""
    return np.sort(rng.choice(num_rows, size=num_requests, replace=False))


def scaled_requests(trace, scale: float, rng: np.random.Generator, text: list[int], *, max_context: int,
                    max_output: int | None = None) -> list[dict]:
    """{"prompt_ids", "max_tokens"} per request of `trace`, lengths / `scale` (at least 1), the output capped at
    `max_output`, the prompt at max_context - output and cut from `text` at an offset drawn from `rng`."""
    requests = []
    for context, generated in zip(trace.context_tokens.tolist(), trace.generated_tokens.tolist()):
        max_tokens = max(1, round(generated / scale))
        max_tokens = max_tokens if max_output is None else min(max_tokens, max_output)
        num_prompt = min(max(1, round(context / scale)), max_context - max_tokens)
        offset = int(rng.integers(len(text)))
        requests.append({"prompt_ids": [text[(offset + i) % len(text)] for i in range(num_prompt)], "max_tokens": max_tokens})
    return requests


def build_workload(trace_path: pathlib.Path | None, num_requests: int, scale: float, seed: int, tokenizer=None, *,
                   max_context: int = 2048, max_output: int | None = None) -> dict:
    """A seeded sample of the trace's requests (arrival order) scaled by scaled_requests (text from
    `tokenizer`, default SmolLM2's). `trace_path` None: the conversation trace in $JAXINFER_TRACE_DIR."""
    from jaxinfer import load_trace
    from jaxinfer.loading.tokenizer import load_tokenizer

    trace_path = trace_or_default(trace_path)
    trace, tokenizer = load_trace(trace_path), tokenizer or load_tokenizer(None)
    rng = np.random.default_rng(seed)
    rows = sample_rows(trace.num_requests, num_requests, rng)
    scaled = scaled_requests(trace.take(rows), scale, rng, text_ids(tokenizer), max_context=max_context, max_output=max_output)
    requests = [{"trace_row": int(row), "trace_context_tokens": int(trace.context_tokens[row]),
                 "trace_generated_tokens": int(trace.generated_tokens[row]), **request} for row, request in zip(rows, scaled)]
    return {"trace": os.path.basename(trace_path), "seed": seed, "scale": scale, "text": TEXT_FILE.name, "requests": requests}


def workload_summary(requests: list[dict]) -> dict:
    """Request count, token totals, and the largest and median prompt and output."""
    prompts, outputs = np.array([len(r["prompt_ids"]) for r in requests]), np.array([r["max_tokens"] for r in requests])
    return {"num_requests": len(prompts), "prompt_tokens": int(prompts.sum()), "output_tokens": int(outputs.sum()),
            "max_prompt": int(prompts.max()), "median_prompt": float(np.median(prompts)),
            "max_output": int(outputs.max()), "median_output": float(np.median(outputs))}


def greedy(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm, requests: list[dict], **kwargs) -> list:
    """llm.generate of {"prompt_ids", "max_tokens"} requests, greedy, with no progress bar."""
    return llm.generate([r["prompt_ids"] for r in requests], [greedy(r["max_tokens"]) for r in requests], progress=False, **kwargs)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Exact-match share of requests, and the mean share of each request's tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1))
    return {"exact_requests": float(np.mean([a == b for a, b in zip(ours, theirs)])), "mean_prefix_fraction": float(np.mean(prefix))}


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected||, in float64 (an all-zero `expected` counts as 1e-30)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))
