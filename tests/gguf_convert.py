"""Hugging Face folder -> GGUF with the `gguf` package, following llama.cpp's convert_hf_to_gguf.py.

Written for the tests from the converter's conventions (read, not copied): Llama and Mistral become
architecture "llama" with the rows of Q and K permuted so rotary pairs are adjacent; Qwen2 and Qwen3 keep
their own architecture names and unpermuted Q/K, Qwen2's q/k/v biases as `attn_{q,k,v}.bias` and Qwen3's
q/k norms as `attn_{q,k}_norm.weight`. Llama 3 rope scaling becomes the `rope_freqs.weight` tensor (one
divisor per frequency), linear scaling the `rope.scaling.type/factor` keys; an explicit `head_dim` becomes
`attention.key_length/value_length`; a tied head has no `output.weight`.
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

import gguf_files

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_SUFFIXES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The Q/K row order llama.cpp's converter writes for architecture "llama" (adjacent rotary pairs)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3 scaling, as llama.cpp stores them in `rope_freqs.weight`."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    old, low, high, factor = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            divisors.append(1.0)
        elif wavelength > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, np.float32)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_LAYER_SUFFIXES[rest]}"


def _write_metadata(writer, config: dict) -> dict:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    return rope


def convert(folder: Path, path: Path, qtype=gguf.GGMLQuantizationType.F32, arch: str | None = None, no_vocab: bool = False) -> Path:
    """Write `folder` (config.json + model.safetensors) as a GGUF at `path`; `arch` overrides the name.
    `no_vocab` writes tokenizer.ggml.model = "none", which llama.cpp needs to load a model without a vocabulary."""
    config = json.loads((Path(folder) / "config.json").read_text())
    arch = arch or GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    rope = _write_metadata(writer, config)
    if no_vocab:  # llama.cpp then sizes the embedding from {arch}.vocab_size
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(rope, head_dim))
    for name, value in load_file(Path(folder) / "model.safetensors").items():
        value = np.asarray(value, np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, config["num_attention_heads"])
        if arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        gguf_files.add_weight(writer, _gguf_name(name), value, qtype)
    gguf_files.finish(writer)
    return Path(path)
