"""Shared fixtures: the real default model and tokenizer are loaded once per session."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def smollm2():
    """(ModelConfig, Params) of the embedded SmolLM2-135M-Instruct, f32, context 2048."""
    from jaxinfer.loading import load_model

    return load_model(None, dtype="float32", max_context=2048)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_llama():
    """(ModelConfig, Params) of the random tiny Llama that transformers saved as safetensors."""
    from jaxinfer.loading import load_model

    return load_model(FIXTURES / "tiny_llama", dtype="float32")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
    """One persistent XLA cache for the whole session, so engines with the same buckets compile once."""
    return str(tmp_path_factory.mktemp("xla_cache"))
