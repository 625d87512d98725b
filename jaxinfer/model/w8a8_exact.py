"""The W8A8 CPU kernels' exact reference made from a model's params, and the per-matmul check against it.

`with_fake_quant` turns params into the reference's (every matrix the kernels would read, panels.kernel_reads,
marked to be read dense with activations fake-quantized by the kernels' rule: w8a8_reference.py owns the rule
and the marks, which panels.einsum reads); `kernel_matmul_error` multiplies the same rows through a kernel
engine's packed matrices and through the reference's. Used by the tuner's numerics check and the benchmarks'.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxinfer.model import panels, quant, w8a8_reference
from jaxinfer.model.panel_tensors import KQuantPanelTensor, QuantPanelTensor, StackedWeight, head_view


def with_fake_quant(params):
    """`params` read by the exact reference: every matrix the W8A8 kernels would read under matmul 'cpu_int8'
    (panels.kernel_reads) read dense with its activations fake-quantized: K-quant ones as KQuantPanelTensors
    marked read=w8a8_reference.READ (packed, exactly, where they are not yet), affine ones as w8a8_reference.FakeQuantWeight; a tied head that
    the kernels read gets its own lm_head in the same form (the embedding stays for the lookup). Everything else
    (dense matrices, formats no kernel reads, norms) is left as it is, as the kernels' engine leaves it."""
    def mark(value):
        if not panels.kernel_reads(value):
            return value
        if isinstance(value, quant.QuantizedTensor) and value.format in quant.AFFINE_FORMATS:
            return w8a8_reference.FakeQuantWeight(value)
        packed = value if isinstance(value, (KQuantPanelTensor, QuantPanelTensor)) else panels.to_kquant_panels(value)  # the latter: a tied table kept once
        return dataclasses.replace(packed, read=w8a8_reference.READ)

    layers = {f.name: mark(getattr(params.layers, f.name)) for f in dataclasses.fields(params.layers)}
    head = params.lm_head
    if head is None and panels.kernel_reads(params.embed):
        head = _embed_as_head(params.embed)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **layers), lm_head=None if head is None else mark(head))


def _embed_as_head(embed):
    """A tied quantized embedding [V, D] (out_in) as the head [D, V]: head_view, the same stored rows with layout
    in_out (block tensors too, and the panels loading packs a tied K-quant or Q8_0 table into)."""
    return head_view(embed) if isinstance(embed, (quant.QuantizedTensor, KQuantPanelTensor, QuantPanelTensor)) else embed


def kernel_matmul_error(step_params, params, num_rows: int = 4, seed: int = 0) -> float:
    """The largest relative error, ||kernel - reference|| / ||reference||, of the W8A8 kernels' matmuls against this
    reference on the same activations: for every layer matrix they read in `step_params` (matmul 'cpu_int8''s packed
    params, panels.pack_panels(quantized=True)), the first layer of each of its formats, multiplied by `num_rows` seeded
    rows (normal, scaled per row, an outlier channel) through panels.einsum both ways. The tight check that a kernel
    computes what it claims on this machine (3e-7..5e-7 measured); a whole model's logits cannot be held so tightly
    (module docstring of engine/numerics_check.py). `params`: the loaded params `step_params` were packed from."""
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
    if isinstance(w, w8a8_reference.FakeQuantWeight):
        return [0]
    if isinstance(w, KQuantPanelTensor) and w.read == w8a8_reference.READ:
        return [w.layer_part.index(part) for part in range(len(w.parts))]
    return []


def _out_shape(w) -> tuple[int, ...]:
    return (w.weight if isinstance(w, w8a8_reference.FakeQuantWeight) else w).out_shape


def _layer(w, layer: int):
    """Layer `layer` of a marked stack, as the model's layer scan hands it to panels.einsum."""
    if isinstance(w, w8a8_reference.FakeQuantWeight):
        return jax.tree.map(lambda a: a[layer], w)
    return StackedWeight(w, jnp.int32(layer))


def _probe_rows(w, num_rows: int, seed: int) -> Float[Array, "M ..."]:
    """[num_rows, *in_shape] f32: normal, a scale per row from 0.1 to 10, input 5 thirty times larger (an outlier)."""
    in_shape = (w.weight if isinstance(w, w8a8_reference.FakeQuantWeight) else w).in_shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, int(np.prod(in_shape)))) * rng.uniform(0.1, 10, (num_rows, 1))
    x[:, 5] *= 30
    return jnp.asarray(x.reshape(num_rows, *in_shape), jnp.float32)


def _rows_spec(num_in: int, num_out: int) -> str:
    """'rows @ matrix' with num_in contracted and num_out output axes, e.g. "mab,abc->mc"."""
    ins, outs = "abcdefg"[:num_in], "nopqrst"[:num_out]
    return f"m{ins},{ins}{outs}->m{outs}"
