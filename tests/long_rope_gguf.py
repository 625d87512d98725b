"""The long-context rope fixtures (tiny_phi3, tiny_qwen*_yarn) as GGUFs, the way llama.cpp's converter writes
them (convert_hf_to_gguf.py's Phi3MiniModel and TextModel.set_gguf_parameters, read, not copied).

Needs only gguf, numpy and safetensors, so tests/reference/make_long_rope_llama_cpp_fixtures.py runs it in the
reference environment too. `no_vocab` writes tokenizer.ggml.model = "none", which llama.cpp needs to load a
model without a vocabulary.
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

import gguf_convert
import gguf_files

FIXTURES = Path(__file__).parent / "fixtures"
_FUSED = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}  # Phi-3's


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _write(writer, name: str, qtype, no_vocab: bool) -> None:
    """The tensors (fused ones under llama.cpp's names), then the file."""
    if no_vocab:
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(_config(name)["vocab_size"])
    for tensor_name, value in load_file(FIXTURES / name / "model.safetensors").items():
        parts = tensor_name.split(".", 3)
        target = f"blk.{parts[2]}.{_FUSED[parts[3]]}" if len(parts) == 4 and parts[3] in _FUSED else gguf_convert._gguf_name(tensor_name)
        gguf_files.add_weight(writer, target, value, qtype)
    gguf_files.finish(writer)


def phi3_gguf(path, qtype=gguf.GGMLQuantizationType.F32, *, no_vocab: bool = False) -> Path:
    """tiny_phi3: architecture "phi3", Q/K unpermuted (NeoX rope), qkv_proj -> attn_qkv, gate_up_proj -> ffn_up,
    the factor tensors, the original context, rope.dimension_count = int(partial * D) // heads and the
    attention factor the converter computes."""
    config = _config("tiny_phi3")
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), "phi3")
    gguf_convert._write_metadata(writer, config)
    original = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * config["hidden_size"]) // config["num_attention_heads"])
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    _write(writer, "tiny_phi3", qtype, no_vocab)
    return Path(path)


def yarn_gguf(name: str, path, *, no_vocab: bool = False) -> Path:
    """A YaRN fixture: rope.scaling.type "yarn", .factor, .original_context_length, the yarn_beta_* keys where
    the config sets them, mscale_all_dim as rope.scaling.yarn_log_multiplier (as the DeepSeek converters write it)."""
    config = _config(name)
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), gguf_convert.GGUF_ARCH[config["model_type"]])
    gguf_convert._write_metadata(writer, config)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "beta_fast" in rope:
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if "mscale_all_dim" in rope:
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    _write(writer, name, gguf.GGMLQuantizationType.F32, no_vocab)
    return Path(path)
