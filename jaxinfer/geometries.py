"""Hugging Face configs of real model geometries, for random-weight models: shapes without a download.

The one copy that the deviceless GPU compile (engine/aot.py) and the benchmarks (experiments/common/models.py)
share. Plain dicts, no imports; `config.from_hf_config` turns each into a ModelConfig.
"""

SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "hidden_act": "silu", "rope_theta": 100000.0, "architectures": ["LlamaForCausalLM"],
}
LLAMA_3_2_1B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu", "architectures": ["LlamaForCausalLM"],
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LLAMA_3_1_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "architectures": ["LlamaForCausalLM"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
QWEN2_5_0_5B = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False, "architectures": ["Qwen2ForCausalLM"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
GEMMA_3_1B = {  # google/gemma-3-1b-it's config.json (transformers 5): 5 sliding layers (window 512, rope 10k) to 1 global (rope 1M)
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "_sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True, "architectures": ["Gemma3ForCausalLM"],
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}
