"""Shared by the llama.cpp peers (run in .venv-ref with llama-cpp-python): a llama.cpp context over
sequence ids, and the chunked decode of a prefix into one of them. Each peer script imports this module,
never another peer script.
"""

import llama_cpp as lc
import numpy as np

MAX_CONTEXT = 2048  # tokens per sequence, as in bench_engine.py
N_BATCH = 512  # tokens per llama_decode at most (prompt chunks + decode tokens)


class Context:
    """A llama.cpp context with room for `parallel` sequences of MAX_CONTEXT tokens; `unified`: one KV buffer
    for all sequence ids (kv_unified), else llama.cpp's default of one stream per sequence id. `fields`:
    further llama_context_params fields (a KV cache type, flash attention)."""

    def __init__(self, model, parallel: int, threads: int, unified: bool = False, **fields):
        parallel += 1  # a spare sequence id holds a shared prefix (batched_prefix)
        params = lc.llama_context_default_params()
        params.n_ctx = parallel * MAX_CONTEXT
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = parallel
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = unified
        for name, value in fields.items():
            setattr(params, name, value)
        self.ctx = lc.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence id, wants logits). Returns the argmax of each wanted row."""
        batch = self.batch
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(entries)
        status = lc.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        picks = []
        for i, entry in enumerate(entries):
            if entry[3]:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                picks.append(int(np.argmax(logits)))
        return picks

    def copy_prefix(self, source: int, seq: int) -> None:
        """Give `seq` all of `source`'s cells (the shared prefix): with kv_unified, the cells are shared (meta
        data only); without, source's whole stream is copied into seq's, the only cross-stream seq_cp llama.cpp
        allows (p0 = p1 = -1: the whole sequence)."""
        lc.llama_memory_seq_cp(self.memory, source, seq, -1, -1)

    def remove(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)


def decode_prefix(context: Context, prefix: list[int], seq: int) -> None:
    for start in range(0, len(prefix), N_BATCH):
        context.decode([(t, start + i, seq, False) for i, t in enumerate(prefix[start:start + N_BATCH])])
