"""CPU kernels owned by jaxinfer: C++ XLA FFI custom calls, built on first use (build.py).

Each `<name>.py` beside its `<name>.cc` holds the jitted call and a plain-jnp `reference(...)` with the
same arguments and result: the oracle the kernel is tested against, and a path that runs everywhere (as
ggml keeps one generic path for fallback and oracle). The kernels check what they index with (layers,
page ids) and return an error naming a bad value instead of reading outside their buffers. Import from the
kernel module. Must not import jaxinfer.

Axis letters, one meaning each in every .cc and .py here (shared with jaxinfer/model/forward.py's table
where both have the letter):
    N  layers of a stacked pool or weight (the `layer` argument picks one)
  paged attention
    B  rows of a step · T query tokens per row · H query heads · G kv heads · Q query heads per kv head (H/G)
    K  head dim · P pages of the pool (per layer and kv head; page ids lie in [0, P)) · L slots per page
    E  entries of a row's block table · S key/value slots of a row (E L, the reference's flattened view)
  matmuls (layer_matmul, quant_matmul, kquant_matmul)
    M  rows of activations · I inputs (the contraction) · F output columns · C panels of output columns
    A  blocks of 32 inputs (I / 32), one activation scale and one weight scale each · b the block's length
    U  rows of 64 code bytes in a panel (I / 4 for 8-bit codes, I / 8 for 4-bit) · Z weight scales per column
    J  a K-quant field's scale groups per column: sub-blocks (I / 32; I / 16 for q6_k) or super-blocks (I / 256)
"""
