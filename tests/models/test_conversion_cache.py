"""The conversion cache publishes complete, fsynced folders only, rebuilds broken ones, survives a lost
race and removes the temp folders of dead converters while keeping live ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from talaria.models import conversion_cache
from talaria.models.conversion_cache import LOCK, MANIFEST, ConversionCache, fingerprint

WEIGHTS = bytes(range(256)) * 64  # 16 KiB


def write_model(out):
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_bytes(WEIGHTS)


class CountingBuild:
    """``write_model``, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out):
        self.calls += 1
        write_model(out)


def entries(root):
    return sorted(p.name for p in root.iterdir())


def test_folder_appears_only_when_complete_and_temp_is_cleaned(tmp_path):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("gguf-model name", fingerprint({"a": 1}))

    def build(out):
        assert not folder.exists()  # nothing visible under the final name while building
        (out / "config.json").write_text("{}")

    assert cache.ensure(folder, build) == folder
    assert (folder / "config.json").is_file() and " " not in folder.name
    assert entries(tmp_path) == [LOCK, folder.name]
    assert entries(folder) == ["config.json", MANIFEST]


def test_losing_a_race_keeps_the_winner(tmp_path):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")

    def build(out):  # another process publishes while we are still converting
        folder.mkdir()
        (folder / "config.json").write_text('{"winner": true}')
        (out / "config.json").write_text('{"winner": false}')

    assert cache.ensure(folder, build) == folder
    assert (folder / "config.json").read_text() == '{"winner": true}'
    assert entries(tmp_path) == [LOCK, folder.name]


def test_failed_build_leaves_nothing_behind(tmp_path):
    cache = ConversionCache(tmp_path)

    def build(out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        cache.ensure(cache.folder("m", "k"), build)
    assert entries(tmp_path) == [LOCK]


def test_manifest_lists_every_file_with_size_and_hash(tmp_path):
    cache = ConversionCache(tmp_path)
    folder = cache.ensure(cache.folder("m", "k"), write_model)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(files) == ["config.json", "model.safetensors"]
    assert files["model.safetensors"]["size"] == len(WEIGHTS)
    assert files["model.safetensors"]["sha256"] == conversion_cache._digest(folder / "model.safetensors")


def fsync_recording_paths(monkeypatch):
    """Wrap os.fsync so it still syncs but also records the path each descriptor had at that moment."""
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_files_and_folders_are_fsynced_before_the_rename_and_the_root_after(tmp_path, monkeypatch):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")

    def build(out):
        write_model(out)
        (out / "sub").mkdir()
        (out / "sub" / "extra.bin").write_bytes(b"x" * 10)

    synced = fsync_recording_paths(monkeypatch)
    cache.ensure(folder, build)

    # a path under .tmp-…/model proves the fsync ran before the rename moved it to `folder`
    parts = [Path(p).relative_to(tmp_path).parts for p in synced[:-1]]
    assert all(tmp.startswith(".tmp-m-k-") and model == "model" for tmp, model, *_ in parts)
    before = ["/".join(rest) for _, _, *rest in parts]
    assert {"config.json", "model.safetensors", "sub/extra.bin", "sub", ""} <= set(before)
    assert any(p.startswith(MANIFEST) for p in before)
    assert before[-1] == ""  # the model folder last, after its manifest was written
    assert synced[-1] == str(tmp_path)  # the root, after the rename
    assert folder.is_dir()


def digests_recording_paths(monkeypatch):
    """Wrap the cache's file hashing so it still hashes but also records which files it read."""
    hashed, real_digest = [], conversion_cache._digest

    def digest(path):
        hashed.append(path.name)
        return real_digest(path)

    monkeypatch.setattr(conversion_cache, "_digest", digest)
    return hashed


@pytest.mark.parametrize("damage", ["same size, other bytes", "truncated", "deleted"])
def test_a_damaged_file_is_detected_and_rebuilt(tmp_path, monkeypatch, caplog, damage):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")
    build = CountingBuild()
    cache.ensure(folder, build)
    hashed = digests_recording_paths(monkeypatch)
    weights = folder / "model.safetensors"
    if damage == "same size, other bytes":
        with weights.open("r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 8)
        # a later write moves mtime; the test runs faster than a coarse filesystem clock, so move it
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif damage == "truncated":
        os.truncate(weights, 1000)
    else:
        weights.unlink()

    assert cache.ensure(folder, build) == folder
    assert hashed == (["model.safetensors"] if damage == "same size, other bytes" else [])  # size first
    assert build.calls == 2
    assert weights.read_bytes() == WEIGHTS
    assert str(folder) in caplog.text and "model.safetensors" in caplog.text
    assert entries(tmp_path) == [LOCK, folder.name]  # the broken copy is gone


def test_a_folder_without_manifest_from_an_older_talaria_is_rebuilt(tmp_path, caplog):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")
    folder.mkdir()
    write_model(folder)
    build = CountingBuild()

    cache.ensure(folder, build)
    assert build.calls == 1
    assert (folder / MANIFEST).is_file()
    assert "no manifest" in caplog.text


def test_reuse_hashes_only_files_whose_stat_moved_and_only_once(tmp_path, monkeypatch):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")
    build = CountingBuild()
    cache.ensure(folder, build)
    hashed = digests_recording_paths(monkeypatch)

    cache.ensure(folder, build)
    assert hashed == []  # size and stat signature match: no file read

    os.utime(folder / "config.json", ns=(0, 0))  # touched (or copied), bytes unchanged
    cache.ensure(folder, build)
    cache.ensure(folder, build)
    assert hashed == ["config.json"]  # hashed once; the manifest took its new signature
    assert build.calls == 1


def test_a_folder_another_process_rebuilt_while_we_verified_is_not_deleted(tmp_path, monkeypatch):
    cache = ConversionCache(tmp_path)
    folder = cache.folder("m", "k")
    cache.ensure(folder, write_model)

    def verify_while_a_racer_replaces_the_folder(f):
        shutil.rmtree(folder)  # the racer set the old copy aside and published its own
        folder.mkdir()
        (folder / "racer").write_text("mine")
        return "is broken (as this process saw it)"

    monkeypatch.setattr(conversion_cache, "_verify", verify_while_a_racer_replaces_the_folder)
    assert cache.ensure(folder, write_model) == folder
    assert (folder / "racer").read_text() == "mine"  # our rebuild lost the race to it


def test_stale_temp_folders_are_removed_and_a_live_converters_is_kept(tmp_path):
    cache = ConversionCache(tmp_path)
    live_folder = cache.folder("live", "k")
    building, finish = threading.Event(), threading.Event()

    def slow_build(out):
        building.set()
        assert finish.wait(10)
        write_model(out)

    live = threading.Thread(target=cache.ensure, args=(live_folder, slow_build))
    live.start()
    assert building.wait(10)
    dead = tmp_path / ".tmp-dead-k-1234"  # a converter killed midway: its lock file, no holder
    (dead / "model").mkdir(parents=True)
    (dead / "model" / "model.safetensors").write_bytes(WEIGHTS)
    (dead / LOCK).touch()
    old = tmp_path / ".tmp-old-k-5678"  # an older Talaria's leftover: no lock file at all
    old.mkdir()
    (old / "model.safetensors").write_bytes(WEIGHTS)

    try:
        cache.ensure(cache.folder("other", "k"), write_model)
        (live_tmp,) = tmp_path.glob(".tmp-live-k-*")
        assert not dead.exists() and not old.exists()
        assert (live_tmp / "model").is_dir()
    finally:
        finish.set()
        live.join(10)
    assert entries(tmp_path) == [LOCK, "live-k", "other-k"]
    assert (live_folder / "model.safetensors").read_bytes() == WEIGHTS


KILLED_MIDWAY = """
import sys
from pathlib import Path
from talaria.models.conversion_cache import ConversionCache

def build(out):
    (out / "model.safetensors").write_bytes(b"x" * 1000)
    print("building", flush=True)
    sys.stdin.read()  # until killed

cache = ConversionCache(Path(sys.argv[1]))
cache.ensure(cache.folder("m", "k"), build)
"""


def test_the_temp_folder_of_a_converter_process_is_kept_while_it_runs_and_removed_once_killed(tmp_path):
    cache = ConversionCache(tmp_path)
    repo = Path(conversion_cache.__file__).parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MIDWAY, str(tmp_path)], cwd=repo,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "building\n"
        (converting,) = tmp_path.glob(".tmp-m-k-*")
        cache.ensure(cache.folder("a", "k"), write_model)
        assert (converting / "model" / "model.safetensors").is_file()
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    cache.ensure(cache.folder("b", "k"), write_model)
    assert entries(tmp_path) == [LOCK, "a-k", "b-k"]


def test_fingerprint_depends_on_every_part():
    base = {"path": "/m.gguf", "size": 10, "mtime_ns": 5}
    assert fingerprint(base) == fingerprint(dict(reversed(base.items())))
    assert len({fingerprint(base), fingerprint(base | {"size": 11}), fingerprint(base | {"mtime_ns": 6})}) == 3
