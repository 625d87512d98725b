"""A one-off check (not a test: ~2 minutes of CPU): jaxinfer's SentencePiece path without a space prefix, which
Gemma 2/3 GGUFs use (tokenizer.ggml.model "llama", add_space_prefix false), against llama.cpp itself.

The sdist has no Gemma 3 vocabulary GGUF, so this writes one in Gemma 3's shape from ggml-vocab-gemma-4.gguf's
262,144 tokens and types: each piece scored by minus the rank of the merge that makes it (that file's scores are
all -1000, which would leave SentencePiece nothing but ties). llama-cpp-python tokenizes llama.cpp's Gemma 4 .inp
texts and make_llama_cpp_fixtures' varied texts with it; jaxinfer's tokenizer of the same file must give the same
ids. Run in the benchmark environment (llama-cpp-python, `make setup-bench`):

    .venv-ref/bin/python tests/reference/check_gemma3_style_tokenizer.py

Result on 2026-12-05 (llama-cpp-python 0.3.36): 0 of 49 texts differ.
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MODELS = ROOT / "build" / "llama-cpp-python" / "models"


def write_gemma3_style_vocab(path: Path) -> None:
    import gguf

    source = gguf.GGUFReader(MODELS / "ggml-vocab-gemma-4.gguf")
    field = lambda key: source.fields[key].contents()  # noqa: E731
    tokens, rank = field("tokenizer.ggml.tokens"), {}
    for i, merge in enumerate(field("tokenizer.ggml.merges")):
        cut = merge.find(" ", 1)
        rank.setdefault(merge[:cut] + merge[cut + 1 :], i)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(rank.get(t, 1e6)) for t in tokens])
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    for add, token_id in ((writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1), (writer.add_unk_token_id, 3), (writer.add_pad_token_id, 0)):
        add(token_id)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    import llama_cpp

    from jaxinfer.loading.tokenizer import load_tokenizer
    from tests.reference.make_llama_cpp_fixtures import TEXTS

    texts = [t for t in (MODELS / "ggml-vocab-gemma-4.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if t]
    texts += list(TEXTS.values())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gemma3-style-vocab.gguf"
        write_gemma3_style_vocab(path)
        reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        ours = load_tokenizer(path)
        wrong = [t for t in texts if ours.encode(t, add_bos=False, parse_special=False) != reference.tokenize(t.encode(), add_bos=False, special=False)]
    print(f"{len(wrong)} of {len(texts)} texts differ from llama-cpp-python {llama_cpp.__version__}" + (f"; first {wrong[0]!r}" if wrong else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
