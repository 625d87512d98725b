"""The jaxtyping annotations of model.py and attention.py, checked by beartype while the real forward runs.

Every public function of model.py, and attention.attend / attention_reference / attention_over_pages, is
replaced by its `jaxtyped(typechecker=beartype)` wrapper inside those modules, so the calls that `forward`
makes internally are checked too (jaxtyping checks while tracing, so the scan body is checked once per
call). The forward runs on the tiny Llama with no cache, a dense cache and the paged pool, with and
without `logit_indices`. Controls put back known-wrong annotations and show that they are caught; a
last test checks that every axis letter in those annotations is declared in model.py's docstring.
"""

import collections
import functools
import re
import types
import typing

import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jaxtyping import Array, Float, Int, TypeCheckError, jaxtyped

from jaxinfer.model import attention, forward as model
from jaxinfer.model import kv_pool as kvp

PAGE = 8
CHECKED = {
    model: ("rms_norm", "rotary_frequencies", "rope", "attention_inputs", "mlp", "logits_from_hidden", "forward"),
    attention: ("attend", "attention_reference", "attention_over_pages"),
}


def _checked(function, calls: collections.Counter):
    checked = jaxtyped(typechecker=beartype)(function)

    @functools.wraps(function)
    def counted(*args, **kwargs):
        calls[function.__name__] += 1
        return checked(*args, **kwargs)

    return counted


def _with_annotations(function, **annotations):
    """A copy of `function` whose annotations differ by `annotations` (`return_` for the return type)."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = {**function.__annotations__, **{name.rstrip("_"): kind for name, kind in annotations.items()}}
    return copy


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Installs the checked wrappers in model.py and attention.py; counts the calls to each."""
    counter = collections.Counter()
    for module, names in CHECKED.items():
        for name in names:
            monkeypatch.setattr(module, name, _checked(getattr(module, name), counter))
    return counter


def _tokens(cfg, batch: int, length: int):
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length))
    return jnp.asarray(ids, jnp.int32), jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def _paged_meta(tables: np.ndarray, positions: np.ndarray) -> kvp.PageMeta:
    slot_pages = np.take_along_axis(tables, positions // PAGE, axis=1)
    return kvp.PageMeta(jnp.asarray(tables), jnp.asarray(slot_pages, jnp.int32), jnp.asarray(positions % PAGE, jnp.int32))


@pytest.mark.parametrize("with_logit_indices", [False, True])
def test_forward_without_cache_passes_the_checker(tiny_llama, calls, with_logit_indices):
    cfg, params = tiny_llama
    tokens, positions = _tokens(cfg, 2, 5)
    indices = jnp.array([4, 2], jnp.int32) if with_logit_indices else None
    logits, cache = model.forward(params, None, tokens, positions, cfg=cfg, logit_indices=indices)
    assert logits.shape == (2, 1 if with_logit_indices else 5, cfg.vocab_size) and cache is None
    assert set(calls) == {"forward", "rms_norm", "rotary_frequencies", "rope", "attention_inputs", "mlp", "attend", "attention_reference", "logits_from_hidden"}


@pytest.mark.parametrize("with_logit_indices", [False, True])
def test_forward_over_paged_pool_passes_the_checker_in_prefill_and_decode(tiny_llama, calls, with_logit_indices):
    cfg, params = tiny_llama
    tokens, positions = _tokens(cfg, 2, 11)
    tables = np.array([[3, 5, 0], [6, 1, 2]], np.int32)  # shuffled pages, null-padded
    pool = kvp.init_pool(cfg, 8, PAGE)
    indices = jnp.array([10, 6], jnp.int32) if with_logit_indices else None
    prefill_pages = _paged_meta(tables, np.asarray(positions))
    logits, pool = model.forward(params, pool, tokens, positions, cfg=cfg, pages=prefill_pages, logit_indices=indices)
    assert logits.shape == (2, 1 if with_logit_indices else 11, cfg.vocab_size) and isinstance(pool, kvp.KVPool)
    decode_positions = np.array([[11], [11]], np.int32)
    decode_pages = _paged_meta(tables, decode_positions)
    logits, pool = model.forward(params, pool, tokens[:, :1], jnp.asarray(decode_positions), cfg=cfg, pages=decode_pages)
    assert logits.shape == (2, 1, cfg.vocab_size)
    assert {"forward", "rms_norm", "rotary_frequencies", "rope", "attention_inputs", "mlp", "attend", "attention_over_pages", "logits_from_hidden"} == set(calls)


def test_forward_over_dense_cache_passes_the_checker_with_two_rows(tiny_llama, calls):
    """The dense path shares one [1, S] row of slot positions across the batch (`#B S`)."""
    cfg, params = tiny_llama
    tokens, positions = _tokens(cfg, 2, 6)
    logits, cache = model.forward(params, kvp.init_dense_cache(cfg, 2, 16), tokens, positions, cfg=cfg)
    assert logits.shape == (2, 6, cfg.vocab_size) and isinstance(cache, kvp.DenseKVCache)
    assert calls["attention_reference"] == 1


@pytest.mark.parametrize("family", ["tiny_llama3", "tiny_llama_dynamic", "tiny_qwen2", "tiny_qwen3"])
def test_family_features_pass_the_checker_without_cache_and_over_the_paged_pool(calls, family):
    """Rope scaling (per-row frequencies when dynamic), q/k/v biases and q/k norm, each under beartype."""
    from conftest import FIXTURES
    from jaxinfer.loading.loading import load_model

    cfg, params = load_model(FIXTURES / family, max_context=256)
    tokens, positions = _tokens(cfg, 2, 11)
    logits, _ = model.forward(params, None, tokens, positions, cfg=cfg)
    assert logits.shape == (2, 11, cfg.vocab_size)
    tables = np.array([[3, 5, 0], [6, 1, 2]], np.int32)
    pool = kvp.init_pool(cfg, 8, PAGE)
    logits, pool = model.forward(params, pool, tokens, positions, cfg=cfg, pages=_paged_meta(tables, np.asarray(positions)))
    assert logits.shape == (2, 11, cfg.vocab_size)
    assert calls["attention_inputs"] == 2 and calls["rotary_frequencies"] == 2 and calls["rms_norm"] >= (10 if cfg.qk_norm else 6)


def test_control_rotary_frequencies_claiming_one_row_per_batch_row_fails(tiny_llama, monkeypatch):
    """Plain rope returns one shared row of frequencies ([1, R]); an annotation "B R" is caught."""
    cfg, params = tiny_llama
    wrong = _with_annotations(model.rotary_frequencies, return_=Float[Array, "B R"])
    monkeypatch.setattr(model, "rotary_frequencies", jaxtyped(typechecker=beartype)(wrong))
    tokens, positions = _tokens(cfg, 2, 3)
    with pytest.raises(TypeCheckError, match="return"):
        model.forward(params, None, tokens, positions, cfg=cfg)


def test_control_old_forward_annotation_fails_with_logit_indices(tiny_llama):
    """The annotation `forward` had before ("B T V" for [B, 1, V] logits) is caught, and only when it is wrong."""
    cfg, params = tiny_llama
    tokens, positions = _tokens(cfg, 2, 5)
    wrong_return = tuple[Float[Array, "B T V"], kvp.DenseKVCache | kvp.KVPool | None]
    checked = jaxtyped(typechecker=beartype)(_with_annotations(model.forward, return_=wrong_return))
    checked(params, None, tokens, positions, cfg=cfg)  # [B, T, V]: the old annotation held here
    with pytest.raises(TypeCheckError, match="return"):
        checked(params, None, tokens, positions, cfg=cfg, logit_indices=jnp.array([4, 2], jnp.int32))


def test_control_old_k_positions_annotation_fails_on_dense_cache(tiny_llama, monkeypatch):
    """attention_reference with k_positions annotated "B S" (before this test existed) rejects the dense path."""
    cfg, params = tiny_llama
    wrong = _with_annotations(attention.attention_reference, k_positions=Int[Array, "B S"])
    monkeypatch.setattr(attention, "attention_reference", jaxtyped(typechecker=beartype)(wrong))
    tokens, positions = _tokens(cfg, 2, 6)
    with pytest.raises(TypeCheckError, match="k_positions"):
        model.forward(params, kvp.init_dense_cache(cfg, 2, 16), tokens, positions, cfg=cfg)


def test_control_wrong_rope_annotation_fails(tiny_llama, monkeypatch):
    """rope claiming to move the head axis ("B T K X" out) is caught inside the scan body."""
    cfg, params = tiny_llama
    wrong = _with_annotations(model.rope, return_=Float[Array, "B T K X"])
    monkeypatch.setattr(model, "rope", jaxtyped(typechecker=beartype)(wrong))
    tokens, positions = _tokens(cfg, 1, 3)
    with pytest.raises(TypeCheckError, match="return"):
        model.forward(params, None, tokens, positions, cfg=cfg)


def _declared_axes() -> set[str]:
    """Axis letters of the model.py docstring block "Axis letters used in ...:" (`X name · Y name`)."""
    block = model.__doc__.split("Axis letters used in", 1)[1].split(":", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"(?:^|·)\s*([A-Z])\s", block, flags=re.MULTILINE))


def _annotation_axes(function) -> set[str]:
    """Named axes in a function's jaxtyping annotations, walking unions and tuples."""
    axes, pending = set(), list(typing.get_type_hints(function).values())
    while pending:
        hint = pending.pop()
        pending.extend(typing.get_args(hint))
        for dim in getattr(hint, "dim_str", "").split():
            name = dim.lstrip("#*")
            if name not in ("", "_", "...") and not name.isdigit():
                axes.add(name)
    return axes


@pytest.mark.parametrize("module, name", [(module, name) for module, names in CHECKED.items() for name in names])
def test_annotations_use_only_axes_declared_in_model_docstring(module, name):
    assert _annotation_axes(getattr(module, name)) <= _declared_axes()


def test_control_undeclared_axis_is_reported():
    assert _declared_axes() >= {"B", "T", "S", "D", "H", "G", "Q", "K", "F", "V", "N", "P", "L", "X", "R"}
    assert _annotation_axes(_with_annotations(model.rope, x=Float[Array, "B T Y K"])) - _declared_axes() == {"Y"}
