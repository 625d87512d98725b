"""The exact reference of the W8A8 CPU kernels' arithmetic: the dense forward with fake-quantized activations.

Owns the activation rule's Python statement for every weight format the quantized CPU kernels read
(`activation_block`: which block a weight's activations are quantized in; `fake_quantize`: the kernels' int8
codes times their scale, kernels_cpu/w8a8.h `quantize_group`, by kernels_cpu/quant_matmul.quantize_activations,
the one jnp quantizer), the marker `FakeQuantWeight`, and `with_fake_quant`, which turns params into the
reference's: every matrix the kernels would read (panels.kernel_reads) is read dense, exactly dequantized a
layer at a time, and multiplied in f32 with its activations quantized and dequantized by the kernels' rule.
What remains between one kernel matmul and this reference is the order of f32 sums (about 5e-7 relative), not
the activations' 8 bits (about 1e-2 against f32 activations): `kernel_matmul_error` checks that per matmul. A whole
model is looser (a last bit can move a code across a rounding half: engine/numerics_check.py).

Imports jax, quant, panel_tensors and the kernels' jnp modules; panels.py imports this module (its `einsum`
reads the marks), and `with_fake_quant` imports panels lazily.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.model import quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor, StackedWeight
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


def with_fake_quant(params):
    """`params` read by the exact reference: every matrix the W8A8 kernels would read under matmul 'cpu_int8'
    (panels.kernel_reads) read dense with its activations fake-quantized: K-quant ones as KQuantPanelTensors
    marked read=READ (packed, exactly, where they are not yet), affine ones as FakeQuantWeight; a tied head that
    the kernels read gets its own lm_head in the same form (the embedding stays for the lookup). Everything else
    (dense matrices, formats no kernel reads, norms) is left as it is, as the kernels' engine leaves it."""
    from jaxinfer.model import panels  # noqa: PLC0415  (panels imports this module)

    def mark(value):
        if not panels.kernel_reads(value):
            return value
        if isinstance(value, quant.QuantizedTensor) and value.format in quant.AFFINE_FORMATS:
            return FakeQuantWeight(value)
        packed = value if isinstance(value, KQuantPanelTensor) else panels.to_kquant_panels(value)
        return dataclasses.replace(packed, read=READ)

    layers = {f.name: mark(getattr(params.layers, f.name)) for f in dataclasses.fields(params.layers)}
    head = params.lm_head
    if head is None and panels.kernel_reads(params.embed):
        head = _embed_as_head(params.embed)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **layers), lm_head=None if head is None else mark(head))


def _embed_as_head(embed):
    """A tied quantized embedding [V, D] (out_in) as the head [D, V]: the same stored rows, logical layout in_out
    (K-quant panels packed at load included: loading keeps a tied K-quant table once, as the head's panels)."""
    return dataclasses.replace(embed, layout="in_out") if isinstance(embed, (quant.QuantizedTensor, KQuantPanelTensor)) else embed


def kernel_matmul_error(step_params, params, num_rows: int = 4, seed: int = 0) -> float:
    """The largest relative error, ||kernel - reference|| / ||reference||, of the W8A8 kernels' matmuls against this
    reference on the same activations: for every layer matrix they read in `step_params` (matmul 'cpu_int8''s packed
    params, panels.pack_panels(quantized=True)), the first layer of each of its formats, multiplied by `num_rows` seeded
    rows (normal, scaled per row, an outlier channel) through panels.einsum both ways. The tight check that a kernel
    computes what it claims on this machine (3e-7..5e-7 measured); a whole model's logits cannot be held so tightly
    (module docstring of engine/numerics_check.py). `params`: the loaded params `step_params` were packed from."""
    from jaxinfer.model import panels  # noqa: PLC0415  (panels imports this module)

    reference = with_fake_quant(panels.with_read(params, "dense"))
    errors = [0.0]
    for field in dataclasses.fields(step_params.layers):
        kernel_w, reference_w = getattr(step_params.layers, field.name), getattr(reference.layers, field.name)
        for layer in _first_layer_of_each_format(reference_w):
            x = _probe_rows(reference_w, num_rows, seed)
            spec = _rows_spec(x.ndim - 1, len(_out_shape(reference_w)))
            ours = panels.einsum(spec, x, StackedWeight(kernel_w, jnp.int32(layer)))
            theirs = panels.einsum(spec, x, _layer(reference_w, layer))
            errors.append(float(jnp.linalg.norm(ours - theirs) / jnp.maximum(jnp.linalg.norm(theirs), 1e-30)))
    return max(errors)


def _first_layer_of_each_format(w) -> list[int]:
    """Layer indices to check of a layer matrix this reference marks: the first of each part (one for a single format)."""
    if isinstance(w, FakeQuantWeight):
        return [0]
    if isinstance(w, KQuantPanelTensor) and w.read == READ:
        return [w.layer_part.index(part) for part in range(len(w.parts))]
    return []


def _out_shape(w) -> tuple[int, ...]:
    return (w.weight if isinstance(w, FakeQuantWeight) else w).out_shape


def _layer(w, layer: int):
    """Layer `layer` of a marked stack, as the model's layer scan hands it to panels.einsum."""
    if isinstance(w, FakeQuantWeight):
        return jax.tree.map(lambda a: a[layer], w)
    return StackedWeight(w, jnp.int32(layer))


def _probe_rows(w, num_rows: int, seed: int) -> Float[Array, "M ..."]:
    """[num_rows, *in_shape] f32: normal, a scale per row from 0.1 to 10, input 5 thirty times larger (an outlier)."""
    in_shape = (w.weight if isinstance(w, FakeQuantWeight) else w).in_shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, int(np.prod(in_shape)))) * rng.uniform(0.1, 10, (num_rows, 1))
    x[:, 5] *= 30
    return jnp.asarray(x.reshape(num_rows, *in_shape), jnp.float32)


def _rows_spec(num_in: int, num_out: int) -> str:
    """'rows @ matrix' with num_in contracted and num_out output axes, e.g. "mab,abc->mc"."""
    ins, outs = "abcdefg"[:num_in], "nopqrst"[:num_out]
    return f"m{ins},{ins}{outs}->m{outs}"
