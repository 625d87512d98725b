"""The exact reference of the W8A8 CPU kernels' arithmetic: the dense forward with fake-quantized activations.

Owns the activation rule's Python statement for every weight format the quantized CPU kernels read
(`activation_block`: which block a weight's activations are quantized in; `fake_quantize`: the kernels' int8
codes times their scale, kernels_cpu/w8a8.h `quantize_group`, by kernels_cpu/quant_matmul.quantize_activations,
the one jnp quantizer), the marker `FakeQuantWeight` and its einsum; w8a8_exact.with_fake_quant turns params into the
reference's: every matrix the kernels would read (panels.kernel_reads) is read dense, exactly dequantized a
layer at a time, and multiplied in f32 with its activations quantized and dequantized by the kernels' rule.
What remains between one kernel matmul and this reference is the order of f32 sums (about 5e-7 relative), not
the activations' 8 bits (about 1e-2 against f32 activations): w8a8_exact.kernel_matmul_error checks that per
matmul. A whole model is looser (a last bit can move a code across a rounding half: engine/numerics_check.py).

Imports jax, quant, panel_tensors and the kernels' jnp modules; panels.py imports this module (its `einsum`
reads the marks). Turning params into the reference's (`with_fake_quant`) needs panels, so it lives above
both, in w8a8_exact.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer.model import quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor
from kernels_cpu import kquant_matmul, quant_matmul

READ = "w8a8"  # KQuantPanelTensor.read of a K-quant matrix read by this reference


def activation_block(fmt: str) -> int:
    """Inputs per activation scale where a kernel reads a weight of format `fmt`: 256 for the K-quants (llama.cpp's
    Q8_K, kquant_matmul.GROUP), 32 for Q5_0 / Q5_1 and the affine formats (quant_matmul.BLOCK)."""
    if fmt in kquant_matmul.GROUP:
        return kquant_matmul.GROUP[fmt]
    if fmt in quant.AFFINE_FORMATS:
        return quant_matmul.BLOCK
    raise ValueError(f"no W8A8 kernel reads format {fmt!r}")


def fake_quantize(x: Float[Array, "... I"], block: int) -> Float[Array, "... I"]:
    """x quantized as the kernels quantize it, then dequantized in f32: per `block` inputs of each row, codes
    round(x * f32(127 / max|x|)) (an f32 product, half to even) clamped to [-127, 127], times max|x| / 127."""
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [M, I]
    codes, scale = quant_matmul.quantize_activations(rows, block)  # [M, I/b, b] int8, [M, I/b]
    return (codes.astype(jnp.float32) * scale[..., None]).reshape(x.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeQuantWeight:
    """An affine quantized matrix (or stack: quant.AFFINE_FORMATS, a QuantizedTensor in its logical layout) that
    the reference reads dense with its activations fake-quantized in blocks of 32. A pytree of the tensor's
    arrays, so a layer scan slices it as it slices the tensor."""

    weight: quant.QuantizedTensor


def _input_letters(spec: str, num_lead: int, w: quant.QuantizedTensor) -> tuple[str, str, str]:
    """(x's subscripts, the weight's input subscripts in storage order, output) of a matmul spec."""
    inputs, _, output = spec.replace(" ", "").partition("->")
    x_subs, _, w_subs = inputs.partition(",")
    logical = w_subs[num_lead:]
    num_in = len(w.in_shape)
    return x_subs, (logical[:num_in] if w.layout == "in_out" else logical[-num_in:]), output


def einsum(spec: str, x: Float[Array, "..."], w: FakeQuantWeight, *, preferred_element_type=None) -> Float[Array, "..."]:
    """`quant.qeinsum(spec, fake_quantize(x), w.weight)`, x's blocks of 32 running along the weight's flattened
    inputs, which must be x's trailing axes in the weight's order (the kernels' "rows @ matrix")."""
    inner = dataclasses.replace(w.weight, activations="float")
    x_subs, in_subs, _ = _input_letters(spec, inner.codes.ndim - 2, inner)
    if not x_subs.endswith(in_subs):
        raise ValueError(f"a fake-quantized read multiplies rows @ matrix: x's trailing axes are the weight's inputs; got {spec!r}")
    rows = x.reshape(*x.shape[: x.ndim - len(in_subs)], -1)  # [..., I]
    x_hat = fake_quantize(rows, activation_block(inner.format)).reshape(x.shape).astype(x.dtype)
    return quant.qeinsum(spec, x_hat, inner, preferred_element_type=preferred_element_type)


def fake_quantize_for(x: Float[Array, "M I"], w: KQuantPanelTensor, index: Int[Array, ""] | None) -> Float[Array, "M I"]:
    """x fake-quantized in the block of the format that stores layer `index` of `w` (chosen by `lax.switch` when
    its parts' blocks differ; None: an unstacked matrix, one part)."""
    blocks = [activation_block(fmt) for fmt in w.formats]
    if index is None or len(set(blocks)) == 1:
        return fake_quantize(x, blocks[0])
    part_of = jnp.asarray(w.layer_part, jnp.int32)[index]
    return jax.lax.switch(part_of, [lambda v, b=b: fake_quantize(v, b) for b in blocks], x)
