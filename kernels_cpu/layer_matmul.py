"""One layer's matmul read in place from the stacked weights: a C++ XLA FFI kernel (layer_matmul.cc) and its jnp reference.

Inside the model's layer scan, XLA:CPU copies each layer's slice of every stacked weight out before the
dot that reads it; in a decode step of a few rows those copies cost more than the dots (see
experiments/profile_steps.py). `layer_matmul(x, w, layer)` computes `x @ w[layer]` reading the slice
where it lies, from the panel layout the engine packs the weights into once (jaxinfer's panels.PanelTensor:
C panels of 64 output columns). `reference` is the same product in jnp, on the same packed arrays.

Axis letters: the table in kernels_cpu/__init__.py. Imports jax only.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_cpu import build

SOURCE = "layer_matmul.cc"
TARGET = "jaxinfer_layer_matmul_cpu_f32"
PANEL = 64  # output columns per panel (kPanel)


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferLayerMatmulF32"),))


def layer_matmul(x: Float[Array, "M I"], w: Float[Array, "N C I 64"], layer: Int[Array, ""]) -> Float[Array, "M F"]:
    """`x @ w[layer]` in f32, reading `w[layer]` in place. `w` holds C panels of 64 output columns
    (panels.PanelTensor's layout), giving F = 64 C output columns."""
    if not available():
        raise RuntimeError("the CPU layer-matmul kernel could not be built; see the warning above")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * w.shape[3]), jnp.float32))
    return call(x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32))


def reference(x: Float[Array, "M I"], w: Float[Array, "N C I 64"], layer: Int[Array, ""]) -> Float[Array, "M F"]:
    """`layer_matmul` in jnp: the same arguments and result, an f32 dot at full precision on `w[layer]`
    unpacked to [I, F] (column 64 c + j of the matrix is column j of panel c)."""
    panels = w[layer].astype(jnp.float32)  # [C, I, 64]
    matrix = panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)  # [I, F]
    return jnp.dot(x.astype(jnp.float32), matrix, precision="highest")  # [M, F]
