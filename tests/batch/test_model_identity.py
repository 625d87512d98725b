"""A batch job's model identity (recorded in its settings, so a resume under another model is refused) is
a hash of the model's whole files, tensor data included, computed once per file and cached by size and
mtime. Checked against hashlib over the same bytes."""

import hashlib
import os

from jaxinfer.batch.output_file import model_identity

HEAD = 4 << 20  # the 4 MiB the identity once hashed alone


def test_a_model_file_changed_past_its_first_4_mib_has_another_identity(tmp_path):
    cache = tmp_path / "hashes.json"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * HEAD + b"tensor data A")
    first = model_identity(model, cache=cache)
    model.write_bytes(b"GGUF" + b"\0" * HEAD + b"tensor data B")  # same size, same head
    os.utime(model, ns=(1, 2))  # a new mtime, as any write gives
    second = model_identity(model, cache=cache)
    assert first["sha256"] != second["sha256"] and first["bytes"] == second["bytes"]
    assert second["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()


def test_a_file_is_hashed_once_then_read_from_the_cache_while_its_size_and_mtime_hold(tmp_path):
    cache = tmp_path / "hashes.json"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights one")
    stamp = os.stat(model).st_mtime_ns
    first = model_identity(model, cache=cache)
    model.write_bytes(b"weights two")  # same size; put the old mtime back: the cache cannot tell
    os.utime(model, ns=(stamp, stamp))
    assert model_identity(model, cache=cache) == first  # the cached hash: the file was not read again
    os.utime(model, ns=(stamp + 10**9, stamp + 10**9))
    assert model_identity(model, cache=cache)["sha256"] == hashlib.sha256(b"weights two").hexdigest()


def test_a_hugging_face_folder_is_identified_by_its_config_and_every_weight_file(tmp_path):
    cache = tmp_path / "hashes.json"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64 + b"A")
    (folder / "README.md").write_text("notes")
    first = model_identity(folder, cache=cache)
    (folder / "README.md").write_text("other notes, longer")  # not the model: the identity holds
    assert model_identity(folder, cache=cache) == first
    (folder / "model.safetensors").write_bytes(b"\0" * 64 + b"B")
    os.utime(folder / "model.safetensors", ns=(1, 2))
    assert model_identity(folder, cache=cache)["sha256"] != first["sha256"]
