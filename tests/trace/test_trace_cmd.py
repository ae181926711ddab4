"""`talaria trace gen | convert | stats` through click's CliRunner: output, files, and one-line errors."""

from __future__ import annotations

import io
import json

from click.testing import CliRunner

from talaria.cli.main import cli
from talaria.contracts.trace import read_trace, sessions


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_gen_preset_to_stdout_is_a_valid_trace():
    result = run("trace", "gen", "--preset", "paper-tp8", "--seed", "1")
    assert result.exit_code == 0, result.output
    calls = read_trace(io.StringIO(result.stdout))
    assert len(calls) == 960 and len(sessions(calls)) == 30
    assert result.stdout == run("trace", "gen", "--preset", "paper-tp8", "--seed", "1").stdout


def test_gen_generic_to_file_then_stats_json(tmp_path):
    out, js = tmp_path / "t.jsonl", tmp_path / "s.json"
    result = run("trace", "gen", "--sessions", "6", "--models", "a, b", "--arrival-s", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "6 sessions" in result.stderr
    calls = read_trace(out)
    assert {c.model for c in calls} == {"a", "b"}
    result = run("trace", "stats", str(out), "--json", str(js))
    assert result.exit_code == 0, result.output
    stats = json.loads(js.read_text())
    assert stats["sessions"] == 6 and stats["calls"] == len(calls)
    assert result.stdout.splitlines()[0].split()[:2] == ["statistic", "trace"]


def test_gen_max_prompt_tokens_says_so_on_stderr():
    result = run("trace", "gen", "--preset", "paper-tp4", "--load", "high", "--max-prompt-tokens", "1024")
    assert result.exit_code == 0, result.output
    assert "fits --max-prompt-tokens 1,024" in result.stderr
    calls = read_trace(io.StringIO(result.stdout))
    assert len(calls) == 120 and max(c.prompt_tokens for c in calls) <= 1024


def test_convert_mooncake(tmp_path):
    src = tmp_path / "mc.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 4000, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]},
    ]))
    result = run("trace", "convert", "--from", "mooncake", str(src), "--model", "m7")
    assert result.exit_code == 0, result.output
    calls = read_trace(io.StringIO(result.stdout))
    assert [(c.session, c.index, c.reused_tokens, c.gap_s, c.model) for c in calls] == \
           [("mc00000", 0, 0, 0.0, "m7"), ("mc00000", 1, 1024, 4.0, "m7")]


def test_gen_generic_shape_options_set_depth_gaps_spread_and_prompts():
    base = ("trace", "gen", "--sessions", "40", "--models", "a")
    paper = read_trace(io.StringIO(run(*base).stdout))
    shaped = read_trace(io.StringIO(run(*base, "--depth", "4,12", "--gap-s", "2,6.6", "--first-prompt-tokens", "900",
                                        "--tool-result-tokens", "100").stdout))

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    assert len(shaped) < len(paper)  # depth 4 against the paper's 11
    assert 1.5 < median([c.gap_s for c in shaped if c.index]) < 2.6
    assert median([c.prompt_tokens for c in shaped]) < median([c.prompt_tokens for c in paper]) / 4

    def per_session(calls):
        return sorted(median([c.gap_s for c in s[1:]]) for s in sessions(calls).values() if len(s) > 4)

    alike, spread = per_session(paper), per_session(read_trace(io.StringIO(run(*base, "--gap-spread", "1").stdout)))
    assert spread[-1] / spread[0] > 4 * (alike[-1] / alike[0])  # sessions differ in tool speed


def test_errors_are_one_line_and_non_zero(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "s", "index": 1}\n')
    cases = [
        (("trace", "gen", "--preset", "paper-tp16"), "paper-tp8"),
        (("trace", "gen"), "give --preset"),
        (("trace", "gen", "--preset", "paper-tp8", "--sessions", "3"), "cannot be combined"),
        (("trace", "gen", "--preset", "paper-tp8", "--load", "high"), "paper-tp4 only"),
        (("trace", "gen", "--preset", "paper-tp8", "--gap-s", "1,3"), "generic mode only"),
        (("trace", "gen", "--sessions", "2", "--depth", "11"), "--depth 11"),
        (("trace", "stats", str(bad)), "missing"),
        (("trace", "stats", str(tmp_path / "absent.jsonl")), "does not exist"),
        (("trace", "convert", "--from", "mooncake", str(bad)), "missing 'timestamp'"),
        (("trace", "gen", "--sessions", "2", "--out", str(tmp_path / "no" / "t.jsonl")), "cannot write"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code != 0, args
        assert isinstance(result.exception, SystemExit), (args, result.exception)  # no traceback
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.output
