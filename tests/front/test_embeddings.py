"""LLM.embed against transformers: a random tiny Qwen3 base model of a shape no other fixture has (saved bare,
as Qwen3-Embedding is: no "model." prefix, no LM head) gives, for last-token and mean pooling, normalized or
not, the vectors transformers' last_hidden_state gives (tests/reference/make_embedding_fixtures.py), within
1e-4, from safetensors and from a GGUF of the same weights. They run as generation's prefill does (the paged
prefill programs warm-up compiled, chunked and packed), so nothing compiles after warm-up."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer import embedding
from jaxinfer.api import LLM, MissingTokenizer
from jaxinfer.engine.engine import CompileCounter
from jaxinfer.loading.loading import load_model
from jaxinfer.validation import FieldError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TEXTS = ["The cat sat on the mat.", "A longer sentence about a small fishing village on the river, where traders stopped.", "Hi", "1 2 3 4"]
TOLERANCE = 1e-4
ENGINE = dict(max_context=64, page_size=8, max_num_seqs=4, max_prefill_tokens=16)  # the 17- and 40-token prompts run in chunks


@pytest.fixture(scope="module")
def reference():
    data = np.load(FIXTURES / "tiny_qwen3_embed_reference.npz")
    return data, [data[f"s{i}_ids"].tolist() for i in range(int(data["num_sequences"]))]


@pytest.fixture(scope="module")
def llm(compile_cache):
    cfg, params = load_model(FIXTURES / "tiny_qwen3_embed", dtype="float32")  # no tokenizer: token ids in
    return LLM.from_params(cfg, params, MissingTokenizer(FIXTURES / "tiny_qwen3_embed"), compilation_cache_dir=compile_cache, **ENGINE)


@pytest.fixture(scope="module")
def gguf_llm(tmp_path_factory, compile_cache):
    """The same weights as a GGUF (llama.cpp's names, written from the "model."-prefixed copy of the folder)."""
    import gguf_convert  # tests/ (on the path under pytest; not in the script-mode worker)

    folder = tmp_path_factory.mktemp("prefixed")
    shutil.copy(FIXTURES / "tiny_qwen3_embed" / "config.json", folder / "config.json")
    weights = load_file(str(FIXTURES / "tiny_qwen3_embed" / "model.safetensors"))
    save_file({f"model.{name}": value for name, value in weights.items()}, str(folder / "model.safetensors"))
    cfg, params = load_model(gguf_convert.convert(folder, folder / "embed.gguf"), dtype="float32")
    return LLM.from_params(cfg, params, MissingTokenizer(folder), compilation_cache_dir=compile_cache, **ENGINE)


def worst(got: np.ndarray, want: np.ndarray) -> str:
    return f"max abs diff {np.abs(got - want).max():.2e}, mean {np.abs(got - want).mean():.2e}"


@pytest.mark.parametrize("pooling", embedding.POOLINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_match_transformers_for_each_pooling(llm, reference, pooling, normalize):
    data, sequences = reference
    assert llm.model_config.architecture == "qwen3" and llm.model_config.qk_norm and llm.model_config.embed_dim == 40
    outputs = llm.embed(sequences, pooling=pooling, normalize=normalize)  # 4 lengths: padded rows, a padded batch
    for i, output in enumerate(outputs):
        want = data[f"s{i}_{pooling}" + ("_normalized" if normalize else "")]
        assert output.index == i and output.num_prompt_tokens == len(sequences[i])
        np.testing.assert_allclose(output.embedding, want, atol=TOLERANCE, rtol=0, err_msg=worst(output.embedding, want))


def test_a_gguf_of_the_same_weights_gives_the_same_embeddings(gguf_llm, reference):
    data, sequences = reference
    for pooling in embedding.POOLINGS:
        for i, output in enumerate(gguf_llm.embed(sequences, pooling=pooling)):
            np.testing.assert_allclose(output.embedding, data[f"s{i}_{pooling}_normalized"], atol=TOLERANCE, rtol=0)


def test_an_embedding_does_not_depend_on_its_batch(llm, reference):
    """Alone or beside longer prompts (another row length and batch bucket), the same vector."""
    _, sequences = reference
    alone = llm.embed([sequences[0]], pooling="mean")[0].embedding
    together = llm.embed(sequences * 3, pooling="mean")
    np.testing.assert_allclose(together[8].embedding, alone, atol=1e-6)


def test_embeddings_compile_nothing_after_warm_up_and_give_every_page_back(llm, reference):
    """Prompt mixes of every length (one chunk, several, packed beside others), both poolings: the paged prefill
    programs warm-up compiled serve them all (CompileCounter listens to every trace and compile in the process)."""
    _, sequences = reference
    mixes = [sequences, sequences[2:3], sequences[:1] * 5, [sequences[1], sequences[3]], [list(range(3, 67))]]
    with CompileCounter() as counter:
        for mix in mixes:
            for pooling in embedding.POOLINGS:
                assert len(llm.embed(mix, pooling=pooling, normalize=pooling == "last")) == len(mix)
    assert counter.count == 0, counter.events
    for replica in llm.replicas:
        assert replica.block_pool.num_used == 0  # cached pages stay named, but no request holds one


def test_mean_pooling_reads_no_cached_prefix_and_last_pooling_may(llm, reference):
    """A prompt whose full pages are cached: "last" starts after them, "mean" computes every token again; both
    still give transformers' vectors."""
    data, sequences = reference
    llm.embed([sequences[2]])  # 40 tokens: its 5 full pages named in the prefix cache
    last, mean = llm.embed([sequences[2]], pooling="last")[0], llm.embed([sequences[2]], pooling="mean")[0]
    assert last.num_cached_tokens > 0 and mean.num_cached_tokens == 0
    np.testing.assert_allclose(last.embedding, data["s2_last_normalized"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(mean.embedding, data["s2_mean_normalized"], atol=TOLERANCE, rtol=0)


def test_bad_embed_arguments_are_errors_naming_them(llm):
    with pytest.raises(FieldError, match="pooling"):
        llm.embed([[5, 6]], pooling="cls")
    with pytest.raises(ValueError, match="prompt 1: .*max_context"):
        llm.embed([[5, 6], [7] * 65])
    with pytest.raises(ValueError, match="prompt 0"):
        llm.embed([[300]])  # past the vocabulary


@pytest.mark.slow
def test_embeddings_are_the_same_under_tensor_and_data_parallelism_and_bitwise_alone_or_batched_in_deterministic_mode(tiny_chat_model):
    """In a subprocess (this file as a script) with 2 simulated CPU devices, so the suite keeps its one device."""
    from two_devices import run_on_two_devices  # the worker runs this file as a script, without tests/ on its path

    report = run_on_two_devices(__file__, str(tiny_chat_model))
    for pooling in embedding.POOLINGS:
        one, two = np.asarray(report[f"tp1_{pooling}"]), np.asarray(report[f"tp2_{pooling}"])
        assert np.abs(one - two).max() <= 1e-5, worst(two, one)
    one, replicas = np.asarray(report["tp1_last"]), np.asarray(report["dp2_last"])
    assert np.abs(one - replicas).max() <= 1e-5, worst(replicas, one)
    assert report["dp2_routes"] == [0, 1]  # both replicas embedded
    assert report["deterministic_alone"] == report["deterministic_among"][0]  # bitwise, whatever shares its batch


def _worker(model: str) -> dict:
    from jaxinfer.api import LLM as Engine

    limits = dict(dtype="float32", max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64,
                  compilation_cache_dir=tempfile.mkdtemp(prefix="jaxinfer_embed_xla_"))
    # Embeddings run only prefill programs, and TEXTS (31 tokens together) fit one 64-token chunk: 2 programs per
    # engine to warm up, not the full tables' 16 (deterministic mode fixes its own tables).
    narrow = dict(prefill_chunk_buckets=(64,), decode_batch_buckets=(4,), decode_page_buckets=(8,))
    report = {}
    for tp in (1, 2):
        llm = Engine(model, tensor_parallel=tp, **limits, **narrow)
        for pooling in embedding.POOLINGS:
            report[f"tp{tp}_{pooling}"] = [o.embedding.tolist() for o in llm.embed(TEXTS, pooling=pooling)]
    replicas = Engine(model, data_parallel=2, **limits, **narrow)
    report["dp2_last"] = [o.embedding.tolist() for o in replicas.embed(TEXTS * 2)][: len(TEXTS)]
    report["dp2_routes"] = sorted(set(replicas.last_routes))
    deterministic = Engine(model, deterministic=True, **limits)
    report["deterministic_among"] = [o.embedding.tolist() for o in deterministic.embed(TEXTS)]
    report["deterministic_alone"] = deterministic.embed(TEXTS[:1])[0].embedding.tolist()
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_worker(sys.argv[1])))
