"""`talaria tui` through click's CliRunner: help, one-line errors without tracebacks, and which feed
each set of options starts (the app's `run` is replaced, so no terminal is needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from talaria.cli.main import cli
from talaria.tui.app import DashboardApp
from talaria.tui.feed import LiveFeed, ReplayFeed

FIXTURE = Path(__file__).parent / "fixtures" / "events.jsonl"


def run(*args: str):
    return CliRunner().invoke(cli, ["tui", *args])


@pytest.fixture
def started(monkeypatch) -> list:
    """The feeds the command started the dashboard with."""
    feeds = []
    monkeypatch.setattr(DashboardApp, "run", lambda self: feeds.append(self.feed))
    return feeds


def test_help_lists_the_options_and_keys():
    result = run("--help")
    assert result.exit_code == 0
    for text in ("--url", "--api-key", "--replay", "--speed", "http://127.0.0.1:8000", "q quits"):
        assert text in result.output


def test_a_missing_replay_file_is_a_clear_error():
    result = run("--replay", "no-such-events.jsonl")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "'no-such-events.jsonl' does not exist" in result.output and "Traceback" not in result.output


def test_a_malformed_replay_file_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text().splitlines()[0] + "\n{oops\n")
    result = run("--replay", str(bad))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"Error: {bad}:2: not JSON" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (("--speed", "0"), "--speed"),
    (("--url", "127.0.0.1:8000"), "is not an http(s) URL"),
])
def test_bad_options_are_refused(args, message, started):
    result = run(*args)
    assert result.exit_code == 2 and message in result.output and started == []


def test_replay_plays_the_file_at_the_given_speed(started):
    result = run("--replay", str(FIXTURE), "--speed", "4")
    assert result.exit_code == 0, result.output
    (feed,) = started
    assert isinstance(feed, ReplayFeed) and feed.speed == 4.0 and len(feed.events) == 98


def test_live_watches_the_url(started):
    result = run("--url", "http://10.0.0.5:8000/", "--api-key", "k")
    assert result.exit_code == 0, result.output
    (feed,) = started
    assert isinstance(feed, LiveFeed) and feed.source == "http://10.0.0.5:8000"
