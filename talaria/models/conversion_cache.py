"""A folder of converted models, each written once, published by an atomic rename, checked on reuse.

A conversion (GGUF dequantization, synthetic generation) is keyed by a fingerprint of its inputs.
The model is built in ``.tmp-<name>-XXXX/model`` and renamed into place, so a folder under the cache
root is always complete, and two processes that race both convert but only the first rename wins
(the loser deletes its copy and uses the winner's).

Durability: before the rename every file and folder of the model is fsynced, then a manifest
(``talaria-manifest.json``: each file's relative path, size, SHA-256 and stat signature) is written
last and fsynced with its folder; after the rename the cache root is fsynced. A crash leaves either
no folder or a complete one.

Reuse: a folder without a manifest (published by an older Talaria, which did not fsync), or with a
file missing, of another size or with another hash, is logged, renamed aside to a ``.tmp-`` name,
deleted and rebuilt. Hashing costs too much to repeat on every start: SHA-256 of a 512 MiB file
took 0.30-0.48 s here from the page cache and 0.55-0.94 s cold (BLAKE2b 0.43-0.65 s warm; this CPU
has SHA instructions), fine for the 0.5 GB default model but 15-50 s for a 7B GGUF dequantized to
float32. So reuse compares each file's size and stat signature (inode, mtime_ns, ctime_ns) with the
manifest, 0.1-0.2 ms for a whole model, and hashes only the files whose signature moved (copied,
touched or rewritten since publication); when their bytes still match, the manifest takes the new
signatures so the next start is quick again. Not caught: bytes changed under an unchanged inode and
timestamps (bit rot, a disk that acknowledged an fsync it did not do), which no loader checks either.

Stale temp folders (a conversion killed midway leaves ~0.5 GB): a builder holds an exclusive flock
on ``.tmp-…/.lock`` until its model is renamed or deleted, and ``ensure`` first deletes every
``.tmp-`` folder whose lock it can take, or that has none (an older Talaria's, a broken folder set
aside). flock dies with its process, so a pid reused later cannot keep a dead folder alive. A
builder creates its folder and takes that lock while holding the root's ``.lock`` shared, and the
sweep judges while holding it exclusively, so a folder is never taken for dead in that instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV_VAR = "TALARIA_CACHE_DIR"
MANIFEST = "talaria-manifest.json"
LOCK = ".lock"  # in the cache root (guards creating temp folders) and in every temp folder
MANIFEST_VERSION = 1
_TMP = ".tmp-"
_HASH = "sha256"

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$TALARIA_CACHE_DIR`` or ``~/.cache/talaria``, read at call time."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "talaria").expanduser()


def fingerprint(parts: dict[str, Any]) -> str:
    """A short stable hash of JSON-serialisable ``parts`` (sorted keys)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class ConversionCache:
    """Converted model folders under ``root``, named ``<label>-<fingerprint>``."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, label: str, key: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:60]
        return self.root / f"{safe}-{key}"

    def ensure(self, folder: Path, build: Callable[[Path], object]) -> Path:
        """``folder`` matching its manifest, calling ``build(out)`` on an empty folder to (re)make it first."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep()
        if folder.is_dir():
            inode = folder.stat().st_ino
            problem = _verify(folder)
            if problem is None:
                return folder
            log.warning("conversion cache: %s %s; deleting it and converting again", folder, problem)
            self._discard(folder, inode)
        return self._build(folder, build)

    def _build(self, folder: Path, build: Callable[[Path], object]) -> Path:
        with self._root_lock(fcntl.LOCK_SH):
            # invariant: a temp folder is without its held lock only while its creator holds the
            # root lock shared, and the sweep judges only under the root lock exclusive
            tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{folder.name}-", dir=self.root))
            lock = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            out = tmp / "model"
            out.mkdir()
            build(out)
            _seal(out)
            try:
                os.rename(out, folder)  # atomic; fails if another process published first
            except OSError:
                if not folder.is_dir():
                    raise
            else:
                _fsync(self.root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the lock, and the model if it lost the race
            os.close(lock)
        return folder

    def _sweep(self) -> None:
        """Delete the temp folders no live process is filling: their lock is free, or missing."""
        if not os.access(self.root, os.W_OK):
            return  # a read-only cache can be used but not swept
        with self._root_lock(fcntl.LOCK_EX):
            dead = [(tmp, lock) for tmp in self.root.glob(f"{_TMP}*") if (lock := _claim(tmp)) is not None]
        for tmp, lock in dead:
            log.info("conversion cache: removing %s, left by a conversion that is no longer running", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if lock >= 0:
                os.close(lock)

    def _discard(self, folder: Path, inode: int) -> None:
        """Rename the broken ``folder`` aside, then delete it, unless another process replaced it already."""
        aside = self.root / f"{_TMP}{folder.name}-broken-{secrets.token_hex(4)}"
        try:
            if folder.stat().st_ino != inode:
                return  # rebuilt meanwhile by a racing process; building again just loses the race
            os.rename(folder, aside)  # atomic, so no reader ever sees a half-deleted model
        except FileNotFoundError:
            return  # set aside meanwhile by a racing process
        shutil.rmtree(aside, ignore_errors=True)

    @contextlib.contextmanager
    def _root_lock(self, how: int) -> Iterator[None]:
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)


def _claim(tmp: Path) -> int | None:
    """The held lock of the dead temp folder ``tmp`` (-1 when it has none), or None if it is alive."""
    try:
        fd = os.open(tmp / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return -1  # an older Talaria's leftover, or a broken folder set aside
    except OSError:
        return None  # not ours to judge: another user's private folder, or not a folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # a live converter holds it
    return fd


def _seal(out: Path) -> None:
    """fsync every file and folder under ``out``, then write the manifest of its files last."""
    files = {}
    for dirpath, _, filenames in os.walk(out):
        for name in filenames:
            path = Path(dirpath, name)
            with path.open("rb") as f:
                digest = hashlib.file_digest(f, _HASH).hexdigest()
                os.fsync(f.fileno())
                st = os.fstat(f.fileno())
            files[path.relative_to(out).as_posix()] = {"size": st.st_size, _HASH: digest, "stat": _signature(st)}
        if dirpath != str(out):
            _fsync(Path(dirpath))
    _write_manifest(out, files)


def _verify(folder: Path) -> str | None:
    """None when ``folder`` matches its manifest, else why not; hashes only files whose stat moved."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("version") != MANIFEST_VERSION or manifest.get("hash") != _HASH:
            return f"has a manifest of another format ({manifest.get('version')}, {manifest.get('hash')})"
        files: dict[str, dict[str, Any]] = manifest["files"]
        moved = {}
        for rel, want in files.items():
            try:
                st = os.stat(folder / rel)
            except FileNotFoundError:
                return f"is missing {rel}"
            if st.st_size != want["size"]:
                return f"has {rel} of {st.st_size} bytes where its manifest says {want['size']}"
            if _signature(st) != want["stat"]:
                if _digest(folder / rel) != want[_HASH]:
                    return f"has {rel} with other bytes than its manifest's {_HASH}"
                moved[rel] = want | {"stat": _signature(st)}
    except FileNotFoundError:
        return "has no manifest (published by an older Talaria, without fsync)"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"has an unreadable manifest ({type(e).__name__}: {e})"
    if moved:  # copied or touched but intact: remember the new signatures, or every start hashes
        with contextlib.suppress(OSError):  # a read-only cache still works, only slower
            _write_manifest(folder, files | moved)
    return None


def _write_manifest(out: Path, files: dict[str, dict[str, Any]]) -> None:
    """Replace ``out``'s manifest atomically, fsyncing it and ``out``."""
    part = out / f"{MANIFEST}.{secrets.token_hex(4)}.part"  # unique per writer: racers each replace whole
    try:
        with part.open("w", encoding="utf-8") as f:
            json.dump({"version": MANIFEST_VERSION, "hash": _HASH, "files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, out / MANIFEST)
    finally:
        part.unlink(missing_ok=True)
    _fsync(out)


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, _HASH).hexdigest()


def _signature(st: os.stat_result) -> list[int]:
    """What any write, replacement or copy changes; compared before trusting a file without hashing it."""
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
