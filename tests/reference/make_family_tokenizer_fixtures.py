"""Reference renderings and ids for the Gemma tokenizer, committed as tests/fixtures/gemma_tokenizer.json.

Run in the reference environment (transformers; llama-cpp-python for the ids, from `make setup-bench`):

    .venv-ref/bin/python tests/reference/make_family_tokenizer_fixtures.py --out tests/fixtures

Writes OUT/gemma_tokenizer.json:
  chat       the Gemma chat templates (the one in ggml-vocab-gemma-4.gguf's metadata, and llama.cpp's
             models/templates copies of Gemma 4 and Gemma 2) rendered by transformers'
             render_jinja_template on the conversations make_fixtures.py uses, with and without the
             generation prompt, bos/eos text from the Gemma 4 vocab GGUF
  llama_cpp  ids llama-cpp-python gives on ggml-vocab-gemma-4.gguf for make_llama_cpp_fixtures.py's
             TEXTS (special=False, without and with BOS) and a chat-formatted text (special=True);
             left out, with a message, when llama_cpp is not installed
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from tests.reference.make_fixtures import CHAT_CONVERSATIONS, CHAT_DATE, SDIST_MODELS  # noqa: E402
from tests.reference.make_llama_cpp_fixtures import TEXTS  # noqa: E402

VOCAB = SDIST_MODELS / "ggml-vocab-gemma-4.gguf"
TEMPLATE_FILES = {"gemma-4-31B-it": "google-gemma-4-31B-it.jinja", "gemma-2-2b-it": "google-gemma-2-2b-it.jinja"}
CHAT_TEXT = "<bos><|turn>user\nHello there<turn|>\n<|turn>model\n"


def _metadata() -> tuple[str, str, str]:
    """(chat template, bos text, eos text) of the Gemma 4 vocab GGUF."""
    import gguf

    reader = gguf.GGUFReader(VOCAB)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos, eos = (tokens[int(reader.fields[f"tokenizer.ggml.{k}_token_id"].contents())] for k in ("bos", "eos"))
    return reader.fields["tokenizer.chat_template"].contents(), bos, eos


def chat_renderings() -> dict:
    from transformers.utils.chat_template_utils import render_jinja_template

    gguf_template, bos, eos = _metadata()
    templates = {"gguf-gemma-4": gguf_template}
    templates |= {name: (SDIST_MODELS / "templates" / file).read_text(encoding="utf-8") for name, file in TEMPLATE_FILES.items()}
    cases = []
    for name, template in templates.items():
        for c, messages in enumerate(CHAT_CONVERSATIONS):
            for generation_prompt in (True, False):
                case = {"template": name, "conversation": c, "add_generation_prompt": generation_prompt}
                try:
                    case["rendered"] = render_jinja_template(
                        conversations=[messages], chat_template=template, add_generation_prompt=generation_prompt,
                        bos_token=bos, eos_token=eos, date_string=CHAT_DATE,
                    )[0][0]
                except Exception as e:  # a conversation the template refuses: ours must refuse it too
                    case["error"] = str(e)
                cases.append(case)
    return {"bos_token": bos, "eos_token": eos, "date_string": CHAT_DATE, "conversations": list(CHAT_CONVERSATIONS),
            "templates": templates, "cases": cases}


def llama_cpp_ids() -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        print("  llama_cpp is not installed (make setup-bench): the llama_cpp part is left out", flush=True)
        return None
    model = llama_cpp.Llama(model_path=str(VOCAB), vocab_only=True, verbose=False)
    ids = {name: {"ids": model.tokenize(text.encode(), add_bos=False, special=False),
                  "ids_with_bos": model.tokenize(text.encode(), add_bos=True, special=False)} for name, text in TEXTS.items()}
    chat = model.tokenize(CHAT_TEXT.encode(), add_bos=False, special=True)
    return {"llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "ids": ids, "chat_text": CHAT_TEXT, "chat_ids": chat}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    out = parser.parse_args(argv).out
    doc = {"chat": chat_renderings()}
    if (ids := llama_cpp_ids()) is not None:
        doc["llama_cpp"] = ids
    (out / "gemma_tokenizer.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out / 'gemma_tokenizer.json'}: {sorted(doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
