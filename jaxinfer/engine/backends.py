"""The one owner of the matmul path's rule: whether an engine's layer matmuls run through XLA's dot on the
loaded params ('xla'), through the CPU layer-matmul kernel on panels packed at start ('cpu', panels.py), as
W8A8 through XLA's int8 dot on int8 weights ('int8', quant.with_int8_activations), or as 'cpu' with every
Q8_0 / Q4_0 / Q4_1 / int8 matrix packed for the CPU quantized-matmul kernel, W8A8 in blocks of 32
('cpu_int8', panels.pack_panels(quantized=True), kernels_cpu/quant_matmul).

`EngineConfig.matmul_impl` asks; `resolve_matmul_impl` answers for the engine (engine.py), given the
attention it resolved. The tuner (tuning.py) measures both paths and pins one; left at 'auto' and not tuned,
the rule before tuning holds: panels exactly when the attention is the CPU kernel. Imports jax only to ask
the backend, and the CPU kernel only when 'cpu' is asked for.
"""

import functools

import jax

from jaxinfer.model.attention import CPU_IMPL


def resolve_matmul_impl(matmul_impl: str, attention_impl: str, *, dtype: str, on_mesh: bool, int8_weights: bool = False,
                        affine_weights: bool = False) -> str:
    """'xla', 'cpu', 'int8' or 'cpu_int8' for an EngineConfig.matmul_impl, given the resolved attention impl. 'auto' is
    'cpu' exactly when the attention is the CPU kernel (whose own check asks that the layer-matmul kernel
    builds; quantized matrices stay as they are there, only dense ones are packed). An explicit 'cpu', 'int8' or 'cpu_int8' that cannot run raises
    ValueError, naming why, before anything is packed. `int8_weights`: the params hold int8-coded matrices
    (quantization='int8', or a GGUF's Q8_0 tensors kept); `affine_weights`: they hold matrices the quantized
    kernel reads (panels.has_affine_weights: int8, or a GGUF's Q8_0, Q4_0 or Q4_1 tensors kept)."""
    if matmul_impl == "auto":
        return "cpu" if attention_impl == CPU_IMPL else "xla"
    if matmul_impl in ("cpu", "cpu_int8") and (obstacle := _cpu_matmul_obstacle(dtype, on_mesh, quantized=matmul_impl == "cpu_int8")):
        raise ValueError(f"matmul_impl={matmul_impl!r}: the CPU kernels {obstacle}; use matmul_impl='auto' or 'xla'")
    if matmul_impl == "cpu_int8" and not affine_weights:
        raise ValueError("matmul_impl='cpu_int8' multiplies quantized weights (int8, Q8_0, Q4_0, Q4_1) by int8 activations; load the model "
                         "with quantization='int8', or a GGUF with such tensors with quantization='gguf'")
    if matmul_impl == "int8" and not int8_weights:
        raise ValueError("matmul_impl='int8' multiplies int8 weights by int8 activations; load the model with quantization='int8' "
                         "(or a GGUF with Q8_0 tensors with quantization='gguf')")
    return matmul_impl


def _cpu_matmul_obstacle(dtype: str, on_mesh: bool, *, quantized: bool = False) -> str | None:
    """Why the CPU layer-matmul kernel (and, `quantized`, the quantized-matmul kernel) cannot serve this engine, or None if it can."""
    if jax.default_backend() != "cpu":
        return f"runs on the CPU backend only, not {jax.default_backend()!r}"
    if dtype != "float32":
        return f"needs a float32 model, got {dtype}"
    if on_mesh:
        return "runs on one device, not on a mesh"
    from kernels_cpu import layer_matmul, quant_matmul  # noqa: PLC0415  (built on first use)

    built = layer_matmul.available() and (not quantized or quant_matmul.available())
    return None if built else "could not be built (no C++ compiler?)"


def packer(matmul_impl: str):
    """What the engine does to the params for a resolved matmul impl before stepping, or None: 'cpu' packs
    the dense f32 matrices into the layer-matmul kernel's panels, 'cpu_int8' also the affine quantized ones
    into the quantized kernel's (both new arrays), 'int8' marks the int8 matrices W8A8 (the same arrays)."""
    from jaxinfer.model import panels, quant  # noqa: PLC0415

    return {"cpu": panels.pack_panels, "cpu_int8": functools.partial(panels.pack_panels, quantized=True),
            "int8": quant.with_int8_activations}.get(matmul_impl)
