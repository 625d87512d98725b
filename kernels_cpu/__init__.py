"""CPU kernels owned by jaxinfer: C++ XLA FFI custom calls, built on first use, each checked against the
jnp path in jaxinfer/attention.py. Import from the kernel module. Must not import jaxinfer."""
