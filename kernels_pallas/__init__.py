"""Pallas kernels owned by jaxinfer, one module per kernel, each beside its pure-jnp reference.

Import from the kernel module (`from kernels_pallas.paged_attention import paged_attention`).
Nothing is re-exported here: a function re-exported under its module's name would shadow the
module (`kernels_pallas.paged_attention` would stop being importable as a module).
Must not import jaxinfer: experiments run these files from a bare source tree.
"""
