"""A hand-written cost profile for engine tests, so no start-up calibration runs (costs hardly matter
there: switches are forced and rounds last an hour). Each model is priced by its cache layout's
token and state bytes."""

from __future__ import annotations

from pathlib import Path

from talaria.contracts.kv_layout import kv_layout
from talaria.contracts.profile import (
    Bandwidth,
    DecodeCurve,
    ModelProfile,
    PrefillCurve,
    Profile,
    SwitchCost,
)
from talaria.contracts.profile_file import save_profile
from talaria.contracts.vocabulary import SwitchPath
from talaria.models.source import ModelFiles


def write_profile(directory: Path, files: list[ModelFiles], tp: int, device_bytes: int) -> str:
    """The profile of `files` at `tp`, saved in `directory`; its path."""
    models = {}
    for f in files:
        layout = kv_layout(f.arch, tp, 16, f.dtype)  # token and state bytes do not depend on the page size
        models[f.name] = ModelProfile(f.name, 1 << 20, layout.token_bytes, PrefillCurve(1e-3, 1e-5),
                                      DecodeCurve(1e-3, 1e-4),
                                      {SwitchPath.H2D_ONLY: SwitchCost(SwitchPath.H2D_ONLY, (0, 1e-2, 0, 0, 0))},
                                      state_bytes=layout.state_bytes)
    profile = Profile("cpu: test", "cpu", tp, device_bytes, "2026-01-01T00:00:00+00:00", "hand-written for tests",
                      Bandwidth(1e9, 1e9, 1e10), models)
    path = directory / f"tp{tp}.toml"
    save_profile(profile, path)
    return str(path)
