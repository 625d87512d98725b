"""What the tests that write or read GGUFs share: finishing a gguf-py writer, adding a weight quantized as a
test file asks, and the folder of llama.cpp's vocabulary GGUFs (fetched from the package index on first use).
"""

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def finish(writer: gguf.GGUFWriter) -> None:
    """Header, key-values and tensors written, the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_weight(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """A matrix quantized to `qtype` by gguf-py; a vector (a norm, a bias) or an F32 file's matrix as float32."""
    value = np.asarray(value, np.float32)
    if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, value)


def llama_cpp_models() -> Path:
    """build/llama-cpp-python/models (or $JAXINFER_LLAMA_CPP_MODELS, used as it is): llama.cpp's vocabulary GGUFs and
    reference tokenizations from the llama-cpp-python sdist. The fetcher downloads and extracts them once, and
    re-extracts when its list of vocabularies changed; when they are up to date it only checks a stamp."""
    given = os.environ.get("JAXINFER_LLAMA_CPP_MODELS")
    folder = Path(given) if given else ROOT / "build" / "llama-cpp-python" / "models"
    if not given or not (folder / ".complete").is_file():
        spec = importlib.util.spec_from_file_location("fetch_llama_cpp_models", ROOT / "tests" / "reference" / "fetch_llama_cpp_models.py")
        fetch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fetch)
        fetch.fetch(folder.parent)
    return folder
