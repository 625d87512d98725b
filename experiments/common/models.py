"""Random-weight models of real geometries as files: the tensor shapes a GGUF or HF file of a ModelConfig
holds (from the library's weight table, jaxinfer.model.params), the geometries' Hugging Face configs, and
a llama GGUF writer (gguf.quants quantizes each matrix). numpy at import; gguf and jaxinfer where used.
The library and tests/ convert real checkpoints (tests/gguf_convert.py) but write no random ones.
"""

import math
import pathlib

import numpy as np

from jaxinfer import geometries


def file_tensor_shapes(cfg, fmt: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in a "hf" or "gguf" file of the weights `cfg` has (jaxinfer.model.params.WEIGHTS):
    [out, in] for matmul weights, flat vectors otherwise."""
    from jaxinfer.model import params

    sizes = params.axis_sizes(cfg)
    size = lambda axes: math.prod(sizes[a] for a in axes)  # noqa: E731
    shapes = {}
    for spec in params.present(cfg):
        shape = (size(spec.out_axes), size(spec.in_axes)) if spec.num_in else (math.prod(spec.layer_shape(cfg)),)
        shapes |= dict.fromkeys(spec.file_names(cfg, fmt), shape)
    return shapes


# Hugging Face configs of the random-weight geometries (jaxinfer.geometries owns them).
GEOMETRIES = {"llama3-1b": geometries.LLAMA_3_2_1B, "qwen2.5-0.5b": geometries.QWEN2_5_0_5B}


_CONTROL_TOKEN = 3  # llama.cpp's token type for the padding tokens a copied vocabulary may need


def _copy_tokenizer(writer, reader, vocab_size: int) -> None:
    """The source GGUF's tokenizer.* metadata, its token list padded with CONTROL tokens to vocab_size."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|bench_pad_{i}|>" for i in range(vocab_size - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [_CONTROL_TOKEN] * (vocab_size - len(value))
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)


def write_random_gguf(path: pathlib.Path, hf_config: dict, qtype: str, tokenizer_reader, *, max_context: int, seed: int = 0) -> None:
    """A GEOMETRIES model as a llama (or gemma3) GGUF, one tensor at a time: matrices ~ N(0, 0.02) quantized by
    gguf.quants.quantize to `qtype` ("Q4_0", "Q8_0", ...), norms 1, the rope base without its llama3
    scaling (no weight byte depends on it), the tokenizer of `tokenizer_reader` (a GGUFReader). Gemma 3 adds
    its head width and sliding window (llama.cpp fixes its 5:1 layer pattern and local rope base of 10k)."""
    import gguf
    from jaxinfer.config import from_hf_config

    cfg, kind = from_hf_config(hf_config), gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), "gemma3" if cfg.architecture == "gemma3" else "llama")
    writer.add_name(f"random {qtype} ({path.name})")
    for add, value in ((writer.add_block_count, cfg.num_layers), (writer.add_context_length, max_context), (writer.add_embedding_length, cfg.embed_dim),
                       (writer.add_feed_forward_length, cfg.ffn_dim), (writer.add_head_count, cfg.num_heads), (writer.add_head_count_kv, cfg.num_kv_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_rope_freq_base, cfg.rope_theta), (writer.add_vocab_size, cfg.vocab_size)):
        add(value)
    if cfg.architecture == "gemma3":
        writer.add_key_length(cfg.head_dim), writer.add_value_length(cfg.head_dim), writer.add_sliding_window(cfg.sliding_window)
    _copy_tokenizer(writer, tokenizer_reader, cfg.vocab_size)
    shapes = file_tensor_shapes(cfg, "gguf")
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            byte_shape = (shape[0], shape[1] // block * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        weights = np.ones(shape, np.float32) if len(shape) == 1 else gguf.quants.quantize(rng.standard_normal(shape, np.float32) * 0.02, kind)
        writer.write_tensor_data(weights)
    writer.close()
