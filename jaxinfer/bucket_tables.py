"""The one owner of bucket geometry: which program shapes exist, and which one a step gets.

`BucketTables` is frozen and derived once from an EngineConfig (`EngineConfig.tables`). The scheduler
asks it for the key of every plan it builds (`prefill_key`, `decode_key`) and the engine compiles
`all_keys()` at warm-up, so the two can never disagree: a plan's key is always one of the compiled keys.

A key is a `BucketKey` (phase, rows, tokens per row, pages per row). Prefill comes in two layouts:
- packed (the default): one row holds the chunks of up to `packed_seqs` sequences back to back, each
  with its own positions, slots and pages (segment-aware causal mask, see attention.py); the row's
  table is the concatenation of the sequences' pages. Keys are ("prefill", 1, T, W).
- unpacked: one sequence per row, `prefill_rows` rows, every row padded to the longest chunk.
Decode is one token per row: ("decode", R, 1, W).
Host-only: imports numpy-free helpers from buckets.py and never jax.
"""

import dataclasses
import functools

from jaxinfer.buckets import pad_to_bucket
from jaxinfer.request import BucketKey


@dataclasses.dataclass(frozen=True)
class BucketTables:
    page_size: int  # tokens per KV page
    chunk_tokens: tuple[int, ...]  # prefill tokens per row
    prefill_rows: tuple[int, ...]  # rows of an unpacked prefill step; (1,) when packed
    decode_rows: tuple[int, ...]  # sequences per decode step
    pages: tuple[int, ...]  # table widths, pages per row (decode and prefill)
    packed_seqs: int = 0  # sequences one packed prefill row holds at most; 0: unpacked prefill

    @property
    def packed(self) -> bool:
        return self.packed_seqs > 0

    @property
    def max_chunk(self) -> int:
        return self.chunk_tokens[-1]

    @property
    def max_prefill_rows(self) -> int:
        """Sequences one prefill step holds at most."""
        return self.packed_seqs if self.packed else self.prefill_rows[-1]

    @property
    def max_decode_rows(self) -> int:
        return self.decode_rows[-1]

    @property
    def max_pages(self) -> int:
        return self.pages[-1]

    def samples_per_row(self, phase: str) -> int:
        """Logit positions a row of this phase samples: a packed prefill row samples each sequence's last token."""
        return self.packed_seqs if phase == "prefill" and self.packed else 1

    def first_chunk_width(self, tokens: int) -> int:
        """Narrowest table of a prefill program with `tokens` tokens per row: enough pages to hold them."""
        return pad_to_bucket(min(-(-tokens // self.page_size), self.max_pages), self.pages)

    def prefill_widths(self, tokens: int) -> tuple[int, ...]:
        return tuple(w for w in self.pages if w >= self.first_chunk_width(tokens))

    def prefill_key(self, num_rows: int, num_tokens: int, num_pages: int) -> BucketKey:
        """Key of a prefill step: `num_rows` rows (1 when packed), the longest row's tokens, and the most
        pages a row's table holds (the sum over a packed row's sequences)."""
        tokens = pad_to_bucket(num_tokens, self.chunk_tokens)
        width = max(pad_to_bucket(num_pages, self.pages), self.first_chunk_width(tokens))
        return BucketKey("prefill", pad_to_bucket(num_rows, self.prefill_rows), tokens, width)

    def decode_key(self, num_rows: int, num_pages: int) -> BucketKey:
        return BucketKey("decode", pad_to_bucket(num_rows, self.decode_rows), 1, pad_to_bucket(num_pages, self.pages))

    @functools.cached_property
    def _keys(self) -> tuple[BucketKey, ...]:
        prefill = [BucketKey("prefill", r, t, w) for r in self.prefill_rows for t in self.chunk_tokens for w in self.prefill_widths(t)]
        decode = [BucketKey("decode", r, 1, w) for r in self.decode_rows for w in self.pages]
        return tuple(prefill + decode)

    def all_keys(self) -> list[BucketKey]:
        """Every key a plan can have, prefill first; warm-up compiles exactly these."""
        return list(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys
