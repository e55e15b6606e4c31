"""The name a namespace gives a model's weights: the same weights share it, other weights never do."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def mi():
    from kvdepot import model_identity

    model_identity.folder_fingerprint.cache_clear()
    return model_identity


def make_model(folder, weights: bytes, config: str = '{"hidden_size": 256}'):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def identity(mi, path, **kw):
    mi.folder_fingerprint.cache_clear()
    return mi.model_identity(str(path), None, kw.pop("load_format", "auto"), **kw)


def test_a_relative_and_an_absolute_path_to_the_same_files_name_the_same_weights(mi, tmp_path, monkeypatch):
    make_model(tmp_path / "model", os.urandom(4096))
    absolute = identity(mi, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    relative = identity(mi, "model")
    assert relative == absolute
    assert absolute.label == "model" and absolute.revision.startswith("w") and len(absolute.revision) == 17


def test_other_weights_under_the_same_path_are_another_model(mi, tmp_path, monkeypatch):
    make_model(tmp_path / "a" / "model", os.urandom(4096))
    make_model(tmp_path / "b" / "model", os.urandom(4096))
    monkeypatch.chdir(tmp_path / "a")
    a = identity(mi, "model")
    monkeypatch.chdir(tmp_path / "b")
    assert identity(mi, "model") != a
    # Another config (a layer more) is another model too.
    c = make_model(tmp_path / "c" / "model", (tmp_path / "b" / "model" / "model.safetensors").read_bytes(),
                   config='{"hidden_size": 256, "num_hidden_layers": 3}')
    shutil.copystat(tmp_path / "b" / "model" / "model.safetensors", c / "model.safetensors")
    assert identity(mi, c) != identity(mi, tmp_path / "b" / "model")


def test_weights_rewritten_in_place_change_the_name_and_a_faithful_copy_does_not(mi, tmp_path):
    weights = os.urandom(8 << 20)
    model = make_model(tmp_path / "model", weights)
    before = identity(mi, model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)  # copy2: the same bytes and times
    assert identity(mi, copy).revision == before.revision
    # New bytes where the fingerprint samples, the file's times kept: caught by the samples.
    info = os.stat(model / "model.safetensors")
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(len(weights) - 10)
        f.write(b"0123456789")
    os.utime(model / "model.safetensors", ns=(info.st_atime_ns, info.st_mtime_ns))
    changed = identity(mi, model)
    assert changed.revision != before.revision
    # The same bytes written again: caught by the modification time.
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    os.utime(model / "model.safetensors", ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    assert identity(mi, model).revision not in (before.revision, changed.revision)


def test_a_70b_model_costs_a_few_mib_of_reads_per_file(mi, tmp_path):
    # 30 shards of 4.7 GB, as sparse files: the fingerprint reads its samples only.
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for i in range(30):
        with open(model / f"model-{i:05d}-of-00030.safetensors", "wb") as f:
            f.truncate(4_700_000_000)
    digest, read = mi.folder_fingerprint(str(model))
    per_file = mi.HEAD_BYTES + mi.TAIL_BYTES + mi.SAMPLES * mi.SAMPLE_BYTES
    assert read <= 30 * per_file + 2
    assert read < 100 << 20  # of 141 GB


def test_an_operators_model_id_names_the_weights_whatever_the_path(mi, tmp_path):
    a = make_model(tmp_path / "a", os.urandom(4096))
    b = make_model(tmp_path / "b", os.urandom(4096))
    assert identity(mi, a, model_id="llama-3.1-8b-ft7") == identity(mi, b, model_id="llama-3.1-8b-ft7")
    assert identity(mi, a, model_id="llama-3.1-8b-ft7").label == "llama-3.1-8b-ft7"


def test_dummy_weights_are_named_by_the_config_alone(mi, tmp_path):
    a = make_model(tmp_path / "a", os.urandom(4096))
    b = make_model(tmp_path / "b", os.urandom(4096))
    assert identity(mi, a, load_format="dummy").revision == identity(mi, b, load_format="dummy").revision
    assert identity(mi, a, load_format="dummy").revision != identity(mi, a).revision


def test_a_hub_model_without_a_local_snapshot_is_named_by_its_revision_with_a_warning(mi, tmp_path, monkeypatch,
                                                                                     caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level("WARNING", logger="kvdepot.connector"):
        ident = mi.model_identity("someone/some-model", "v2", "auto")
    assert (ident.label, ident.revision) == ("someone/some-model", "v2")
    assert "model_id" in caplog.text


def test_a_hub_model_is_named_by_the_commit_of_its_local_snapshot(mi, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--some-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ident = mi.model_identity("someone/some-model", None, "auto")
    assert (ident.label, ident.revision) == ("someone/some-model", commit)
