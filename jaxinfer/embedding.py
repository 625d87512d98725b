"""`LLM.embed`: one vector per prompt, pooled from the decoder's final hidden states (after the final norm).

Pooling: "last" takes the last prompt token's state (Qwen3-Embedding, E5-Mistral: decoder embedders),
"mean" averages the prompt's states; `normalize` divides by the L2 norm (max(norm, 1e-12), as torch's
F.normalize). An embedding is a request that prefills its prompt and generates nothing
(SamplingParams(max_tokens=0, pooling=...)), so it runs exactly as generation's prefill does: scheduled,
chunked, packed and bucketed by the scheduler, routed to a replica under data parallelism, on the paged
prefill programs compiled at warm-up (nothing compiles after it). Every forward program also returns each
sequence slot's final hidden state at its last token and its sum over the chunk (engine._pooled_hidden);
the scheduler keeps them per request (Request.keep_pooled: the last chunk's last state, or the chunks'
sums over the prompt's length) and the request's pages are freed when it finishes, as a scored prompt's.

The prefix cache: "last" may start from cached full pages (the last token is always computed, over their KV);
"mean" needs every token's state, so it reads none (Request.first_logits_position). Either kind names
the full pages it computed, as any prompt does: their KV is what generation would write. Imports only the
request types and validation, never api (LLM is passed in).
"""

import dataclasses

import numpy as np

from jaxinfer.scheduling.request import POOLINGS, SamplingParams
from jaxinfer.validation import FieldError, check_bool

__all__ = ["POOLINGS", "EmbeddingOutput", "embed", "normalized"]

_NORM_EPS = 1e-12  # torch.nn.functional.normalize's


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    index: int  # position in the input
    embedding: np.ndarray  # f32[D]
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache ("last" pooling only)
    weight_version: int = 0  # the LLM's weight_version it was computed with (LLM.update_params bumps it)


def normalized(vector: np.ndarray) -> np.ndarray:
    """f32[D] divided by its L2 norm (at least 1e-12), computed in f32 as torch's F.normalize does."""
    vector = np.asarray(vector, np.float32)
    return vector / np.maximum(np.linalg.norm(vector), np.float32(_NORM_EPS))


def embed(llm, prompts: list, *, pooling: str = "last", normalize: bool = True) -> list[EmbeddingOutput]:
    """One EmbeddingOutput per prompt of the list (text or token ids), in input order; see the module docstring.

    Every prompt is checked first (LLM.encode: a bad one raises naming its index), and one longer than
    max_context is an error (no silent truncation)."""
    if pooling not in POOLINGS:
        raise FieldError("pooling", f"must be one of {POOLINGS}, got {pooling!r}")
    check_bool("normalize", normalize)
    ids = [_encoded(llm, prompt, i) for i, prompt in enumerate(prompts)]
    if not ids:
        return []
    params = SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling)
    return [_output(output, normalize) for output in llm.generate(ids, params, progress=False)]


def _output(output, normalize: bool) -> EmbeddingOutput:
    if output.embedding is None:  # an aborted or failed request: nothing pooled
        raise RuntimeError(f"embedding of prompt {output.index} failed: {output.error or output.finish_reason}")
    vector = normalized(output.embedding) if normalize else output.embedding
    return EmbeddingOutput(output.index, vector, output.num_prompt_tokens, output.num_cached_tokens, output.weight_version)


def _encoded(llm, prompt, index: int) -> list[int]:
    try:
        ids = llm.encode(prompt)
        if not ids:
            raise FieldError("prompt", "has no tokens")
        if len(ids) > llm.engine_config.max_context:
            raise FieldError("prompt", f"has {len(ids)} tokens, more than max_context ({llm.engine_config.max_context})")
    except ValueError as e:
        raise ValueError(f"prompt {index}: {e}") from None
    return ids
