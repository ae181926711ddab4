"""The one exception the config loader raises."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(Exception):
    """A `talaria.toml` the user must fix.

    The loader collects every problem it finds before raising, so one run shows them all; each
    problem is one line of the form `FILE: [table] key ...: what is wrong; what to do`.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        super().__init__("\n".join(self.problems))
