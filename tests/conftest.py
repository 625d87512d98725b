"""Shared fixtures: the real default model and tokenizer are loaded once per session; the CPU kernels'
build, which skips the tests that need them where no compiler is found, and fails them under CI=true."""

import collections
import functools
import os
from pathlib import Path

import pytest

# The suite is deterministic and fast: no runtime tuning (jaxinfer/tuning.py), so every "auto" keeps its fixed
# rule (dtype float32, attention.resolve_impl's attention, panels with the CPU attention kernel) and tests
# compare against float32 references. tests/test_tuning.py turns tuning on where it tests it.
os.environ["JAXINFER_TUNE"] = "0"

FIXTURES = Path(__file__).parent / "fixtures"
PAD_BUCKETS = (64, 128, 640)  # padded_logits' widths: 3 compiles a model (the HF fixture prompts are 1 to 601 tokens)


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items) -> None:
    """Files with more `slow` tests first (then files with more tests), each file's tests kept in order and together.
    `make test` hands whole files to 2 workers in this order (`--dist loadfile --no-loadscope-reorder`): the long
    files start early and the short ones fill the end, so the workers finish together. xdist's own order (most tests
    first) puts the files of one or two long multi-process tests last, where one worker can be left running them
    while the other has nothing left to take."""
    num_slow, num_tests = collections.Counter(), collections.Counter()
    for item in items:
        num_tests[_file_of(item)] += 1
        num_slow[_file_of(item)] += item.get_closest_marker("slow") is not None
    first_seen = {file: i for i, file in reversed(list(enumerate(map(_file_of, items))))}
    items.sort(key=lambda item: (-num_slow[_file_of(item)], -num_tests[_file_of(item)], first_seen[_file_of(item)]))


def require_cpu_kernels() -> None:
    """Skips the calling test when the CPU kernels (kernels_cpu: paged attention, the layer matmul and the
    quantized matmul) cannot be built here, for want of a C++ compiler; fails it instead
    under CI=true, where a missing kernel would otherwise leave every engine test on the jnp path unseen."""
    from kernels_cpu import layer_matmul, paged_attention, quant_matmul

    missing = [module.__name__ for module in (paged_attention, layer_matmul, quant_matmul) if not module.available()]
    if not missing:
        return
    reason = f"the CPU kernels {missing} could not be built (no C++ compiler?)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def cpu_kernels() -> None:
    """`require_cpu_kernels` for a test (or a module's pytestmark usefixtures)."""
    require_cpu_kernels()


@functools.cache
def _jitted_forward_logits():
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.forward import forward

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def logits(params, ids, *, cfg):
        return forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)[0][0]  # [T, V]

    return logits


def padded_logits(cfg, params, sequences) -> list:
    """f32 logits [T, V] of each sequence: one forward each with no cache (no pages, no batch), the
    sequence right-padded to a PAD_BUCKETS width so that compiles stay few (causal: no position before
    the pad sees it). One jitted function for every caller, so equal (cfg, width) compile once a session."""
    import jax.numpy as jnp
    import numpy as np

    out = []
    for ids in sequences:
        width = next((b for b in PAD_BUCKETS if b >= len(ids)), len(ids))
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(ids)] = ids
        out.append(np.asarray(_jitted_forward_logits()(params, jnp.asarray(padded), cfg=cfg))[: len(ids)])
    return out


@pytest.fixture(scope="session")
def smollm2():
    """(ModelConfig, Params) of the embedded SmolLM2-135M-Instruct, f32, context 2048."""
    from jaxinfer.loading.loading import load_model

    return load_model(None, dtype="float32", max_context=2048)


@pytest.fixture(scope="session")
def smollm2_fixture_logits(smollm2) -> list:
    """f32 logits [T, V] of the HF fixture prompts (smollm2_reference.npz p{i}_ids, in order), computed
    once a session for test_model_reference (vs HF) and test_quant_model (vs the quantized paths)."""
    import numpy as np

    reference = np.load(FIXTURES / "smollm2_reference.npz")
    sequences = [reference[f"p{i}_ids"].astype(np.int32) for i in range(int(reference["num_prompts"]))]
    return padded_logits(*smollm2, sequences)


# A small engine on the default model: 2 prefill programs (1 row of 64 tokens, tables of 4 / 16 pages)
# and 2 decode programs (4 rows).
SMOLLM2_SMALL_ENGINE = dict(
    max_context=256, page_size=16, max_num_seqs=4, max_prefill_tokens=64, prefill_chunk_buckets=(64,),
    prefill_seq_buckets=(1,), decode_batch_buckets=(4,), decode_page_buckets=(4, 16),
)


# A small engine on tiny_chat_model for the tests of what runs around the engine (the API's validation, batch
# jobs, OpenAI batch files): 2 programs (one 64-token chunk, the 4-row 8-page decode), not the full tables' 16.
# One dict, so the files that use it compile its programs once a session (compile_cache).
TINY_CHAT_ENGINE = dict(
    max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64, prefill_chunk_buckets=(64,),
    decode_batch_buckets=(4,), decode_page_buckets=(8,),
)


@pytest.fixture(scope="session")
def smollm2_llm(compile_cache):
    """LLM(None) (the default model, f32) on SMOLLM2_SMALL_ENGINE, warmed once a session: test_api's
    model and the dense side of test_quant_model's gguf engine check."""
    from jaxinfer.api import LLM

    return LLM(None, compilation_cache_dir=compile_cache, **SMOLLM2_SMALL_ENGINE)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from jaxinfer.loading.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_llama():
    """(ModelConfig, Params) of the random tiny Llama that transformers saved as safetensors."""
    from jaxinfer.loading.loading import load_model

    return load_model(FIXTURES / "tiny_llama", dtype="float32")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
    """One persistent XLA cache for the whole session, so engines with the same buckets compile once."""
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer):
    """A Hugging Face folder: a random tiny Llama with SmolLM2's real vocabulary, tokenizer and chat
    template, so that text jobs (the batch CLI, LLM.generate) run fast on real tokenization."""
    from jaxinfer.loading.tiny_model import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_chat_model"), smollm2_tokenizer, max_position=512)
