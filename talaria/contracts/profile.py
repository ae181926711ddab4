"""Cost profile: predicted seconds for prefill, decode, KV save/restore and model switches.

One TOML file per hardware x set of models, so that the round scheduler, the router's cost model,
the simulator and `talaria profile` all predict with the same numbers and can say where each came
from. Times are seconds, sizes bytes, rates bytes per second. This module is the only one that
validates a profile; everything downstream trusts the dataclasses. Layout and keys:
docs/profile.md. Calibration (start-up or `talaria profile`) times a few shapes and calls
`fit_prefill` / `fit_decode`; no torch here, so a profile loads anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import numpy as np
import tomli_w

PROFILE_SCHEMA = 1
SWITCH_PATHS = ("full_d2d", "partial", "h2d_only")  # talaria.memory.stager.SwitchPath values
PHASE_NAMES = ("save_teardown", "open_weights", "kv_shell", "runtime", "publish")  # paper App. D
DEVICES = ("cpu", "cuda")


class ProfileError(ValueError):
    """A profile file (or a lookup in one) the user must fix; names the file and the dotted key."""


@dataclass(frozen=True, slots=True)
class PrefillCurve:
    """time = base_s + per_token_s * n + per_token_context_s * n * (cached + n / 2).

    n new tokens after `cached` tokens of reused prefix; the last term is attention, where the
    i-th new token attends over cached + i tokens (about cached + n/2 on average).
    """

    base_s: float  # fixed cost of one prefill (launch, sampling)
    per_token_s: float  # per new token: projections and MLP
    per_token_context_s: float = 0.0  # attention: per new token, per token of context it attends over

    def seconds(self, tokens: int, cached: int = 0) -> float:
        if tokens < 0 or cached < 0:
            raise ValueError(f"prefill of tokens={tokens}, cached={cached}: both must be >= 0")
        if tokens == 0:
            return 0.0
        return (self.base_s + self.per_token_s * tokens
                + self.per_token_context_s * tokens * (cached + tokens / 2))


@dataclass(frozen=True, slots=True)
class DecodeCurve:
    """One decode step of `batch` sequences holding `context` tokens in all.

    time = base_s + per_seq_s * batch + per_context_token_s * context
    """

    base_s: float  # fixed cost of one step (weights read once per step)
    per_seq_s: float  # per sequence in the batch
    per_context_token_s: float = 0.0  # per token of KV read by attention, summed over the batch

    def seconds(self, batch: int, context: int = 0) -> float:
        if batch < 0 or context < 0:
            raise ValueError(f"decode of batch={batch}, context={context}: both must be >= 0")
        if batch == 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """Opening this model by one load path, in the five ordered phases of a switch (paper App. D)."""

    path: str  # one of SWITCH_PATHS
    phase_s: tuple[float, float, float, float, float]  # seconds per phase, in PHASE_NAMES order

    @property
    def total_s(self) -> float:
        return sum(self.phase_s)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str  # the model's name in talaria.toml
    weights_bytes: int  # per rank
    kv_bytes_per_token: int  # per rank, all layers, K and V
    prefill: PrefillCurve
    decode: DecodeCurve
    switch: dict[str, SwitchCost]  # by path: opening this model; missing paths allowed
    sources: dict[str, str] = field(default_factory=dict)  # key -> where the number comes from


@dataclass(frozen=True, slots=True)
class Bandwidth:
    h2d_bytes_per_s: float  # host -> device: weight H2D, and KV restore unless restore is measured
    d2h_bytes_per_s: float  # device -> host: KV save to host
    d2d_bytes_per_s: float  # device -> device: staged-weight gather
    restore_bytes_per_s: float | None = None  # HKVR restore (host slabs -> KV pages), when measured

    @property
    def restore(self) -> float:
        return self.restore_bytes_per_s or self.h2d_bytes_per_s


@dataclass(frozen=True, slots=True)
class Profile:
    """The cost model of one hardware for a set of models."""

    hardware: str  # e.g. "cpu: AMD EPYC 7B13, 2 threads" or "cuda: NVIDIA H200 x8"
    device: str  # one of DEVICES
    tp: int  # tensor-parallel ranks the numbers were taken with
    device_bytes: int  # memory per device (HBM, or the arena on CPU)
    created: str  # ISO 8601 date-time
    method: str  # how it was made: "start-up calibration", "talaria profile", "paper-derived"
    bandwidth: Bandwidth
    models: dict[str, ModelProfile]  # by model name
    sources: dict[str, str] = field(default_factory=dict)  # key -> where the number comes from
    schema: int = PROFILE_SCHEMA  # file layout version

    def model(self, name: str) -> ModelProfile:
        if name not in self.models:
            have = ", ".join(sorted(self.models)) or "none"
            raise ProfileError(f"profile ({self.hardware}) has no model {name!r} (it has: {have}); "
                               "profile that model with `talaria profile`")
        return self.models[name]

    def prefill_s(self, model: str, tokens: int, cached: int = 0) -> float:
        return self.model(model).prefill.seconds(tokens, cached)

    def decode_s(self, model: str, batch: int, context: int = 0) -> float:
        return self.model(model).decode.seconds(batch, context)

    def restore_s(self, model: str, tokens: int) -> float:
        """Copying `tokens` tokens of KV from host memory back to the device."""
        return tokens * self.model(model).kv_bytes_per_token / self.bandwidth.restore

    def save_s(self, model: str, tokens: int) -> float:
        """Copying `tokens` tokens of KV from the device to host memory."""
        return tokens * self.model(model).kv_bytes_per_token / self.bandwidth.d2h_bytes_per_s

    def switch_s(self, model: str, path: str = "h2d_only") -> float:
        """Seconds to open `model` by `path`: recorded if the profile has it, else estimated.

        Estimate: the weight copy (h2d_only: weights_bytes / h2d; full_d2d: weights_bytes / d2d)
        plus the four other phases of the first recorded path in SWITCH_PATHS order (none when
        nothing is recorded); partial is the mean of h2d_only and full_d2d, each as above.
        """
        if path not in SWITCH_PATHS:
            raise ProfileError(f"switch path {path!r} is not one of: {', '.join(SWITCH_PATHS)}")
        m = self.model(model)
        if path in m.switch:
            return m.switch[path].total_s
        if path == "partial":
            return (self.switch_s(model, "h2d_only") + self.switch_s(model, "full_d2d")) / 2
        rate = self.bandwidth.h2d_bytes_per_s if path == "h2d_only" else self.bandwidth.d2d_bytes_per_s
        recorded = [m.switch[p] for p in SWITCH_PATHS if p in m.switch]
        other = recorded[0].total_s - recorded[0].phase_s[1] if recorded else 0.0
        return m.weights_bytes / rate + other

    def with_model(self, model: ModelProfile) -> Profile:
        """A copy with `model` added, or replacing the model of the same name."""
        return dataclasses.replace(self, models={**self.models, model.name: model})


# ---- reading -------------------------------------------------------------------------------------

_MISSING = object()


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
    head = top.sub("profile", ("schema", "hardware", "device", "tp", "device_bytes", "created",
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
        sources=head.sources())


def _parse_model(models: _Table, name: str) -> ModelProfile:
    t = models.sub(name, ("weights_bytes", "kv_bytes_per_token", "prefill", "decode", "switch",
                          "sources"))
    pre = t.sub("prefill", ("base_s", "per_token_s", "per_token_context_s"))
    dec = t.sub("decode", ("base_s", "per_seq_s", "per_context_token_s"))
    paths = t.sub("switch", SWITCH_PATHS, noun="switch path", optional=True)
    switch = {}
    for path in paths.raw:
        cost = paths.sub(path, ("phase_s",))
        phases = cost.get("phase_s")
        if not isinstance(phases, list) or len(phases) != len(PHASE_NAMES):
            cost.fail("phase_s", f"= {phases!r} must be a list of {len(PHASE_NAMES)} seconds, "
                                 f"in order: {', '.join(PHASE_NAMES)}")
        phase = _Table(cost.origin, f"{cost.where}.phase_s", dict(zip(PHASE_NAMES, phases)),
                       PHASE_NAMES)
        switch[path] = SwitchCost(path, tuple(phase.number(p) for p in PHASE_NAMES))
    return ModelProfile(
        name=name, weights_bytes=t.count("weights_bytes"),
        kv_bytes_per_token=t.count("kv_bytes_per_token"),
        prefill=PrefillCurve(pre.number("base_s"), pre.number("per_token_s"),
                             pre.number("per_token_context_s", 0.0)),
        decode=DecodeCurve(dec.number("base_s"), dec.number("per_seq_s"),
                           dec.number("per_context_token_s", 0.0)),
        switch=switch, sources=t.sources())


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


# ---- writing -------------------------------------------------------------------------------------

def dump_profile(profile: Profile) -> str:
    """The TOML text of `profile`; `parse_profile(dump_profile(p)) == p`."""
    head = {"schema": profile.schema, "hardware": profile.hardware, "device": profile.device,
            "tp": profile.tp, "device_bytes": profile.device_bytes, "created": profile.created,
            "method": profile.method}
    if profile.sources:
        head["sources"] = dict(profile.sources)
    models = {}
    for name, m in profile.models.items():
        t = {"weights_bytes": m.weights_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
             "prefill": asdict(m.prefill), "decode": asdict(m.decode)}
        if m.switch:
            t["switch"] = {p: {"phase_s": list(c.phase_s)} for p, c in m.switch.items()}
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


# ---- fitting -------------------------------------------------------------------------------------

def fit_linear(xs: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...]:
    """Least-squares coefficients c >= 0 for ys ~ xs @ c (costs are never negative).

    Ordinary least squares, then the most negative coefficient is fixed at 0 and the rest refit,
    until none is negative (a simple active-set loop: at most one solve per column). Columns are
    scaled to unit maximum first, so a constant and a token-squared column fit equally well.
    """
    a, b = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if a.ndim != 2 or a.shape[0] == 0 or b.shape != (a.shape[0],):
        raise ValueError(f"fit_linear needs one row per sample and as many ys as rows; "
                         f"got xs of shape {a.shape} and {b.size} ys")
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    coef = np.zeros(a.shape[1])
    free = list(range(a.shape[1]))
    while free:
        sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            coef[free] = sol
            break
        del free[int(np.argmin(sol))]
    return tuple(float(c) + 0.0 for c in coef / scale)  # + 0.0 turns -0.0 into 0.0


def fit_prefill(samples: list[tuple[int, int, float]]) -> PrefillCurve:
    """Fit a `PrefillCurve` to timed prefills given as (new tokens, cached tokens, seconds)."""
    if any(n < 1 or c < 0 for n, c, _ in samples):
        raise ValueError("prefill samples need tokens >= 1 and cached >= 0")
    xs = [(1.0, n, n * (c + n / 2)) for n, c, _ in samples]
    return PrefillCurve(*fit_linear(xs, [s for _, _, s in samples]))


def fit_decode(samples: list[tuple[int, int, float]]) -> DecodeCurve:
    """Fit a `DecodeCurve` to timed decode steps given as (batch, context tokens, seconds)."""
    if any(b < 1 or c < 0 for b, c, _ in samples):
        raise ValueError("decode samples need batch >= 1 and context >= 0")
    xs = [(1.0, b, c) for b, c, _ in samples]
    return DecodeCurve(*fit_linear(xs, [s for _, _, s in samples]))
