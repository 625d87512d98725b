"""An unstacked K-quant head packed at load (kept_blocks.kept_weight) is packed panels.PACK_ROWS output rows at a
time into its preallocated panels: the same panels as kquant_matmul.pack of the whole stored matrix."""

import gguf
import jax.numpy as jnp
import numpy as np

from conftest import FIXTURES
from jaxinfer.loading import loading
from jaxinfer.model import panels, quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor
from kernels_cpu import kquant_matmul

SOURCE = FIXTURES / "kquant" / "q6_k.gguf"  # an untied Q6_K head of 256 rows


def test_a_head_packed_at_load_in_row_slices_equals_the_whole_matrix_packed(monkeypatch):
    monkeypatch.setattr(panels, "PACK_ROWS", 96)  # slices of 96, 96 and 64 rows
    cfg, params = loading.load_model(SOURCE, quantization="gguf", kquant_panels=True)
    head = params.lm_head
    assert isinstance(head, KQuantPanelTensor) and not head.stacked and head.formats == ("q6_k",)
    stored = {t.name: t for t in gguf.GGUFReader(str(SOURCE)).tensors}["output.weight"]
    q = quant.from_gguf(np.asarray(stored.data), int(stored.tensor_type), out_shape=(cfg.vocab_size,), in_shape=(cfg.embed_dim,), layout="in_out")
    whole = kquant_matmul.pack("q6_k", {name: jnp.asarray(a) for name, a in quant.array_fields(q).items()})
    assert head.parts[0].keys() == whole.keys()
    for name in whole:
        np.testing.assert_array_equal(np.asarray(head.parts[0][name]), np.asarray(whole[name]), err_msg=name)
