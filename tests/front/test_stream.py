"""`LLM.stream` over a lazy input: it pulls at most `max_inflight` prompts ahead of the outputs it has
yielded, yields every output once, and gives the same tokens as a list given whole; with data
parallelism a lazy input is fed to both replicas in chunks. On the tiny real-vocabulary model."""

import json
import sys
from pathlib import Path

import pytest

from jaxinfer.api import LLM
from jaxinfer.scheduling.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, max_context=128, page_size=16, max_num_seqs=2, max_prefill_tokens=64, compilation_cache_dir=compile_cache,
               decode_batch_buckets=(2,), decode_page_buckets=(8,))  # 3 programs, not 13: what is tested is the feeding


class CountingSource:
    """A generator of prepared prompts that records how many have been pulled from it."""

    def __init__(self, llm, count: int, params: SamplingParams = PARAMS):
        self.llm, self.count, self.params, self.pulled = llm, count, params, 0

    def __iter__(self):
        for i in range(self.count):
            self.pulled += 1
            yield self.llm.prepare(f"Question {i}: what comes next?", self.params, index=i)


@pytest.mark.parametrize("max_inflight", [1, 3, 7])
def test_a_generator_is_pulled_at_most_max_inflight_ahead_of_the_outputs(llm, max_inflight):
    source = CountingSource(llm, 20)
    seen, ahead = [], []
    for output in llm.stream(iter(source), progress=False, max_inflight=max_inflight):
        ahead.append(source.pulled - len(seen))  # pulled but not yet yielded, the moment an output comes
        seen.append(output.index)
    assert sorted(seen) == list(range(20))
    assert max(ahead) <= max_inflight, ahead
    assert max(ahead) == max_inflight  # and it does keep that many in flight (20 > max_inflight)


def test_the_default_for_a_lazy_input_is_a_few_times_max_num_seqs(llm):
    source = CountingSource(llm, 30)
    stream = llm.stream(iter(source), progress=False)
    next(stream)
    assert source.pulled == 4 * llm.engine_config.max_num_seqs  # 8 of 30: not the whole input
    assert len(list(stream)) == 29


def test_a_total_for_the_progress_bar_leaves_a_lazy_input_lazy(llm):
    source = CountingSource(llm, 30)
    stream = llm.stream(iter(source), progress=False, total=30)
    next(stream)
    assert source.pulled == 4 * llm.engine_config.max_num_seqs
    assert len(list(stream)) == 29
    with pytest.raises(ValueError, match="total must be"):
        list(llm.stream(iter([]), progress=False, total=-1))


def test_a_lazy_stream_gives_the_tokens_of_the_whole_list(llm):
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=6)  # unseeded: seeds derive from each index
    prompts = [llm.prepare(f"Line {i} says", sampled, index=i) for i in range(12)]
    whole = {o.index: o.token_ids for o in llm.stream(prompts, progress=False)}
    lazy = {o.index: o.token_ids for o in llm.stream((p for p in prompts), progress=False, max_inflight=2)}
    assert lazy == whole


def test_an_empty_generator_yields_nothing_and_a_bad_max_inflight_is_named(llm):
    assert list(llm.stream(iter([]), progress=False)) == []
    with pytest.raises(ValueError, match="max_inflight must be"):
        list(llm.stream(iter([]), progress=False, max_inflight=0))


def test_a_failing_source_stops_the_stream_and_frees_the_llm(llm):
    def source():
        yield llm.prepare("Hello", PARAMS, index=0)
        raise OSError("the input went away")

    with pytest.raises(OSError, match="went away"):
        list(llm.stream(source(), progress=False, max_inflight=1))
    assert llm.generate(["Hi"], PARAMS, progress=False)[0].num_generated_tokens == 5  # not left "already generating"


def test_stream_refuses_what_prepare_did_not_make_naming_it_and_frees_the_llm(llm):
    from jaxinfer.api import Prompt

    with pytest.raises(TypeError, match=r"LLM.stream takes Prompts, as LLM.prepare makes them .* not a str"):
        list(llm.stream(["Hello"], progress=False))
    vocab = llm.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 3: token_ids holds {vocab} at index 1; token ids must be integers in \[0, {vocab}\)"):
        list(llm.stream([Prompt(3, [1, vocab, 2], PARAMS)], progress=False))
    with pytest.raises(ValueError, match=r"prompt 5: token_ids holds True at index 0"):
        list(llm.stream([Prompt(5, [True, 2], PARAMS)], progress=False))
    with pytest.raises(ValueError, match=r"prompt 6: .*context"):  # longer than the context: refused before it is queued
        list(llm.stream([Prompt(6, [1] * 200, PARAMS)], progress=False))
    with pytest.raises(ValueError, match=r"prompt 4: logprobs"):
        list(llm.stream([Prompt(4, [1, 2], SamplingParams(max_tokens=2, logprobs=10_000))], progress=False))
    assert llm.generate(["Hi"], PARAMS, progress=False)[0].num_generated_tokens == 5  # not left "already generating"


def _dp_worker(model: str) -> dict:
    """Two replicas (two simulated CPU devices) fed a generator in chunks of max_inflight=3."""
    llm = LLM(model, data_parallel=2, max_context=64, page_size=8, max_num_seqs=2, max_prefill_tokens=32, num_pages=24, compilation_cache_dir=None,
              decode_batch_buckets=(2,), decode_page_buckets=(8,))  # 2 programs a replica, not 10
    prompts = [llm.prepare(f"Question {i}: " + "word " * (i % 5), PARAMS, index=i) for i in range(10)]
    lazy = {o.index: o.token_ids for o in llm.stream((p for p in prompts), progress=False, max_inflight=3)}
    routes = list(llm.last_routes)
    whole = {o.index: o.token_ids for o in llm.stream(prompts, progress=False)}
    return {"lazy": {str(k): v for k, v in lazy.items()}, "whole": {str(k): v for k, v in whole.items()}, "routes": routes}


@pytest.mark.slow
def test_data_parallel_replicas_are_fed_a_lazy_input_in_chunks(tiny_chat_model):
    from two_devices import run_on_two_devices  # the worker runs this file as a script, without tests/ on its path

    report = run_on_two_devices(__file__, str(tiny_chat_model))
    assert report["lazy"] == report["whole"] and sorted(map(int, report["lazy"])) == list(range(10))
    assert len(report["routes"]) == 10 and set(report["routes"]) == {0, 1}, report["routes"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_dp_worker(sys.argv[1])))
