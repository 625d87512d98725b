"""LLM.score under tensor parallelism (2 simulated CPU devices) and in deterministic mode: the same scores as
one device (within 1e-4), and in deterministic mode bit for bit the same whether a pair is scored alone or
among others, with the context shared through the prefix cache either way. Runs in a subprocess (this file
as a script) with XLA_FLAGS=--xla_force_host_platform_device_count=2, so the suite keeps its one device."""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = "The history of the city begins with a small fishing village on the river, where traders stopped on their way to the sea. " * 2
CONTINUATIONS = [" It grew quickly.", " Nobody lived there.", " The river", " Fish were plentiful and cheap in the markets."]


@pytest.mark.slow
def test_score_is_the_same_under_tensor_parallelism_and_bitwise_in_deterministic_mode(tiny_chat_model):
    from two_devices import run_on_two_devices  # the worker runs this file as a script, without tests/ on its path

    report = run_on_two_devices(__file__, str(tiny_chat_model))
    one, two = np.asarray(report["tp1"]["logprobs"]), np.asarray(report["tp2"]["logprobs"])
    assert np.abs(one - two).max() <= 1e-4, (one, two)
    alone, among = report["deterministic_alone"], report["deterministic_among"]
    assert alone["token_logprobs"][0] == among["token_logprobs"][0]  # bitwise, whatever else runs
    assert all(cached > 0 for cached in among["num_cached_tokens"])  # the context came from the prefix cache
    assert np.abs(np.asarray(among["logprobs"]) - one).max() <= 1e-4


def _worker(model: str) -> dict:
    from jaxinfer.api import LLM

    limits = dict(dtype="float32", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=32, attention_impl="reference",
                  compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_scoring_xla_"))

    def run(llm, continuations):
        results = llm.score(CONTEXT, continuations)
        return {"logprobs": [r.logprob for r in results], "token_logprobs": [r.token_logprobs for r in results],
                "num_cached_tokens": [r.num_cached_tokens for r in results]}

    narrow = dict(decode_batch_buckets=(4,), decode_page_buckets=(8,))  # 2 programs at each TP, not the full tables' 11
    report = {f"tp{tp}": run(LLM(model, tensor_parallel=tp, **limits, **narrow), CONTINUATIONS) for tp in (1, 2)}
    deterministic = LLM(model, deterministic=True, **limits)
    report["deterministic_among"] = run(deterministic, CONTINUATIONS)
    deterministic.reset_prefix_cache()
    report["deterministic_alone"] = run(deterministic, CONTINUATIONS[:1])
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_worker(sys.argv[1])))
