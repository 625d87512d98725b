"""Loaders: GGUF written by gguf_convert from the tiny HF Llama (F32, Q8_0, F16), and clear errors on bad input."""

import json
import shutil
import subprocess
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

import gguf_convert
from conftest import FIXTURES
from jaxinfer.loading.loading import ModelLoadError, load_model
from jaxinfer.model.forward import forward
from tolerances import assert_close, relative_error

TINY = np.load(FIXTURES / "tiny_llama_reference.npz")
TINY_LLAMA = FIXTURES / "tiny_llama"  # written as a GGUF by gguf_convert, as llama.cpp's converter would


def logits_of(model_path, ids):
    cfg, params = load_model(model_path)
    logits, _ = forward(params, None, jnp.asarray(ids)[None], jnp.arange(len(ids), dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(logits[0])


def test_f32_gguf_of_tiny_llama_matches_hf_logits(tmp_path):
    path = gguf_convert.convert(TINY_LLAMA, tmp_path / "tiny-f32.gguf")
    assert_close(logits_of(path, TINY["s1_ids"]), TINY["s1_logits"], 1e-4, "F32 GGUF vs HF")


@pytest.mark.parametrize("qtype, tolerance", [(gguf.GGMLQuantizationType.Q8_0, 0.02), (gguf.GGMLQuantizationType.F16, 2e-3)])
def test_quantized_gguf_of_tiny_llama_is_close_to_hf_logits(tmp_path, qtype, tolerance):
    path = gguf_convert.convert(TINY_LLAMA, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    error = relative_error(logits_of(path, TINY["s1_ids"]), TINY["s1_logits"])
    assert 0 < error <= tolerance, f"{qtype.name}: relative error {error:.3g}"


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist: .*nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_truncated_gguf_is_reported(tmp_path):
    path = gguf_convert.convert(TINY_LLAMA, tmp_path / "tiny.gguf")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(tmp_path / "cut.gguf")


def test_non_gguf_file_is_reported(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(tmp_path / "junk.gguf")


def test_corrupt_gguf_header_is_reported(tmp_path):
    data = bytearray(gguf_convert.convert(TINY_LLAMA, tmp_path / "tiny.gguf").read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and key-value counts
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(tmp_path / "bad.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    path = gguf_convert.convert(TINY_LLAMA, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(path)


def test_hf_folder_without_config_is_reported(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_hf_unsupported_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        load_model(tmp_path)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_quantized_checkpoint_is_refused_naming_its_method_not_loaded_as_its_codes(tmp_path, where):
    # compressed-tensors int8 keeps each projection's name and shape, with its scales beside: read as floats, the codes
    # would make a model that runs and is wrong
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    quantization = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    config |= {"quantization_config": quantization} if where == "top" else {"text_config": {"quantization_config": quantization}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported quantization_config \(quant_method 'compressed-tensors'\)"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        ([1, 2], "must hold a JSON object, got list"),
        ({"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 8, "vocab_size": 10, "head_dim": 16}, "embed_dim must be an integer, got '64'"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": "4", "num_hidden_layers": 2, "intermediate_size": 8, "vocab_size": 10}, "TypeError"),
    ],
)
def test_hf_config_of_the_wrong_shape_is_a_load_error_naming_the_file(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"config.json: .*{message}"):
        load_model(tmp_path)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_hf_config_missing_a_key_is_a_load_error_naming_the_file_and_the_key(tmp_path, key):
    folder = tmp_path / "model"
    shutil.copytree(TINY_LLAMA, folder)
    config = json.loads((folder / "config.json").read_text())
    del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"^{folder / 'config.json'}: config.json has no {key!r}, which a llama model needs$"):
        load_model(folder)


def test_hf_rope_parameters_missing_a_key_is_a_load_error_naming_it(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY_LLAMA, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json: rope_parameters has no 'low_freq_factor', which rope_type 'llama3' needs"):
        load_model(folder)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "--model", "/nonexistent/model.gguf"], "does not exist"),
        (["generate", "--prompt", "", "--compile-cache", ""], "empty prompt"),
        (["generate", "--input", "/nonexistent.jsonl", "--output", "/tmp/x.jsonl"], "input file not found"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(args, message):
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_info_prints_config_and_parameter_count():
    result = cli("info")
    assert result.returncode == 0, result.stderr
    assert "num_layers        30" in result.stdout and "parameters        134,515,008" in result.stdout
    # under the default quantization (auto), the weights as the engine holds them: the Q4_1 file's blocks where the
    # CPU kernel may run them (their formats from the weights the engine loads), not a dense float32 copy
    from jaxinfer.engine import backends, tuning_cache
    from jaxinfer.loading import loading

    path = loading.resolve_model_path(None)
    resolved = backends.resolve_quantization("auto", path, backends.Impls("auto", "auto", "auto"), on_mesh=False, tuning=tuning_cache.tuning_enabled())
    assert "quantization: auto, as the engine loads it" in result.stdout and (" q4_1 " in result.stdout) == (resolved == "gguf"), result.stdout


def _sharded(tmp_path, *, untied: bool = False):
    """tiny_llama's weights in two shards with their index (an untied head in the second), as the Hub holds a large
    model; returns the folder and its tensors."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    tensors = load_file(TINY_LLAMA / "model.safetensors")
    if untied:
        config["tie_word_embeddings"] = False
        tensors["lm_head.weight"] = np.random.default_rng(0).standard_normal(tensors["model.embed_tokens.weight"].shape).astype(np.float32)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    if untied:
        first, second = [n for n in names if n != "lm_head.weight"], ["lm_head.weight"]
    save_file({n: tensors[n] for n in first}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in second}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {n: "model-00002-of-00002.safetensors" for n in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, tensors


def test_sharded_weights_load_by_their_index_and_a_missing_shard_is_named(tmp_path):
    from safetensors.numpy import save_file

    folder, tensors = _sharded(tmp_path, untied=True)
    cfg, params = load_model(folder)
    assert not cfg.tie_embeddings
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros_like(tensors["model.layers.0.self_attn.q_proj.weight"])}, str(folder / "zz-stale.safetensors"))
    again_cfg, again = load_model(folder)  # a stale file beside the index is not read
    np.testing.assert_array_equal(np.asarray(again.layers.wq), np.asarray(params.layers.wq))
    (folder / "model-00002-of-00002.safetensors").unlink()  # the untied head's shard: not a silently tied head
    with pytest.raises(ModelLoadError, match=r"sharded: model-00002-of-00002.safetensors, listed in model.safetensors.index.json, is missing \(1 of 2"):
        load_model(folder)


def test_without_an_index_a_tensor_in_two_files_is_named_and_missing_weights_name_the_folder(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "plain"
    shutil.copytree(TINY_LLAMA, folder)
    save_file({"model.layers.0.self_attn.q_proj.weight": load_file(TINY_LLAMA / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]},
              str(folder / "zz-stale.safetensors"))
    with pytest.raises(ModelLoadError, match=r"plain: tensor 'model.layers.0.self_attn.q_proj.weight' is in both model.safetensors and zz-stale"):
        load_model(folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "zz-stale.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"plain: weight 'model.layers.1.mlp.up_proj.weight' is missing from the model file"):
        load_model(folder)


@pytest.mark.parametrize("kind", ["split", "big-endian"])
def test_a_split_or_big_endian_gguf_is_refused_by_name_not_misread(tmp_path, monkeypatch, kind):
    import functools

    if kind == "split":  # gguf-py writes the shards itself (as llama-gguf-split would): each holds some of the tensors
        monkeypatch.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, split_max_tensors=8))
        gguf_convert.convert(TINY_LLAMA, tmp_path / "tiny.gguf")
        shards = sorted(tmp_path.glob("tiny-*.gguf"))
        assert len(shards) > 1
        for number, shard in enumerate(shards, 1):
            with pytest.raises(ModelLoadError, match=rf"is shard {number} of a {len(shards)}-file split GGUF; merge the shards first"):
                load_model(shard)
    else:  # norms read byte-swapped: 1.0 as 4.6e-41
        monkeypatch.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, endianess=gguf.GGUFEndian.BIG))
        path = gguf_convert.convert(TINY_LLAMA, tmp_path / "big.gguf")
        with pytest.raises(ModelLoadError, match="big.gguf is a big-endian GGUF; jaxinfer reads little-endian ones"):
            load_model(path)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_a_gguf_type_that_can_be_neither_kept_nor_dequantized_is_named_on_either_path(tmp_path, monkeypatch, quantization):
    import gguf_files

    add = gguf_files.add_weight

    def q8_1_queries(writer, name, value, qtype=gguf.GGMLQuantizationType.F32):  # Q8_1: gguf sizes it, but cannot dequantize it
        if name.endswith("attn_q.weight"):
            writer.add_tensor(name, np.zeros((value.shape[0], value.shape[1] // 32 * 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            add(writer, name, value, qtype)

    monkeypatch.setattr(gguf_files, "add_weight", q8_1_queries)
    path = gguf_convert.convert(TINY_LLAMA, tmp_path / "q8_1.gguf")
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_q.weight' is of GGUF type Q8_1, which can be neither kept nor dequantized"):
        load_model(path, quantization=quantization)
