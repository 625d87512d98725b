"""A random tiny Llama saved as a Hugging Face folder, with a real tokenizer and chat template.

Every engine code path (paged pool, packed prefill, sampling, stop handling, text jobs) runs on it in a
fraction of SmolLM2's compile time, while tokenization and chat formatting stay real. The tests and the
quick modes of the experiments build it; its outputs are meaningless text, so it is never a reference.
"""

import json
import pathlib

import numpy as np

TINY_GEOMETRY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def save_tiny_llama(folder: pathlib.Path, tokenizer, *, max_position: int = 512, seed: int = 0) -> pathlib.Path:
    """Write config.json, model.safetensors (N(0, 0.5) weights, unit norms), tokenizer.json and
    tokenizer_config.json for `tokenizer` (a jaxinfer Tokenizer) into `folder`; returns it.
    config.json is written last, so a folder that has it is complete."""
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = TINY_GEOMETRY
    vocab, d, f, heads, kv_heads, head_dim = tokenizer.vocab_size, g["hidden_size"], g["intermediate_size"], g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(0, 0.5, shape).astype(np.float32)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(vocab, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(g["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(d, np.float32), p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, d), p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, d), p + "self_attn.o_proj.weight": normal(d, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d), p + "mlp.down_proj.weight": normal(d, f),
        }
    save_file(weights, str(folder / "model.safetensors"))
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    token = tokenizer.tokenizer.id_to_token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id), "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {"model_type": "llama", "vocab_size": vocab, **g, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "max_position_embeddings": max_position}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
