"""The profile's file form: TOML read with an error that names the file and the key, and written back.

`parse_profile(dump_profile(p)) == p`. This module is the only one that validates a profile; the
dataclasses in `talaria.contracts.profile` are trusted downstream. Layout and keys: docs/profile.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import tomllib
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import tomli_w

from talaria.contracts.profile import (
    DEVICES,
    PHASE_NAMES,
    PROFILE_SCHEMA,
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    ProfileError,
    SwitchCost,
)
from talaria.contracts.vocabulary import SwitchPath

_MISSING = object()
LEGACY_TOKEN_BYTES = "kv_bytes_per_token"  # `token_bytes` in files written before the cache layout descriptor


class _Table:
    """One TOML table being read; every error names the file and the dotted key."""

    __slots__ = ("origin", "raw", "where")

    def __init__(self, origin: str, where: str, raw: object, known: tuple[str, ...] | None,
                 noun: str = "key"):
        self.origin, self.where = origin, where
        if not isinstance(raw, dict):
            raise ProfileError(f"{origin}: {where} = {raw!r} must be a table")
        self.raw = raw
        for key in raw:
            if known is not None and key not in known:  # None: any key (model names, sources)
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                self.fail(key, f"is not a known {noun}; {hint}use one of: {', '.join(known)}")

    def fail(self, key: str, why: str) -> NoReturn:
        raise ProfileError(f"{self.origin}: {self.where + '.' if self.where else ''}{key} {why}")

    def get(self, key: str, default: object = _MISSING) -> object:
        if key in self.raw:
            return self.raw[key]
        if default is _MISSING:
            self.fail(key, "is missing; add it (every key is listed in docs/profile.md)")
        return default

    def number(self, key: str, default: object = _MISSING, positive: bool = False) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.fail(key, f"= {v!r} must be a finite number")
        if v < 0 or (positive and v == 0):
            self.fail(key, f"= {v!r} must be {'> 0' if positive else '>= 0'}")
        return float(v)

    def count(self, key: str, minimum: int = 0) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(key, f"= {v!r} must be a whole number >= {minimum}")
        return v

    def text(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str) or not v:
            self.fail(key, f"= {v!r} must be a non-empty string")
        return v

    def sub(self, key: str, known: tuple[str, ...] | None, noun: str = "key",
            optional: bool = False) -> _Table:
        where = f"{self.where}.{key}" if self.where else key
        return _Table(self.origin, where, self.get(key, {} if optional else _MISSING), known, noun)

    def sources(self) -> dict[str, str]:
        t = self.sub("sources", None, optional=True)
        return {k: t.text(k) for k in t.raw}


def parse_profile(text: str, origin: str = "<profile>") -> Profile:
    """Validate profile TOML; `origin` (usually the path) names the file in every error."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{origin}: not valid TOML: {e}; fix the syntax there") from None
    # the schema first: a file from another version fails with advice, not with an unknown key
    schema = raw.get("profile", {}).get("schema") if isinstance(raw.get("profile"), dict) else None
    if schema != PROFILE_SCHEMA or isinstance(schema, bool):
        have = "is missing" if schema is None else f"= {schema!r}"
        raise ProfileError(f"{origin}: profile.schema {have} but this Talaria reads schema "
                           f"{PROFILE_SCHEMA}; re-run `talaria profile` to regenerate the file")
    top = _Table(origin, "", raw, ("profile", "bandwidth", "models"))
    head = top.sub("profile", ("schema", "hardware", "device", "tp", "device_bytes", "host_bytes", "created",
                               "method", "sources"))
    if head.text("device") not in DEVICES:
        head.fail("device", f"= {head.raw['device']!r} must be one of: {', '.join(DEVICES)}")
    created = head.get("created")
    created = created.isoformat() if isinstance(created, datetime) else head.text("created")
    try:
        datetime.fromisoformat(created)
    except ValueError:
        head.fail("created", f"= {created!r} is not an ISO 8601 date-time; "
                             "write e.g. 2026-11-30T12:00:00+00:00")
    rates = tuple(f.name for f in dataclasses.fields(Bandwidth))
    bw = top.sub("bandwidth", rates)
    restore = bw.number("restore_bytes_per_s", positive=True) if "restore_bytes_per_s" in bw.raw else None
    models = top.sub("models", None, optional=True)
    return Profile(
        hardware=head.text("hardware"), device=head.raw["device"], tp=head.count("tp", 1),
        device_bytes=head.count("device_bytes", 1), created=created, method=head.text("method"),
        bandwidth=Bandwidth(*(bw.number(k, positive=True) for k in rates[:3]), restore),
        models={name: _parse_model(models, name) for name in models.raw},
        sources=head.sources(), host_bytes=head.count("host_bytes", 1) if "host_bytes" in head.raw else None)


def _parse_model(models: _Table, name: str) -> ModelProfile:
    t = models.sub(name, ("weights_bytes", "token_bytes", "state_bytes", LEGACY_TOKEN_BYTES, "prefill",
                          "decode", "switch", "sources"))
    pre = t.sub("prefill", ("base_s", "per_token_s", "per_token_context_s"))
    dec = t.sub("decode", ("base_s", "per_seq_s", "per_context_token_s"))
    paths = t.sub("switch", tuple(p.value for p in SwitchPath), noun="switch path", optional=True)
    switch = {}
    for path in paths.raw:
        cost = paths.sub(path, ("phase_s",))
        phases = cost.get("phase_s")
        if not isinstance(phases, list) or len(phases) != len(PHASE_NAMES):
            cost.fail("phase_s", f"= {phases!r} must be a list of {len(PHASE_NAMES)} seconds, "
                                 f"in order: {', '.join(PHASE_NAMES)}")
        phase = _Table(cost.origin, f"{cost.where}.phase_s", dict(zip(PHASE_NAMES, phases)),
                       PHASE_NAMES)
        switch[SwitchPath(path)] = SwitchCost(SwitchPath(path), tuple(phase.number(p) for p in PHASE_NAMES))
    return ModelProfile(
        name=name, weights_bytes=t.count("weights_bytes"),
        token_bytes=_token_bytes(t), state_bytes=t.count("state_bytes") if "state_bytes" in t.raw else 0,
        prefill=PrefillCurve(pre.number("base_s"), pre.number("per_token_s"),
                             pre.number("per_token_context_s", 0.0)),
        decode=DecodeCurve(dec.number("base_s"), dec.number("per_seq_s"),
                           dec.number("per_context_token_s", 0.0)),
        switch=switch, sources=t.sources())


def _token_bytes(t: _Table) -> int:
    """`token_bytes`, or the key files written before the cache layout descriptor used for it."""
    if LEGACY_TOKEN_BYTES in t.raw:
        if "token_bytes" in t.raw:
            t.fail(LEGACY_TOKEN_BYTES, "is the old name of token_bytes, which is given too; keep one")
        return t.count(LEGACY_TOKEN_BYTES)
    return t.count("token_bytes")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; raises `ProfileError` naming the path."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile; check the path, or make one with "
                           "`talaria profile`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot be read as UTF-8 text ({e}); "
                           "pass a readable profile TOML file") from None
    return parse_profile(text, str(path))



def dump_profile(profile: Profile) -> str:
    """The TOML text of `profile`; `parse_profile(dump_profile(p)) == p`."""
    head = {"schema": profile.schema, "hardware": profile.hardware, "device": profile.device,
            "tp": profile.tp, "device_bytes": profile.device_bytes, "created": profile.created,
            "method": profile.method}
    if profile.host_bytes is not None:
        head["host_bytes"] = profile.host_bytes
    if profile.sources:
        head["sources"] = dict(profile.sources)
    models = {}
    for name, m in profile.models.items():
        t = {"weights_bytes": m.weights_bytes, "token_bytes": m.token_bytes, "state_bytes": m.state_bytes,
             "prefill": asdict(m.prefill), "decode": asdict(m.decode)}
        if m.switch:
            t["switch"] = {p.value: {"phase_s": list(c.phase_s)} for p, c in m.switch.items()}
        if m.sources:
            t["sources"] = dict(m.sources)
        models[name] = t
    bandwidth = {k: v for k, v in asdict(profile.bandwidth).items() if v is not None}
    return tomli_w.dumps({"profile": head, "bandwidth": bandwidth,
                          "models": models})


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` to `path` atomically (temporary file + rename), creating parent folders."""
    path = Path(path)
    text = dump_profile(profile)
    parse_profile(text, str(path))  # invariant: never write a file that load_profile would reject
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
