"""A tokenizer that thinks (SmolLM2's vocabulary plus Qwen3's `<think>` and `</think>` as plain added tokens,
and a Qwen3-style template that opens the block in the generation prompt unless `enable_thinking` is
false) and a random tiny Qwen3-shaped model over it, saved as a Hugging Face folder. Host-only imports
until `save_tiny_qwen3_thinker` runs (the scheduling tests use the tokenizer without jax)."""

import dataclasses
import json
import pathlib

THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}"
)


def thinking_tokenizer(base):
    """`base` (a TextTokenizer, SmolLM2's) with <think> and </think> added as single non-special tokens, as
    Qwen3's tokenizer.json has them, and THINK_TEMPLATE as its chat template."""
    from tokenizers import AddedToken, Tokenizer

    hf = Tokenizer.from_str(base.tokenizer.to_str())
    hf.add_tokens([AddedToken("<think>", special=False, normalized=False), AddedToken("</think>", special=False, normalized=False)])
    return dataclasses.replace(base, tokenizer=hf, chat_template=THINK_TEMPLATE)


def save_tiny_qwen3_thinker(folder: pathlib.Path, base) -> pathlib.Path:
    """A random tiny Qwen3 (q/k norms, model_type qwen3) with the thinking tokenizer, as a HF folder."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from jaxinfer.loading.tiny_model import TINY_GEOMETRY, save_tiny_llama

    folder = save_tiny_llama(folder, thinking_tokenizer(base))
    weights = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(1)
    for i in range(TINY_GEOMETRY["num_hidden_layers"]):
        for name in ("q_norm", "k_norm"):
            weights[f"model.layers.{i}.self_attn.{name}.weight"] = rng.uniform(0.5, 1.5, TINY_GEOMETRY["head_dim"]).astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1e6}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
