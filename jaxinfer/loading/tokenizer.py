"""Tokenizers built from GGUF metadata or a Hugging Face tokenizer.json, and chat templates.

GGUF vocabularies are rebuilt with the `tokenizers` library, following llama.cpp's tokenizer:
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE from the token list and merges, split first by the
  pre-tokenizer named in `tokenizer.ggml.pre` (an unknown name is an error naming it);
- `"llama"`: SentencePiece BPE. Merges rank by the score of the merged piece (llama.cpp merges the
  highest-scoring pair first), spaces become `▁` with one prefixed to each text fragment
  (`add_space_prefix`), and characters outside the vocabulary fall back to `<0xXX>` byte tokens;
- `"gemma4"`: BPE over raw UTF-8 (no byte-level alphabet) with ranked merges, as llama.cpp's
  LLAMA_VOCAB_PRE_TYPE_GEMMA4: spaces become `▁` with no prefix, the text is cut into runs of newlines and
  runs of anything else, and a character outside the vocabulary falls back to `<0xXX>` byte tokens.
Control tokens are special: matched whole in text when `parse_special` (llama.cpp's `special=True`);
user-defined tokens are always matched. Chat templates are the model's own Jinja text, rendered in a
sandbox with the globals transformers provides. The engine never sees text: it takes and returns ids.
"""

import dataclasses
import datetime
import functools
import json
import secrets
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from jaxinfer.loading.model_files import gguf_field, open_gguf, resolve_model_path

# Split patterns of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types (2 unknown, 6 byte: left to the BPE model)
_SPACE = "\u2581"  # SentencePiece's visible space, ▁
GGUF_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3", "smaug-bpe", "qwen2")


def _split_then_bytes(pattern: str):
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pre_tokenizer(name: str):
    if name == "smollm":  # every digit on its own, then GPT-2 splitting
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if name in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("llama-bpe", "llama3", "smaug-bpe"):
        return _split_then_bytes(_LLAMA3_PATTERN)
    if name == "qwen2":
        return _split_then_bytes(_QWEN2_PATTERN)
    raise ValueError(f"unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: {', '.join(GGUF_PRE_TOKENIZERS)}")


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

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can cover: its longest vocabulary string (added tokens
        included), in characters. A byte-level string has a character per byte, SentencePiece's one per
        character (`▁` for a space) and a byte-fallback `<0xXX>` six for one byte, so each covers at most that
        many characters of the text as the normalizer left it."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; control tokens written in the text are matched only with `parse_special`."""
        self.tokenizer.encode_special_tokens = not parse_special
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, continue_final_message: bool = False, **variables) -> str:
        """The chat template rendered as transformers renders it (trim_blocks, lstrip_blocks, loop controls,
        `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII); `variables` (for example
        `date_string`, or Qwen3's `enable_thinking`: vLLM's chat_template_kwargs) reach the template too.
        `bos_token` is in the text only where the template puts it. `continue_final_message`: the text
        ends with the last message's content, so the model continues it (as transformers and vLLM do)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: set add_generation_prompt false to continue the last message")
        template = _template_environment().from_string(self.chat_template)
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_id),
                **variables,
            )
        except jinja2.TemplateError as e:  # a message field the template reads as another shape (a tool call without its function, say)
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        if not continue_final_message:
            return text
        final = messages[-1]["content"].strip()
        end = text.rfind(final)
        if not final or end < 0:
            raise ValueError("continue_final_message: the template does not render the last message's content as given")
        return text[: end + len(final)]

    def encode_chat(self, messages: list[dict], *, parse_special_content: bool = False, **variables) -> list[int]:
        """Token ids of the rendered chat. The template's own control tokens are always special; control-
        token text inside a message's content is plain text unless `parse_special_content`, so content
        cannot open a new role. Where no content holds control-token text this is exactly
        `encode(apply_chat_template(messages))`. A template that writes the BOS token itself (Llama 3,
        Gemma) gets no second one: transformers and llama.cpp's chat code give one BOS there too."""
        text = self.apply_chat_template(messages, **variables)
        bos_text = self._token_text(self.bos_id)
        add_bos = self.add_bos and not (bos_text and text.startswith(bos_text))
        if parse_special_content or not any(self._control_text_in(m["content"]) for m in messages):
            return self.encode(text, add_bos=add_bos)
        pieces = self._split_at_contents(messages, **variables)
        ids = self.encode(pieces[0], add_bos=add_bos)
        for i, piece in enumerate(pieces[1:], start=1):  # pieces[1::2] are contents, the rest template text
            ids += self.encode(piece, add_bos=False, parse_special=i % 2 == 0)
        return ids

    def _control_text_in(self, text: str) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special and t.content in text]

    def _split_at_contents(self, messages: list[dict], **variables) -> list[str]:
        """The rendered chat cut into template text and content text, alternately: the template is
        rendered with a marker in place of each content (keeping its outer whitespace, so templates that
        trim content trim it alike), and the marker must come out whole and in order."""
        markers = [f"\x1ejaxinfer-content-{i}-{secrets.token_hex(8)}\x1e" for i in range(len(messages))]
        cores = [m["content"].strip() for m in messages]
        stand_ins = [{**m, "content": m["content"].replace(core, marker, 1) if core else marker} for m, core, marker in zip(messages, cores, markers)]
        text = self.apply_chat_template(stand_ins, **variables)
        pieces = []
        for i, (marker, core) in enumerate(zip(markers, cores)):
            before, found, text = text.partition(marker)
            if not found or marker in text:
                control = ", ".join(self._control_text_in(messages[i]["content"]))
                raise ValueError(f"messages[{i}].content holds control-token text ({control}) and this chat template changes content, so it cannot be kept as plain text; remove it")
            pieces += [before, core]
        return pieces + [text]

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(token_id) or "")


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def normalize_messages(messages) -> list[dict]:
    """Messages whose content is a list of OpenAI text parts ({"type": "text", "text": ...}) get that
    text joined by newlines, as vLLM joins it; any other part is an error naming it."""
    if not isinstance(messages, list):
        return messages
    normalized = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}, got {part!r} (only text is supported)")
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        normalized.append(message)
    return normalized


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be an object with string 'role' and 'content', got {message!r}")


def from_gguf_reader(reader) -> TextTokenizer:
    """Rebuild the tokenizer stored in GGUF metadata (`tokenizer.ggml.*`)."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError("the GGUF has no tokenizer (no tokenizer.ggml.model); pass token ids instead of text")
    if kind not in _GGUF_BUILDERS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), llama (SentencePiece), gemma4 (BPE over UTF-8)")
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    tokenizer = _GGUF_BUILDERS[kind](reader, tokens, types)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return TextTokenizer(
        tokenizer=tokenizer,
        bos_id=_optional_int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=_optional_int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        add_bos=_add_bos(reader, kind),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )


def _add_bos(reader, kind: str) -> bool:
    """The GGUF's add_bos_token, else llama.cpp's default; Gemma 4 always adds BOS (llama.cpp overrides a
    false key, as the model needs it)."""
    return kind == "gemma4" or bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", _default_add_bos(reader, kind)))


def _default_add_bos(reader, kind: str) -> bool:
    """llama.cpp's default when the GGUF has no add_bos_token key: SentencePiece and Llama 3 add BOS."""
    return kind == "llama" or gguf_field(reader, "tokenizer.ggml.pre", "default") in ("llama-bpe", "llama3")


def _byte_level_bpe(reader, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = str(gguf_field(reader, "tokenizer.ggml.pre", "default"))
    pre_tokenizer = _pre_tokenizer(pre)
    # Llama 3 emits a pre-token that is itself in the vocabulary without merging (llama.cpp ignore_merges).
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_gguf_merges(reader), ignore_merges=pre in ("llama-bpe", "llama3"))
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, the merge of the best-scoring
    merged piece first (ties: lower ids first). This is the order llama.cpp's SPM tokenizer merges in."""
    ids = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for merged_id, piece in enumerate(tokens):
        if types[merged_id] not in (_NORMAL, _USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                candidates.append((-scores[merged_id], merged_id, ids[left], ids[right], left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def _sentencepiece_bpe(reader, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = [float(s) for s in gguf_field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))]
    unknown = _optional_int(gguf_field(reader, "tokenizer.ggml.unknown_token_id"))
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=_sentencepiece_merges(tokens, scores, types),
        unk_token=None if unknown is None else tokens[unknown], byte_fallback=True, fuse_unk=True,
    )
    tokenizer = Tokenizer(bpe)
    space_prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if space_prefix else escape
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tokenizer


def _gguf_merges(reader) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs, in rank order; split at the first space after the first
    character, as llama.cpp splits them (a pair's left piece may itself start with a space)."""
    pairs = []
    for merge in gguf_field(reader, "tokenizer.ggml.merges"):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(f"malformed tokenizer.ggml.merges entry {merge!r}: no space between its two pieces")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _gemma4_bpe(reader, tokens: list[str], types: list[int]) -> Tokenizer:
    """Gemma 4's BPE (llama.cpp `tokenizer.ggml.model == "gemma4"`). llama.cpp takes a run of newlines
    that is itself a token whole, without merging; the vocabulary's merges build every such run into
    that same token (a test checks each), so plain ranked merges give llama.cpp's ids."""
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_gguf_merges(reader), byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)  # no space prefix: llama.cpp BPE sets none
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe, "gemma4": _gemma4_bpe}


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def from_hf_folder(folder: Path) -> TextTokenizer:
    """tokenizer.json plus tokenizer_config.json (special tokens, chat template) from a HF folder."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no tokenizer.json; pass token ids instead of text for this model")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file (an interrupted download)
        raise ValueError(f"{path}: cannot read the tokenizer: {e}") from None
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: cannot read it: {e}") from None

    def token_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.token_to_id(token) if token else None

    bos_id = token_id("bos_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # transformers then leaves it to tokenizer.json's post-processor (Llama 3's puts <|begin_of_text|> first)
        add_bos = bos_id is not None and tokenizer.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return TextTokenizer(
        tokenizer=tokenizer,
        bos_id=bos_id,
        eos_id=token_id("eos_token"),
        add_bos=bool(add_bos),
        chat_template=_chat_template(folder, config),
    )


def _chat_template(folder: Path, config: dict) -> str | None:
    """A folder's chat template, as transformers reads it: chat_template.jinja (where transformers now saves it) first,
    else tokenizer_config.json's chat_template, a string or a list of named templates (the one named 'default')."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template is a list of named templates without one named 'default' ({sorted(map(str, named))})")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string, got {type(template).__name__}")
    return template


def load_tokenizer(model: str | Path | None = None) -> TextTokenizer:
    """Tokenizer for a GGUF file, a HF folder, or the default model (None)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return from_hf_folder(path)
    reader = open_gguf(path)
    try:
        return from_gguf_reader(reader)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # damaged metadata (a list shorter than the tokens, a bad merge): the tokenizers library's own errors
        raise ValueError(f"{path}: the GGUF's tokenizer metadata cannot be read ({type(e).__name__}: {e})") from None


def missing_tokenizer(model: str | Path | None = None) -> str | None:
    """Why a model has no tokenizer ('no tokenizer.json' in a Hugging Face folder, 'no tokenizer.ggml metadata' in a
    GGUF), read from metadata without building one; None when it has one. Such a model runs on token ids."""
    path = resolve_model_path(model)
    if path.is_dir():
        return None if (path / "tokenizer.json").is_file() else "no tokenizer.json"
    return None if gguf_field(open_gguf(path), "tokenizer.ggml.model") is not None else "no tokenizer.ggml metadata"


def describe_tokenizer(model: str | Path | None = None) -> str:
    """The tokenizer kind of a model in words (for `jaxinfer info`), read from metadata without building it."""
    path = resolve_model_path(model)
    if (missing := missing_tokenizer(path)) is not None:
        return f"none ({missing})"
    if path.is_dir():
        kind = json.loads((path / "tokenizer.json").read_text(encoding="utf-8")).get("model", {}).get("type", "?")
        return f"tokenizer.json ({kind})"
    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    size = len(reader.fields["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in reader.fields else 0
    names = {"llama": "SentencePiece BPE", "gemma4": "Gemma 4 BPE over UTF-8", "gpt2": f"byte-level BPE, pre-tokenizer {gguf_field(reader, 'tokenizer.ggml.pre', 'default')}"}
    return f"{names.get(kind, kind)} (GGUF tokenizer.ggml.model={kind}, {size} tokens)"


class MissingTokenizer:
    """Stands in for the tokenizer of a model that has none (a Hugging Face folder without tokenizer.json, the usual
    tiny random test model; a GGUF without tokenizer metadata):
    prompts are token ids, outputs carry the ids with empty text and never stop at an EOS, and whatever needs
    text (a text prompt, a chat, stop strings' or bad words' text, a grammar) raises an error naming the model."""

    bos_id = eos_id = chat_template = None
    add_bos, max_token_chars, vocab_size = False, 1, 0

    def __init__(self, model, why: str = "no tokenizer.json"):
        self.error = f"{model} has no tokenizer ({why}), so this model takes token ids, not text"

    def encode(self, *args, **kwargs):
        raise ValueError(self.error)

    encode_chat = apply_chat_template = encode

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return ""

    @property
    def tokenizer(self):
        raise AttributeError(self.error)


def tokenizer_or_missing(model: str | Path | None = None) -> "TextTokenizer | MissingTokenizer":
    """The model's tokenizer, or a MissingTokenizer for a model without one (missing_tokenizer): LLM's."""
    path = resolve_model_path(model)
    missing = missing_tokenizer(path)
    return load_tokenizer(path) if missing is None else MissingTokenizer(path, missing)
