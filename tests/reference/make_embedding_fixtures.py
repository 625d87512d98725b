"""Write the embedding fixture: a random tiny Qwen3 base model (Qwen3Model, saved bare as Qwen3-Embedding is,
no "model." prefix and no LM head) of a shape no other fixture has, and transformers' pooled embeddings.

    .venv-ref/bin/python tests/reference/make_embedding_fixtures.py --out tests/fixtures

Writes tiny_qwen3_embed/ (config.json + model.safetensors) and tiny_qwen3_embed_reference.npz:
  num_sequences int64;  s{i}_ids int32[T];  s{i}_last, s{i}_mean float32[D] (final hidden states after the
  final norm, last token / mean over the sequence, each sequence alone, no padding);  s{i}_last_normalized,
  s{i}_mean_normalized float32[D] (torch.nn.functional.normalize). Held-out shape: D=40, 5 query heads of 12,
  1 kv head, 3 layers, FFN 72, vocab 300.
"""

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_fixtures import _fill_weights, setup_determinism, write_npz  # noqa: E402

SHAPE = dict(vocab_size=300, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1,
             head_dim=12, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             attention_bias=False, hidden_act="silu", use_sliding_window=False)
LENGTHS = (5, 17, 40, 1)


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args(argv).out
    setup_determinism()
    import transformers

    config = transformers.Qwen3Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = transformers.Qwen3Model(config).to(torch.float32).eval()
    _fill_weights(model)
    folder = out / "tiny_qwen3_embed"
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    for extra in folder.glob("generation_config.json"):
        extra.unlink()
    reloaded = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(7)
    arrays = {"num_sequences": np.int64(len(LENGTHS))}
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, config.vocab_size, (1, n), generator=g, dtype=torch.long)
        hidden = reloaded(input_ids=ids, use_cache=False).last_hidden_state[0].float()  # [T, D], after the final norm
        pooled = {"last": hidden[-1], "mean": hidden.mean(0)}
        arrays[f"s{i}_ids"] = ids[0].numpy().astype(np.int32)
        for name, vector in pooled.items():
            arrays[f"s{i}_{name}"] = vector.numpy()
            arrays[f"s{i}_{name}_normalized"] = torch.nn.functional.normalize(vector, dim=0).numpy()
    write_npz(out / "tiny_qwen3_embed_reference.npz", arrays)
    print(sorted(p.name for p in folder.iterdir()), {k: v.shape for k, v in arrays.items() if k.startswith("s0")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
