"""Reference ids and logits from llama.cpp itself (llama-cpp-python 0.3.36), committed as fixtures.

Needs the benchmark environment (`make setup-bench`: .venv-ref plus llama-cpp-python built from source,
about 12 minutes on 2 cores), so it is not part of `make test`; its output is committed:

    .venv-ref/bin/python tests/reference/make_llama_cpp_fixtures.py --out tests/fixtures

Writes into OUT:
  llama_cpp_tokenization.json  for each vocabulary GGUF of llama.cpp (fetched by fetch_llama_cpp_models.py),
                               the ids llama.cpp gives for TEXTS with and without BOS (special=False), and
                               for a chat-formatted text with special=True
  llama_cpp_logits.npz         llama.cpp's logits (f32 KV cache) on the tiny family GGUFs that
                               tests/gguf_convert.py writes, for the sequences of each tiny_<family>
                               fixture: keys <family>_s<i>_logits, float32[T, vocab]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent.parent / "build" / "llama-cpp-python" / "models"
VOCABS = ("llama-spm", "llama-bpe", "qwen2", "phi-3")

# A longer varied text: code, prose, unicode of several scripts, emoji (multi-codepoint), digits and
# numbers of every length, whitespace runs of spaces, tabs and newlines, apostrophes, URLs, markup.
LONG_TEXT = (
    "def tokenize(text: str, *, add_bos: bool = True) -> list[int]:\n"
    "    \"\"\"Split `text` into ids.\"\"\"\n"
    "\tif not text:\n\t\treturn []  # nothing to do\n"
    "    return [vocab.get(piece, UNK) for piece in text.split()]\n\n\n"
    "The year 2026 has 365 days; 3.14159 ≈ π, 1,299.99 € and 0x1F600 = 128512. 1234567890 000 00 0\n"
    "Café crème, naïve façade, Ångström, straße — “quotes” ‘single’ «guillemets» … ¿Sí? ¡No!\n"
    "Здравствуйте, мир! Γειά σου κόσμε. 東京は日本の首都です。北京欢迎你。 서울 특별시. नमस्ते दुनिया. "
    "مرحبا بالعالم. שלום עולם. ภาษาไทย ກາ ពិសេស\n"
    "Emoji: 🙂🚀🦙 👩‍👩‍👧‍👦 🏳️‍🌈 ✅❌ 1️⃣ — and math ∑ᵢ xᵢ² ≤ ∞, ∂f/∂x, √2, ½ ¾.\n"
    "   three leading spaces,\t\ttwo tabs,      six spaces\n\n\n\nfour newlines \r\n crlf\n"
    "I'm sure they'll say it's 'fine' — you've been told; we'd KNOW IT'S OK, DON'T worry.\n"
    "<html><body class=\"x\">&amp; <b>bold</b></body></html> https://example.com/a?b=1&c=%20 user@host.org\n"
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE __dunder__ $var @decorator #tag ~/path/to/file.txt\n"
    "    "
)
TEXTS = {
    "long": LONG_TEXT,
    "code": "for (int i = 0; i < 10; ++i) {\n    printf(\"%d\\n\", i * i);\n}\n",
    "spaces": " \t \n  x  \n\n   ",
    "digits": "0 1 12 123 1234 12345 123456 1234567 3.0 -4e10 2**31-1",
}
# Control tokens written in the text, tokenized with special=True. Phi-3 is left out: llama.cpp strips the
# whitespace after its chat tokens (an rstrip attribute it sets for that model), which jaxinfer does not.
CHAT_TEXTS = {
    "llama-spm": "<s>[INST] Hello there [/INST] Hi!</s>",
    "llama-bpe": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>",
    "qwen2": "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
}


def tokenization(models: Path) -> dict:
    import llama_cpp

    doc = {"llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "chat_texts": CHAT_TEXTS, "vocabs": {}}
    for vocab in VOCABS:
        model = llama_cpp.Llama(model_path=str(models / f"ggml-vocab-{vocab}.gguf"), vocab_only=True, verbose=False)
        entry = {name: {"ids": model.tokenize(text.encode(), add_bos=False, special=False),
                        "ids_with_bos": model.tokenize(text.encode(), add_bos=True, special=False)}
                 for name, text in TEXTS.items()}
        if vocab in CHAT_TEXTS:
            entry["chat"] = {"ids": model.tokenize(CHAT_TEXTS[vocab].encode(), add_bos=False, special=True)}
        doc["vocabs"][vocab] = entry
        print(f"  {vocab}: {len(entry['long']['ids'])} ids for the long text", flush=True)
    return doc


LOGIT_FAMILIES = ("tiny_llama", "tiny_llama3", "tiny_llama_linear", "tiny_mistral", "tiny_qwen2", "tiny_qwen3")


def family_logits(fixtures: Path, work: Path) -> dict[str, np.ndarray]:
    """llama.cpp's logits on the tiny family GGUFs (tests/gguf_convert.py), f32 KV cache, with the
    relative error norm against the transformers fixtures printed for each sequence."""
    import llama_cpp

    sys.path.insert(0, str(HERE.parent))
    import gguf_convert

    arrays = {}
    for name in LOGIT_FAMILIES:
        path = gguf_convert.convert(fixtures / name, work / f"{name}.gguf", no_vocab=True)
        model = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                                n_threads=2, type_k=0, type_v=0)  # GGML_TYPE_F32 cache: no f16 rounding of K/V
        reference = np.load(fixtures / f"{name}_reference.npz")
        errors = []
        for s in range(int(reference["num_sequences"])):
            ids, expected = reference[f"s{s}_ids"].tolist(), reference[f"s{s}_logits"].astype(np.float64)
            model.reset()
            model.eval(ids)
            got = np.array(model.scores[: len(ids)], np.float32)  # a copy: the next eval overwrites scores
            arrays[f"{name}_s{s}_logits"] = got
            errors.append(float(np.linalg.norm(got - expected) / np.linalg.norm(expected)))
        print(f"  {name:20s} llama.cpp vs transformers, relative error per sequence: " + ", ".join(f"{e:.2e}" for e in errors), flush=True)
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write llama_cpp_tokenization.json and llama_cpp_logits.npz here")
    parser.add_argument("--models", type=Path, default=MODELS)
    parser.add_argument("--work", type=Path, default=HERE.parent.parent / "build" / "llama_cpp_logits", help="where the GGUFs are written")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    doc = tokenization(args.models)
    (args.out / "llama_cpp_tokenization.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    sys.path.insert(0, str(HERE))
    from make_fixtures import write_npz  # fixed zip timestamps, as for every npz fixture

    write_npz(args.out / "llama_cpp_logits.npz", family_logits(HERE.parent / "fixtures", args.work))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
