"""The CLI restates no library choice or default: each flag's choices and default are the library's own
(LoadOptions, SamplingParams, EngineConfig, the truncate sides), so changing one there changes the CLI."""

import dataclasses

import pytest

from jaxinfer import cli
from jaxinfer.config import ATTENTION_IMPLS, DTYPES, KV_CACHE_DTYPES, MATMUL_IMPLS, EngineConfig
from jaxinfer.options import DTYPE_CHOICES, INT4_GROUP_SIZES, QUANTIZATIONS, LoadOptions
from jaxinfer.scheduling.request import TRUNCATE_SIDES, SamplingParams
from jaxinfer.validation import FieldError


def generate_actions() -> dict:
    parser = cli._build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")  # argparse keeps them here
    return {a.dest: a for a in subparsers.choices["generate"]._actions}


@pytest.mark.parametrize(
    "dest, choices",
    [("dtype", DTYPE_CHOICES), ("quantization", ("none", *QUANTIZATIONS)), ("group_size", INT4_GROUP_SIZES), ("attention", ATTENTION_IMPLS), ("matmul", MATMUL_IMPLS),
     ("kv_cache_dtype", KV_CACHE_DTYPES), ("truncate", TRUNCATE_SIDES)],
)
def test_flag_choices_are_the_library_s_constants(dest, choices):
    assert tuple(generate_actions()[dest].choices) == tuple(choices)


def test_flag_defaults_are_the_library_s_defaults():
    actions, load, sampling, engine = generate_actions(), LoadOptions(), SamplingParams(), EngineConfig()
    for field in ("dtype", "quantization", "group_size", "tensor_parallel", "data_parallel"):
        assert actions[field].default == getattr(load, field), field
    for field in ("temperature", "top_k", "top_p", "seed", "max_tokens"):
        assert actions[field].default == getattr(sampling, field), field
    for flag, field in (("max_context", "max_context"), ("max_num_seqs", "max_num_seqs"), ("max_prefill_tokens", "max_prefill_tokens"), ("page_size", "page_size"),
                        ("engine_seed", "seed"), ("policy_epoch", "policy_epoch")):
        assert actions[flag].default == getattr(engine, field), flag
    assert actions["truncate"].default == "none" and actions["attention"].default == engine.attention_impl
    assert actions["matmul"].default == engine.matmul_impl == "auto"


def test_every_limit_whatif_can_change_is_a_generate_flag_that_reaches_the_engine_config():
    """`jaxinfer whatif` prints its best settings as flags; those a job takes reach its EngineConfig, a bad one named by its flag."""
    parser = cli._build_parser()
    args = parser.parse_args(["generate", "--input", "in.jsonl", "--output", "out.jsonl", "--max-num-seqs", "8", "--max-prefill-tokens", "128", "--num-pages", "300"])
    cfg = cli._engine_config(args)
    assert (cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.num_pages) == (8, 128, 300)
    with pytest.raises(ValueError, match="--max-prefill-tokens must be >= 1"):
        cli._engine_config(parser.parse_args(["generate", "--input", "in.jsonl", "--output", "out.jsonl", "--max-prefill-tokens", "0"]))


def test_load_options_refuse_bad_values_naming_the_field():
    for fields, name in (({"dtype": "float64"}, "dtype"), ({"quantization": "q2"}, "quantization"), ({"group_size": 32}, "group_size"),
                         ({"tensor_parallel": 0}, "tensor_parallel"), ({"parse_special": "yes"}, "parse_special")):
        with pytest.raises(FieldError) as error:
            LoadOptions(**fields)
        assert error.value.field == name


def test_llm_takes_options_or_their_fields_not_both():
    from jaxinfer.api import LLM

    with pytest.raises(FieldError, match="pass one or the other"):
        LLM(options=LoadOptions(), dtype="bfloat16")
    assert dataclasses.asdict(LoadOptions())["dtype"] == "auto"


def test_dtype_auto_is_the_default_and_loads_float32():
    """vLLM's dtype="auto": the tuner picks; the model loads in float32 (the tuner's reference) and a dtype
    given is passed through unchanged, pinned."""
    assert LoadOptions().dtype == "auto" and DTYPE_CHOICES == ("auto", *DTYPES)
    assert LoadOptions().load_kwargs["dtype"] == "float32"
    assert LoadOptions(dtype="bfloat16").load_kwargs["dtype"] == "bfloat16"
    with pytest.raises(FieldError, match="auto"):
        LoadOptions(dtype="f32")


def test_tune_takes_the_generate_engine_flags():
    parser = cli._build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    tune = {a.dest for a in subparsers.choices["tune"]._actions}
    assert {"model", "dtype", "attention", "matmul", "max_context", "max_num_seqs", "page_size", "kv_cache_dtype"} <= tune
