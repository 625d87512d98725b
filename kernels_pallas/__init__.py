"""Pallas kernels owned by jaxinfer, each beside its pure-jnp reference.

Must not import jaxinfer: experiments run these files from a bare source tree.
"""

from kernels_pallas.paged_attention import (
    PagedAttentionConfig,
    TUNED_TABLE,
    config_for,
    paged_attention,
    paged_attention_reference,
    validate_block_tables,
)

__all__ = [
    "PagedAttentionConfig",
    "TUNED_TABLE",
    "config_for",
    "paged_attention",
    "paged_attention_reference",
    "validate_block_tables",
]
