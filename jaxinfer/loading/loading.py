"""Model files -> (ModelConfig, Params): GGUF (any llama.cpp quantization) and Hugging Face folders.

Both loaders first produce host arrays in Hugging Face's `[out, in]` layout and names, then share one
assembly step (`_assemble`) that brings them into the Params layout. Which tensors exist, their HF and
GGUF names and each one's transform from the file's layout are read from the weight table
(params.WEIGHTS), never restated here. GGUF weights are
dequantized with the `gguf` package. For the `llama` architecture (Llama and Mistral), llama.cpp's
converter permutes the rows of Q and K so that rotary pairs are adjacent; `_unpermute_rotary` undoes that
so both paths feed the same rotate-half RoPE. Its qwen2/qwen3 converters write Q and K unpermuted.
Llama 3 rope scaling reaches a GGUF as the `rope_freqs.weight` tensor (one divisor per frequency).
Errors about the file itself are `ModelLoadError`s whose message names the file and the problem.

`quantization` (see params.weight_format for which tensors): None loads dense weights in `dtype`;
"gguf" keeps a GGUF file's own blocks (`_kept_gguf_weights`: from_gguf, the Q/K permutation undone on the
codes, stacked per layer; F16 / BF16 tensors as 16-bit "f16" / "bf16", also where "auto" resolves to dense), falling back to dense for a weight of a type quant.py does not keep or whose
layers mix types; "int8" / "int4" quantize the dense f32 weights of either file kind after loading.
"""

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np

from jaxinfer.model import params as params_lib
from jaxinfer.model import quant
from jaxinfer.config import ModelConfig, RopeScaling, from_hf_config
from jaxinfer.options import DEFAULT_INT4_GROUP_SIZE, check_quantization
from jaxinfer.loading import kept_blocks
from jaxinfer.loading.model_files import ModelLoadError, default_model_path, gguf_field, open_gguf, resolve_model_path  # noqa: F401
from jaxinfer.model.params import Params, from_numpy, quantize_arrays, weight_format, weight_spec

log = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")  # Mistral converts to "llama"
# llama.cpp fixes these per architecture, not in metadata: Gemma's GeGLU (tanh GELU), its embedding scaled by
# sqrt(embed_dim), its sliding-layer pattern (every n-th layer full; overridden by attention.sliding_window_pattern)
# and local rope base (overridden by rope.freq_base_swa); the GGUF norms already hold 1 + w.
_GGUF_GEMMA = {"gemma2": dict(pattern=2, local_theta=None), "gemma3": dict(pattern=6, local_theta=10_000.0)}
_GGUF_PERMUTED_QK = ("llama",)  # architectures whose Q/K rows llama.cpp's converter permutes


def load_model(
    model: str | Path | None = None, *, dtype: str = "float32", max_context: int | None = None,
    kquant_panels: bool = False,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> tuple[ModelConfig, Params]:
    """Load a GGUF file or a Hugging Face folder (config.json + *.safetensors). None = the default model.

    Args:
      quantization: None, "gguf" (GGUF files only), "int8" or "int4" (module docstring).
      group_size: input elements per int4 scale (32, 64 or 128; it must divide every quantized width).
      on_host: leave the weights in host memory (numpy leaves), for a caller that puts them on a mesh
        shard by shard (Engine(mesh=...)), so that no one device ever holds the whole model.
      kquant_panels: with quantization='gguf', pack every layer matrix and head the CPU K-quant kernel reads
        (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1; mixed layers too) into its panels as it loads (panel_tensors.KQuantPanelTensor),
        so the stored fields and the panels never both hold the model (load_for_engine sets it where the kernel may run).
    """
    check_quantization(quantization)
    path = resolve_model_path(model)
    if path.is_dir():
        if quantization == "gguf":
            raise ModelLoadError(f"{path}: quantization='gguf' keeps a GGUF file's blocks, and this is a Hugging Face folder (use 'int8' or 'int4')")
        return load_hf_folder(path, dtype=dtype, max_context=max_context, quantization=quantization, group_size=group_size, on_host=on_host)
    return load_gguf(path, dtype=dtype, max_context=max_context, quantization=quantization, group_size=group_size, on_host=on_host,
                     kquant_panels=kquant_panels)


def load_for_engine(model, options, engine_cfg) -> tuple[ModelConfig, Params]:
    """`load_model` for a LoadOptions and an EngineConfig's pins, with quantization='auto' resolved to what
    the engine may run (engine/backends.resolve_quantization owns the rule): a GGUF's blocks kept where the
    CPU quantized-matmul kernel may multiply them, dense weights everywhere else."""
    from jaxinfer.engine import backends, host_memory, tuning_cache  # noqa: PLC0415  (jax; loading itself stays light)

    path = resolve_model_path(model)
    pins = backends.Impls(options.dtype, engine_cfg.attention_impl, engine_cfg.matmul_impl)
    quantization = backends.resolve_quantization(options.quantization, path, pins, on_mesh=options.on_mesh, tuning=tuning_cache.tuning_enabled())
    if options.quantization == "auto" and quantization is None and path.is_file():  # F16 / BF16 stay 16-bit even so
        loaded = load_gguf(path, **{**options.load_kwargs, "quantization": None}, keep_float16=True)
    else:
        kquant_panels = quantization == "gguf" and backends.kquant_kernel_may_run(pins, on_mesh=options.on_mesh)
        loaded = load_model(path, **{**options.load_kwargs, "quantization": quantization, "kquant_panels": kquant_panels})
    host_memory.release_freed_memory()  # the loader's host copies, freed, leave the heap (0.1 GB for Llama-3.2-1B Q4_K_M)
    return loaded


# ---------------------------------------------------------------- GGUF


def _gguf_name(field: str) -> str:
    """The GGUF tensor name of `field` in the weight table (layer 0's, for a stacked one)."""
    return weight_spec(field).gguf.format(i=0)


def gguf_config(reader, path: Path, *, dtype: str, max_context: int | None) -> ModelConfig:
    _check_whole_little_endian(reader, path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    embedding = _gguf_name("embed")
    if embedding not in tensors:
        raise ModelLoadError(f"{path}: tensor {embedding!r} is missing")
    try:
        num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
        embed_dim = int(gguf_field(reader, f"{arch}.embedding_length"))
        head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", embed_dim // num_heads))
        return ModelConfig(
            vocab_size=int(tensors[embedding].shape[1]),  # ggml order: [D, V]
            num_layers=int(gguf_field(reader, f"{arch}.block_count")),
            embed_dim=embed_dim,
            ffn_dim=int(gguf_field(reader, f"{arch}.feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rotary_dim=_gguf_rotary_dim(reader, arch, head_dim),
            rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch, tensors),
            attention_bias=_gguf_name("bq") in tensors,
            qk_norm=_gguf_name("q_norm") in tensors,
            rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=_gguf_name("lm_head") not in tensors,
            max_context=max_context or int(gguf_field(reader, f"{arch}.context_length", 2048)),
            dtype=dtype,
            architecture=arch,
            name=str(gguf_field(reader, "general.name", arch)),
            **(_gguf_gemma_fields(reader, arch, tensors) if arch in _GGUF_GEMMA else {}),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: missing or invalid model metadata: {e}") from None


def _gguf_gemma_fields(reader, arch: str, tensors: dict) -> dict:
    """Gemma 2/3's ModelConfig fields from a GGUF, as llama.cpp reads them (llama-model.cpp, models/gemma3.cpp)."""
    num_layers, embed_dim = int(gguf_field(reader, f"{arch}.block_count")), int(gguf_field(reader, f"{arch}.embedding_length"))
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    window = gguf_field(reader, f"{arch}.attention.sliding_window", None)
    fields = dict(hidden_act="gelu_tanh", post_norms=_gguf_name("post_attn_norm") in tensors, embed_scale=float(embed_dim) ** 0.5)
    if num_layers in (46, 62):  # Gemma 2 and 3 27B scale queries by (embed_dim / heads) ** -0.5, the others by head_dim ** -0.5
        fields["query_scale"] = (embed_dim / num_heads) ** -0.5
    softcap = float(gguf_field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0)
    fields["final_logit_softcap"] = softcap or None
    fields["attn_logit_softcap"] = float(gguf_field(reader, f"{arch}.attn_logit_softcapping", 0.0) or 0.0) or None
    if window:
        pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern", _GGUF_GEMMA[arch]["pattern"])
        sliding = [bool(x) for x in pattern] if isinstance(pattern, (list, tuple)) else [i % int(pattern) < int(pattern) - 1 for i in range(num_layers)]
        local_theta = gguf_field(reader, f"{arch}.rope.freq_base_swa", _GGUF_GEMMA[arch]["local_theta"])
        fields.update(sliding_window=int(window), layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                      local_rope_theta=None if local_theta is None else float(local_theta))
    return fields


def _gguf_rope_scaling(reader, arch: str, tensors: dict) -> RopeScaling | None:
    """Rope scaling as llama.cpp's converter stores it: Llama 3 as the `rope_freqs.weight` tensor of
    per-frequency divisors, LongRoPE (Phi-3) as `rope_factors_long/short.weight`, linear and yarn as
    `{arch}.rope.scaling.type` plus its keys. Anything else is named."""
    if "rope_freqs.weight" in tensors:
        return RopeScaling(kind="frequency_factors", frequency_factors=tuple(float(f) for f in _dequantize(tensors["rope_freqs.weight"])))
    if "rope_factors_long.weight" in tensors:
        return _gguf_longrope(reader, arch, tensors)
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(gguf_field(reader, f"{arch}.rope.scaling.factor")))
    if kind == "yarn":
        return _gguf_yarn(reader, arch)
    raise ValueError(f"unsupported rope type {kind!r}; supported in GGUF: none, linear, yarn, llama3 (rope_freqs), longrope (rope_factors_*)")


def _gguf_rotary_dim(reader, arch: str, head_dim: int) -> int | None:
    """`{arch}.rope.dimension_count` where it turns fewer dims than the head has (Phi-4-mini), else None."""
    count = int(gguf_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if count != head_dim and arch in _GGUF_PERMUTED_QK:
        raise ValueError(f"partial rotary ({count} of {head_dim} dims) with llama.cpp's permuted Q/K rows is not supported")
    return None if count == head_dim else count


def _gguf_longrope(reader, arch: str, tensors: dict) -> RopeScaling:
    """LongRoPE as llama.cpp's Phi-3 converter writes it: the factor tensors, the original context and the
    attention factor (computed from context_length / original where the key is absent, as the converter does)."""
    context = int(gguf_field(reader, f"{arch}.context_length"))
    original = int(gguf_field(reader, f"{arch}.rope.scaling.original_context_length", context))
    factor = context / original
    default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return RopeScaling(
        kind="longrope", factor=factor, original_max_position=original,
        attention_factor=float(gguf_field(reader, f"{arch}.rope.scaling.attn_factor", default)),
        short_factors=tuple(float(f) for f in _dequantize(tensors["rope_factors_short.weight"])),
        long_factors=tuple(float(f) for f in _dequantize(tensors["rope_factors_long.weight"])),
    )


def _gguf_yarn(reader, arch: str) -> RopeScaling:
    """YaRN from llama.cpp's keys: factor, original_context_length (else context_length), yarn_beta_fast /
    yarn_beta_slow (32 / 1) and yarn_attn_factor (else 0.1 ln(factor) + 1, or its ratio with
    yarn_log_multiplier as mscale_all_dim), times rope.scaling.attn_factor. llama.cpp rounds the blend range outward."""
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor"))
    original = int(gguf_field(reader, f"{arch}.rope.scaling.original_context_length", gguf_field(reader, f"{arch}.context_length")))
    mscale = (lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0)
    log_mul = float(gguf_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    attention = gguf_field(reader, f"{arch}.rope.scaling.yarn_attn_factor", mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0))
    return RopeScaling(
        kind="yarn", factor=factor, original_max_position=original,
        attention_factor=float(attention) * float(gguf_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        beta_fast=float(gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
    )


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


def _gguf_factoring(spec: params_lib.WeightSpec, cfg: ModelConfig) -> dict:
    """How from_gguf reads the rows [out, in] of `spec`'s GGUF tensor: its logical out and in shapes."""
    if spec.layout == "out_in":  # the embedding [V, D]: rows as they are
        return dict(layout="out_in")
    sizes = params_lib.axis_sizes(cfg)
    return dict(out_shape=tuple(sizes[a] for a in spec.out_axes), in_shape=tuple(sizes[a] for a in spec.in_axes), layout="in_out")


def _rotary_heads(spec: params_lib.WeightSpec, cfg: ModelConfig) -> int | None:
    """Heads whose rows llama.cpp permuted in this file (Q and K of architecture "llama"), else None."""
    if not spec.gguf_rotary or cfg.architecture not in _GGUF_PERMUTED_QK:
        return None
    return params_lib.axis_sizes(cfg)[spec.out_axes[0]]


def _kept_gguf_weight(spec: params_lib.WeightSpec, cfg: ModelConfig, tensors: dict, path: Path, reader=None,
                      mixed: bool = True, kquant_panels: bool = False) -> quant.QuantizedTensor | None:
    """`spec`'s blocks stacked per layer on the device (loading/kept_blocks.py: layer by layer, the file's
    pages released as they are read), or None when they cannot stay as they are.

    Kept when every layer has a kept type; layers that mix kept types (Q4_K_M's Q4_K / Q6_K attn_v and
    ffn_down) become a mixed_quant.MixedQuantStack, each layer as stored (with `mixed` False, for a mesh,
    such a field loads dense). Q/K rows get llama.cpp's permutation undone on the codes. `kquant_panels`:
    a matrix the K-quant kernel reads is packed layer by layer (the embedding only when tied: it is the head).
    """
    names = spec.file_names(cfg, "gguf")
    if any(name not in tensors for name in names):
        return None
    stored = [int(tensors[n].tensor_type) for n in names]
    targets = {t: kept_blocks.conversion_target(t) for t in set(stored)}  # a type no kernel reads: converted, not expanded
    types = [targets[t] or t for t in stored]
    if any(t not in quant.GGUF_KEPT_TYPES for t in types):
        return None  # F32, or a type quant.py does not keep: the dense path handles it
    if len(set(types)) != 1 and not mixed:
        log.info("%s: %s is not one kept GGUF type in every layer; loading it dense", path, spec.name)
        return None
    heads = _rotary_heads(spec, cfg)

    def read_layer(i: int) -> quant.QuantizedTensor:
        data = tensors[names[i]].data
        if targets[stored[i]] is not None:
            try:
                data = kept_blocks.converted_blocks(data, stored[i], types[i], names[i])
            except NotImplementedError:  # a type gguf sizes but cannot dequantize (Q8_1, Q8_K, Q1_0): as _dequantize says it
                raise ModelLoadError(f"{path}: tensor {names[i]!r} is of GGUF type {tensors[names[i]].tensor_type.name}, which can be neither kept nor dequantized") from None
        try:
            q = quant.from_gguf(data, types[i], **_gguf_factoring(spec, cfg))
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {names[i]!r} does not match the config: {e}") from None
        if heads is not None:
            q = quant.permute_out(q, _unpermute_rotary(np.arange(q.codes.shape[-2])[:, None], heads)[:, 0])
        return q

    release = (lambda i: kept_blocks.release_pages(reader, tensors[names[i]])) if reader is not None else (lambda i: None)
    num_in = math.prod(params_lib.axis_sizes(cfg)[a] for a in spec.in_axes)
    # A tied embedding is packed too: the head's panels, which the lookup also reads (forward.embed_lookup), so the
    # table is kept once; an untied one stays as stored, for the lookup alone.
    pack = kquant_panels and (spec.layout != "out_in" or cfg.tie_embeddings) and kept_blocks.packable(types, num_in)
    # A tied Q8_0 / Q4_0 / Q4_1 table likewise, in the quantized kernel's panels (Gemma 3's Q4_K_M keeps a Q8_0 one).
    pack_affine = kquant_panels and spec.layout == "out_in" and cfg.tie_embeddings and kept_blocks.affine_packable(types, num_in)
    return kept_blocks.kept_weight(read_layer, types, stacked=spec.stacked, pack=pack, pack_affine=pack_affine, release=release)


def _kept_gguf_weights(cfg: ModelConfig, tensors: dict, path: Path, reader=None, kquant_panels: bool = False, mixed: bool = True,
                       float16_only: bool = False) -> dict[str, quant.QuantizedTensor]:
    """Params field -> the file's blocks, for every matmul weight (weight_format "gguf") that can stay;
    `float16_only`: only those stored F16 / BF16 in every layer (kept as "f16" / "bf16", not expanded)."""
    kept = {}
    for spec in params_lib.present(cfg):
        if weight_format(spec.name, "gguf") == "gguf" and (not float16_only or _stored_float16(spec, cfg, tensors)):
            q = _kept_gguf_weight(spec, cfg, tensors, path, reader, mixed, kquant_panels)
            if q is not None:
                kept[spec.name] = q
    return kept


def _stored_float16(spec: params_lib.WeightSpec, cfg: ModelConfig, tensors: dict) -> bool:
    names = spec.file_names(cfg, "gguf")
    return all(n in tensors and quant.GGUF_KEPT_TYPES.get(int(tensors[n].tensor_type), ("",))[0] in quant.FLOAT16_FORMATS for n in names)


def _split_fused(tensors: dict, cfg: ModelConfig, path: Path) -> dict:
    """`tensors` with each fused one (params.FUSED) replaced by views of its parts' rows under the parts' own
    GGUF names, so the kept-block and dense paths read them as any other tensor. Rows are whole blocks in
    every GGUF type, so a view is a row slice of the data (ggml shape [in, rows])."""
    out = dict(tensors)
    for fused in params_lib.FUSED:
        for i in range(cfg.num_layers):
            if (name := fused.in_file(tensors, i, "gguf")) is None:
                continue
            t, rows = tensors[name], fused.rows(cfg)
            if t.data.shape[0] != sum(rows):
                raise ModelLoadError(f"{path}: tensor {name!r} has {t.data.shape[0]} rows, {' + '.join(map(str, rows))} expected for {', '.join(fused.parts)}")
            row_bytes, start = int(t.n_bytes) // sum(rows), 0
            for part, count in zip(fused.parts, rows):
                part_name = weight_spec(part).gguf.format(i=i)
                out[part_name] = t._replace(name=part_name, shape=np.array([t.shape[0], count]), n_elements=int(t.shape[0]) * count,
                                            n_bytes=count * row_bytes, data_offset=t.data_offset + start * row_bytes, data=t.data[start : start + count])
                start += count
    return out


def load_gguf(
    path: Path, *, dtype: str = "float32", max_context: int | None = None, kquant_panels: bool = False,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
    keep_float16: bool = False,
) -> tuple[ModelConfig, Params]:
    """`keep_float16`: with quantization None, F16 / BF16 matmul weights still stay 16-bit ("f16" / "bf16"
    QuantizedTensors), the rest loads dense: quantization="auto" where it resolves to dense weights."""
    reader = open_gguf(Path(path))
    cfg = gguf_config(reader, Path(path), dtype=dtype, max_context=max_context)
    tensors = {t.name: t for t in reader.tensors}
    tensors = _split_fused(tensors, cfg, Path(path))  # Phi-3's attn_qkv and ffn_up (gate + up) as views of their parts' rows
    kept = _kept_gguf_weights(cfg, tensors, Path(path), reader, mixed=not on_host, kquant_panels=kquant_panels) if quantization == "gguf" else {}
    if quantization is None and keep_float16:
        kept = _kept_gguf_weights(cfg, tensors, Path(path), reader, mixed=not on_host, float16_only=True)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing")
        return _dequantize(tensors[name])

    hf = {}  # the dense tensors, [out, in], under their Hugging Face names
    for spec in params_lib.present(cfg):
        if spec.name in kept:
            continue
        heads = _rotary_heads(spec, cfg)
        for hf_name, gguf_name in zip(spec.file_names(cfg, "hf"), spec.file_names(cfg, "gguf")):
            hf[hf_name] = get(gguf_name) if heads is None else _unpermute_rotary(get(gguf_name), heads)
    return cfg, _assemble(cfg, hf, kept=kept, quantization=quantization, group_size=group_size, on_host=on_host)


def _check_whole_little_endian(reader, path: Path) -> None:
    """ModelLoadError for a GGUF this loader would misread: one shard of a split model (gguf-split), whose tensors lie
    in its sibling files, and a big-endian file, whose tensors the dequantizers would read byte-swapped."""
    shards = gguf_field(reader, "split.count")
    if shards is not None and int(shards) > 1:
        number = int(gguf_field(reader, "split.no", 0)) + 1
        raise ModelLoadError(f"{path} is shard {number} of a {int(shards)}-file split GGUF; merge the shards first (llama-gguf-split --merge)")
    if getattr(reader, "byte_order", "<") == ">":
        raise ModelLoadError(f"{path} is a big-endian GGUF; jaxinfer reads little-endian ones (convert the model again without --bigendian)")


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
        cfg = from_hf_config(_unquantized(json.loads(config_path.read_text())), dtype=dtype, max_context=max_context)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, ValueError, TypeError, AttributeError) as e:
        kind = "" if type(e) is ValueError else f"{type(e).__name__}: "  # from_hf_config's own errors read as they are
        raise ModelLoadError(f"{config_path}: {kind}{e}") from None
    weight_map = _shard_index(folder)
    files = [folder / name for name in sorted(set(weight_map.values()))] if weight_map is not None else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    hf: dict[str, np.ndarray] = {}
    found: dict[str, Path] = {}  # tensor name -> its file (without an index, one name in two files is an error)
    for file in files:
        try:
            tensors = load_file(file)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read safetensors: {e}") from None
        for name, value in tensors.items():
            if weight_map is not None and weight_map.get(name) != file.name:
                continue  # the index takes each tensor from one file
            if name in found:
                raise ModelLoadError(f"{folder}: tensor {name!r} is in both {found[name].name} and {file.name} (a stale file beside the weights?)")
            found[name], hf[name] = file, np.asarray(value, np.float32)
    hf = _text_model_names(hf)
    hf.update(params_lib.unfuse(hf, cfg))  # Phi-3's qkv_proj and gate_up_proj, split into their parts
    if weight_spec("embed").hf not in hf and "embed_tokens.weight" in hf:  # a base model saved bare (Qwen3Model: Qwen3-Embedding)
        hf = {name if name == weight_spec("lm_head").hf else f"model.{name}": value for name, value in hf.items()}
    if weight_spec("lm_head").hf not in hf and not cfg.tie_embeddings and weight_spec("lm_head").hf not in (weight_map or {}):
        cfg = dataclasses.replace(cfg, tie_embeddings=True)  # some exports omit the flag but share weights (an index listing it does not)
    if cfg.norm_weight_offset:  # Gemma 2/3 store w for x * (1 + w): the Params hold 1 + w, as a GGUF does
        for spec in params_lib.present(cfg):
            if spec.name.endswith("norm"):
                hf.update({name: hf[name] + np.float32(cfg.norm_weight_offset) for name in spec.file_names(cfg, "hf") if name in hf})
    try:
        return cfg, _assemble(cfg, hf, quantization=quantization, group_size=group_size, on_host=on_host)
    except ModelLoadError as e:
        raise ModelLoadError(f"{folder}: {e}") from None


def _shard_index(folder: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's weight_map (tensor name -> shard file), each shard there; None without an index.
    ModelLoadError naming the index, or the first shard it lists that is missing (an interrupted download)."""
    path = folder / "model.safetensors.index.json"
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None
    shards = sorted(set(weight_map.values()))
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(f"{folder}: {missing[0]}, listed in {path.name}, is missing ({len(missing)} of {len(shards)} shards; an interrupted download?)")
    return weight_map


def _unquantized(config):
    """config.json's object, refused (ValueError) when it declares a quantized checkpoint: its int8 codes would load as
    weights and their scales be dropped, a model that runs and is wrong."""
    quantized = isinstance(config, dict) and (config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"))
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ValueError(f"unsupported quantization_config (quant_method {method!r}): jaxinfer reads a checkpoint's float weights, "
                         "not its quantized codes and scales; load the unquantized model, or a GGUF (and --quantization to quantize it here)")
    return config


# Multimodal Gemma 3/4 checkpoints keep the text model under these prefixes (transformers 5, then 4.x saves).
_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))


def _text_model_names(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensor names of a multimodal checkpoint's text model renamed as a text-only one's; others unchanged."""
    out = {}
    for name, value in hf.items():
        for prefix, plain in _TEXT_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = plain + name.removeprefix(prefix)
                break
        out[name] = value
    return out


# ---------------------------------------------------------------- shared assembly


def _from_file(spec: params_lib.WeightSpec, cfg: ModelConfig, hf: dict[str, np.ndarray]) -> np.ndarray:
    """`spec`'s file tensors (HF names, [out, in]) -> its Params layout, stacked per layer."""
    shape = spec.layer_shape(cfg)
    per_layer = []
    for name in spec.file_names(cfg, "hf"):
        if name not in hf:
            raise ModelLoadError(f"weight {name!r} is missing from the model file")
        try:
            per_layer.append(spec.from_file(hf[name], shape))
        except ValueError:
            raise ModelLoadError(f"weights do not match the config: tensor {name!r} has shape {hf[name].shape}, "
                                 f"{spec.name!r} needs {shape}") from None
    return np.stack(per_layer) if spec.stacked else per_layer[0]


def _assemble(
    cfg: ModelConfig, hf: dict[str, np.ndarray], *, kept: dict | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE, on_host: bool = False,
) -> Params:
    """HF-named [out, in] tensors -> Params, each WEIGHTS entry's `from_file` layout, stacked per layer.

    `kept`: Params fields already in their final (quantized) form, whose HF tensors `hf` lacks.
    int8 / int4 quantize the f32 matrices here, before the cast to cfg.dtype.
    """
    kept = kept or {}
    arrays = dict(kept)
    for spec in params_lib.present(cfg):
        if spec.name not in kept:
            arrays[spec.name] = _from_file(spec, cfg, hf)
    if quantization in ("int8", "int4"):
        arrays = quantize_arrays(arrays, quantization, group_size=group_size)
    try:
        return from_numpy(cfg, arrays, on_host=on_host)
    except ValueError as e:
        raise ModelLoadError(f"weights do not match the config: {e}") from None
