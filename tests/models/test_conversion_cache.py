"""The conversion cache publishes complete folders only, and survives a lost race."""

from __future__ import annotations

import pytest

from talaria.models.conversion_cache import ConversionCache, fingerprint


def test_folder_appears_only_when_complete_and_temp_is_cleaned(tmp_path):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("gguf-model name", fingerprint({"a": 1}))

    def build(out):
        assert not folder.exists()  # nothing visible under the final name while building
        (out / "config.json").write_text("{}")

    assert cache.ensure(folder, build) == folder
    assert (folder / "config.json").is_file() and " " not in folder.name
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_losing_a_race_keeps_the_winner(tmp_path):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")

    def build(out):  # another process publishes while we are still converting
        folder.mkdir()
        (folder / "config.json").write_text('{"winner": true}')
        (out / "config.json").write_text('{"winner": false}')

    assert cache.ensure(folder, build) == folder
    assert (folder / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_failed_build_leaves_nothing_behind(tmp_path):
    cache = ConversionCache(tmp_path)

    def build(out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        cache.ensure(cache.folder("m", "k"), build)
    assert list(tmp_path.iterdir()) == []


def test_fingerprint_depends_on_every_part():
    base = {"path": "/m.gguf", "size": 10, "mtime_ns": 5}
    assert fingerprint(base) == fingerprint(dict(reversed(base.items())))
    assert len({fingerprint(base), fingerprint(base | {"size": 11}), fingerprint(base | {"mtime_ns": 6})}) == 3
