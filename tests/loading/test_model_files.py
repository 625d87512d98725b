"""Model paths and the one GGUF reader: a path that is neither a file nor a folder is refused at once (a FIFO
would block the load forever), and the tokenizer reads GGUF metadata through the same reader as the weights."""

import os
import subprocess
import sys

import pytest

from jaxinfer.loading import loading, model_files, tokenizer
from jaxinfer.loading.model_files import ModelLoadError, resolve_model_path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_as_the_model_is_refused_naming_it(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="neither a file nor a folder.*model.gguf"):
        resolve_model_path(fifo)
    # through the CLI, in a child with a deadline: before the fix `info` blocked forever opening the FIFO
    result = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "info", "--model", str(fifo)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "neither a file nor a folder" in result.stderr, result.stderr[-2000:]


def test_the_weights_and_the_tokenizer_share_one_gguf_reader():
    assert loading.open_gguf is model_files.open_gguf and tokenizer.open_gguf is model_files.open_gguf
    assert loading.ModelLoadError is ModelLoadError
    reader = model_files.open_gguf(model_files.default_model_path())
    assert model_files.gguf_field(reader, "general.architecture") == "llama"
    assert model_files.gguf_field(reader, "no.such.key", default=7) == 7
