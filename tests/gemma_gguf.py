"""Gemma 2/3 Hugging Face folder -> GGUF with the `gguf` package, as llama.cpp's converter writes one.

Read, not copied, from llama.cpp's conversion/gemma.py (Gemma2Model, Gemma3Model): architecture gemma2 or
gemma3, Q/K rows unpermuted, every norm weight + 1 (the converter's norm_shift), HF's
pre_feedforward_layernorm as ffn_norm and post_attention/post_feedforward norms as post_attention_norm /
post_ffw_norm, sliding_window (Gemma 3: also its per-layer pattern), rope.freq_base for the full layers and
(Gemma 3) freq_base_swa for the sliding ones, linear scaling as rope.scaling.type/factor,
final_logit_softcapping, a tied head (no output.weight). Used by tests/loading/test_gemma.py and, in the
reference environment, by tests/reference/make_gemma_llama_cpp_fixtures.py.
"""

import json

import gguf
import numpy as np
from safetensors.numpy import load_file

import gguf_files

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gemma_gguf(folder, path, qtype=gguf.GGMLQuantizationType.F32, no_vocab: bool = False):
    """llama.cpp's conversion/gemma.py Gemma3Model (Gemma2Model alike), read not copied: architecture gemma3
    (gemma2), Q/K unpermuted, every norm weight + 1, sliding_window (Gemma 3: and its per-layer pattern; Gemma 2's
    is llama.cpp's fixed every-other-layer one), rope.freq_base (global) and freq_base_swa (Gemma 3), linear
    scaling as rope.scaling.type/factor, final_logit_softcapping, a tied head (no output.weight)."""
    config = json.loads((folder / "config.json").read_text())
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[config["model_type"]]
    rope = config["rope_parameters"]
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention")
    writer = gguf.GGUFWriter(str(path), arch)
    if no_vocab:  # llama.cpp then sizes the embedding from {arch}.vocab_size
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(config["vocab_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(full["rope_theta"])
    if local:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("attn_logit_softcapping"):  # Gemma 2 (Gemma2Model writes it)
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    for name, value in load_file(folder / "model.safetensors").items():
        value = np.asarray(value, np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_GGUF_LAYER[rest]}"
        gguf_files.add_weight(writer, gguf_name, value, qtype)
    gguf_files.finish(writer)
    return path
