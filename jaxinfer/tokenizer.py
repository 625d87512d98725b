"""Tokenizers built from GGUF metadata or a Hugging Face tokenizer.json, and chat templates.

GGUF byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are rebuilt with the `tokenizers`
library: token list, merges, token types (control tokens become special, matched in text as llama.cpp
does with `special=True`), and the pre-tokenizer named by `tokenizer.ggml.pre`. Chat templates are the
model's own Jinja text, rendered in a sandbox. The engine never sees text: it takes and returns ids.
"""

import dataclasses
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# Split patterns of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are matched whole in text


def _pre_tokenizer(name: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if name == "smollm":  # every digit on its own, then GPT-2 splitting
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if name in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer {name!r}; use a Hugging Face folder with tokenizer.json")


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """Text <-> ids, plus the model's special ids and chat template."""

    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        check_messages(messages)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_id),
            eos_token=self._token_text(self.eos_id),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be an object with string 'role' and 'content', got {message!r}")


def from_gguf_reader(reader) -> TextTokenizer:
    """Rebuild the tokenizer stored in GGUF metadata."""
    from jaxinfer.loading import gguf_field

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is built from GGUF")
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(gguf_field(reader, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)]
    tokenizer.add_special_tokens(specials)
    return TextTokenizer(
        tokenizer=tokenizer,
        bos_id=_optional_int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=_optional_int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def from_hf_folder(folder: Path) -> TextTokenizer:
    """tokenizer.json plus tokenizer_config.json (special tokens, chat template) from a HF folder."""
    import json

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no tokenizer.json; pass token ids instead of text for this model")
    tokenizer = Tokenizer.from_file(str(path))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    def token_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.token_to_id(token) if token else None

    return TextTokenizer(
        tokenizer=tokenizer,
        bos_id=token_id("bos_token"),
        eos_id=token_id("eos_token"),
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template=config.get("chat_template"),
    )


def load_tokenizer(model: str | Path | None = None) -> TextTokenizer:
    """Tokenizer for a GGUF file, a HF folder, or the default model (None)."""
    from jaxinfer import loading

    path = loading.resolve_model_path(model)
    if path.is_dir():
        return from_hf_folder(path)
    return from_gguf_reader(loading.open_gguf(path))
