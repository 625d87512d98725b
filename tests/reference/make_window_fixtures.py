"""Greedy tokens of the tiny sliding-window Mistral (tests/fixtures/tiny_mistral_window, window 8) from
transformers, for tests/model/test_sliding_window.py: a 10-token prompt and 30 greedy tokens, every step a
full forward without a cache (so nothing but the model's own sliding-window mask decides what is seen).

    .venv-ref/bin/python tests/reference/make_window_fixtures.py --out tests/fixtures

Run after make_fixtures.py has written tiny_mistral_window (make reference).
"""

import argparse
from pathlib import Path

import numpy as np
import torch

import make_fixtures

PROMPT_LEN, NEW_TOKENS = 10, 30  # 40 tokens: 5x the window


@torch.inference_mode()
def greedy_fixture(out: Path) -> None:
    from transformers import MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(out / "tiny_mistral_window", dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.sliding_window == 8
    prompt = np.load(out / "tiny_mistral_window_reference.npz")["s2_ids"][:PROMPT_LEN]
    ids = torch.tensor(prompt, dtype=torch.long)[None]
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    tokens = ids[0].numpy().astype(np.int32)
    make_fixtures.write_npz(out / "tiny_mistral_window_greedy.npz", {"prompt": tokens[:PROMPT_LEN], "greedy": tokens[PROMPT_LEN:]})
    print(f"  greedy: {tokens[PROMPT_LEN:].tolist()}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    make_fixtures.setup_determinism()
    greedy_fixture(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
