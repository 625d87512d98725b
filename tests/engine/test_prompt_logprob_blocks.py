"""The step's prompt log-probabilities project only the 64-token blocks that hold a target: a block without
one returns the empty branch's zeros (its logits never computed), a block with one the float64 log-softmax of
the model's logits, for every token of the block; the bucket's shape decides the blocks, never a request."""

import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import engine
from jaxinfer.model import forward


def test_only_blocks_holding_a_target_compute_their_logprobs(tiny_llama):
    cfg, params = tiny_llama
    rows, tokens, block = 2, 128, engine._LOGIT_BLOCK
    x = np.random.default_rng(0).standard_normal((rows, tokens, cfg.embed_dim)).astype(np.float32)  # [R, T, D]
    targets = np.full((rows, tokens), -1, np.int32)
    targets[0, 70:75] = [5, 6, 7, 8, 9]  # row 0's second block only
    targets[1, 3] = 11  # row 1's first block only
    out = engine._prompt_logprobs(params, jnp.asarray(x), jnp.asarray(targets), cfg, 4)
    token = np.asarray(out.token).reshape(rows, tokens)
    logits = np.asarray(forward.logits_from_hidden(params, jnp.asarray(x), cfg), np.float64)  # [R, T, V]
    logsoftmax = logits - logits.max(-1, keepdims=True)
    logsoftmax -= np.log(np.exp(logsoftmax).sum(-1, keepdims=True))
    wanted = {(0, 1), (1, 0)}  # (row, block) holding a target
    for row in range(rows):
        for b in range(tokens // block):
            span = slice(b * block, (b + 1) * block)
            if (row, b) in wanted:
                expected = np.take_along_axis(logsoftmax[row, span], np.maximum(targets[row, span], 0)[:, None], axis=-1)[:, 0]
                np.testing.assert_allclose(token[row, span], expected, atol=1e-5)
                np.testing.assert_allclose(np.asarray(out.top).reshape(rows, tokens, 4)[row, span, 0], logsoftmax[row, span].max(-1), atol=1e-5)
            else:
                assert not token[row, span].any(), f"block {b} of row {row} holds no target, yet computed log-probabilities"
