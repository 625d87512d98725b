"""LLM.generate / chat on the real default model: input order, counts, stop strings, chat template."""

import jax
import pytest

from jaxinfer.model import panels
from jaxinfer.api import LLM
from jaxinfer.engine.generate import generate
from jaxinfer.scheduling.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(smollm2_llm) -> LLM:
    return smollm2_llm  # conftest: the default model on a small engine, warmed once a session


def test_generate_returns_one_output_per_prompt_in_input_order(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Roses are red,", "def add(a, b):", "Water boils at"]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.index for o in outputs] == list(range(5))
    for prompt, out in zip(prompts, outputs):
        assert out.num_prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert out.num_generated_tokens == len(out.token_ids) <= 24
        assert out.finish_reason in ("stop", "length")
        assert 0 < out.time_to_first_token <= out.latency
    assert outputs[1].text.lstrip().startswith("5")


def test_greedy_output_equals_reference_generate(llm):
    """The reference runs over the params as loaded (`engine.params`, no panels: the jnp path), not the
    engine's `step_params`, so it is independent of the CPU kernels the engine may run."""
    ids = llm.tokenizer.encode("A short story about a robot:")
    (out,) = llm.generate([ids], GREEDY)
    cfg, params = llm.model_config, llm.engine.params
    assert not any(panels.is_panel(leaf) for leaf in jax.tree.leaves(params, is_leaf=panels.is_panel))
    (ref,) = generate(params, cfg, [ids], GREEDY, eos_id=llm.tokenizer.eos_id)
    assert out.token_ids == ref.token_ids


def test_stop_string_cuts_text_and_finishes(llm):
    (out,) = llm.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8,", SamplingParams(temperature=0, max_tokens=40, stop=(" 11",)))
    assert out.finish_reason == "stop" and " 11" not in out.text and out.num_generated_tokens < 40


def test_chat_applies_template_and_stops_at_end_of_turn(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=40))
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.tokenizer.eos_id and "<|im_end|>" not in out.text


def test_mismatched_sampling_params_list_is_rejected(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])


def test_reset_prefix_cache_makes_the_next_batch_compute_every_prompt_page(llm):
    prompt = list(range(100, 150))  # 50 tokens: 3 full pages of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([prompt], params, progress=False)[0]
    again = llm.generate([prompt], params, progress=False)[0]
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    llm.reset_prefix_cache()
    fresh = llm.generate([prompt], params, progress=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.token_ids == first.token_ids
    assert llm.block_pool.num_cached > 0  # the new pool caches the new batch's pages again


def test_a_new_llm_shows_its_warm_up_bars_on_stderr_unless_told_not_to(tiny_llama, smollm2_tokenizer, compile_cache, capsys):
    """The bar carries its total, every program compiled (forward and draw programs): tqdm's first frame shows 0 of it (its
    last may be cleared before it is drawn); none with progress=False."""
    cfg, params = tiny_llama
    limits = dict(max_context=64, max_num_seqs=2, page_size=16, prefill_chunk_buckets=(32,), decode_batch_buckets=(2,), decode_page_buckets=(4,),
                  compilation_cache_dir=compile_cache)
    shown = LLM.from_params(cfg, params, smollm2_tokenizer, **limits)
    err = capsys.readouterr().err
    assert f"compiling programs:   0%|          | 0/{shown.engine.num_compilations} " in err, err
    LLM.from_params(cfg, params, smollm2_tokenizer, progress=False, **limits)
    assert "compiling programs" not in capsys.readouterr().err
