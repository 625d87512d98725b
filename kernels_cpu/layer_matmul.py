"""One layer's matmul read in place from the stacked weights: a C++ XLA FFI kernel (layer_matmul.cc).

Inside the model's layer scan, XLA:CPU copies each layer's slice of every stacked weight out before the
dot that reads it; in a decode step of a few rows those copies cost more than the dots (see
experiments/profile_steps.py). `layer_matmul(x, w, layer)` computes `x @ w[layer]` reading the slice
where it lies, from the panel layout the engine packs the weights into once (panels.PanelTensor). The
reference is `x @ w[layer]` in jnp on the unpacked matrix.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_cpu import build

SOURCE = "layer_matmul.cc"
TARGET = "jaxinfer_layer_matmul_cpu_f32"


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferLayerMatmulF32"),))


def layer_matmul(x: Float[Array, "M K"], w: Float[Array, "N P K C"], layer: Int[Array, ""]) -> Float[Array, "M F"]:
    """`x @ w[layer]` in f32, reading `w[layer]` in place. `w` holds panels of C = 64 output columns
    (panels.PanelTensor's layout), giving F = 64 P output columns."""
    if not available():
        raise RuntimeError("the CPU layer-matmul kernel could not be built; see the warning above")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * w.shape[3]), jnp.float32))
    return call(x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32))
