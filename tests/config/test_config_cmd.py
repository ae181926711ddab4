"""`talaria config check`: summary and OK, or every problem on stderr and exit code 2."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from talaria.cli.config_cmd import config

FIXTURES = Path(__file__).parent / "fixtures"

SYNTHETIC = """
[[models]]
name = "tiny"
source = "synthetic:"
seed = 7

[models.shape]

[[instances]]
name = "cold-0"
pool = "cold"
models = ["tiny"]
tp = 2
arena_bytes = "{arena}"
"""


def _run(*args: str):
    return CliRunner().invoke(config, ["check", *args])


def test_check_without_file_summarises_the_embedded_default() -> None:
    result = _run()
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith("talaria.toml: 3 models, 2 instances")
    assert "server  127.0.0.1:8000" in lines
    assert "router  full, lease 1 s" in lines
    hot = next(line for line in lines if line.strip().startswith("hot-0"))
    assert hot.split() == ["hot-0", "hot", "tp", "1", "cpu", "arena", "1.50", "GiB", "smollm2"]
    cold = next(line for line in lines if line.strip().startswith("cold-0"))
    assert cold.split()[:7] == ["cold-0", "cold", "tp", "2", "cpu", "arena", "256"]
    assert cold.endswith("tiny-llama, tiny-qwen3")
    assert lines[-1] == "OK"


def test_check_lists_every_problem_on_stderr_and_exits_2() -> None:
    path = FIXTURES / "many_problems.toml"
    result = _run(str(path))
    assert result.exit_code == 2
    assert result.stdout == ""
    err = result.stderr.splitlines()
    assert err[-1] == "4 problems found"
    assert all(line.startswith(f"{path}: ") for line in err[:-1])
    assert any('unknown key "tpp"; did you mean "tp"?' in line for line in err)


def test_check_single_problem_says_one_problem() -> None:
    result = _run(str(FIXTURES / "peer_bad_url.toml"))
    assert result.exit_code == 2
    assert "is not an http(s) base URL" in result.stderr
    assert result.stderr.splitlines()[-1] == "1 problem found"


def test_missing_file_exits_2_with_a_message() -> None:
    result = _run(str(FIXTURES / "absent.toml"))
    assert result.exit_code == 2
    assert "absent.toml: no such file" in result.stderr


def test_files_flag_runs_the_file_checks(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(SYNTHETIC.format(arena="64MiB"))
    plain = _run(str(path))
    assert plain.exit_code == 0 and "KV pages" not in plain.stdout
    result = _run(str(path), "--files")
    assert result.exit_code == 0, result.output
    assert "synthetic: llama hidden 64 x 2 layers, 4/2 heads, seed 7" in result.stdout
    assert 'model "tiny": llama' in result.stdout
    assert 'instance "cold-0": arena 64 MiB per rank' in result.stdout
    assert result.stdout.splitlines()[-1] == "OK"


def test_files_flag_shows_each_models_page_and_state_bytes_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(SYNTHETIC.format(arena="64MiB"))
    result = _run(str(path), "--files")
    assert result.exit_code == 0, result.output
    # tp 2 splits the 2 KV heads: k and v x 2 layers x 1 head x 16 dims x 4 B (float32) = 256 B a
    # token; pages of 16 tokens (the default page_size) hold 4096 B; no per-sequence state
    assert ('instance "cold-0" model "tiny" cache: page 4096 B (16 tokens, 256 B a token), state 0 B; '
            "k 1x16 float32 on 2 layers, v 1x16 float32 on 2 layers") in result.stdout.splitlines()


def test_files_flag_failure_prints_summary_then_problems(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(SYNTHETIC.format(arena="64KiB"))
    result = _run(str(path), "--files")
    assert result.exit_code == 2
    assert "cold-0" in result.stdout and "OK" not in result.stdout
    assert f'{path}: [[instances]] "cold-0": arena_bytes = 65536 (64 KiB) is too small' in result.stderr


def test_a_plain_http_peer_on_another_machine_is_a_warning_not_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(SYNTHETIC.format(arena="64MiB") + '\n[[router.peers]]\nurl = "http://10.0.0.2:8000"\n')
    result = _run(str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "OK"
    assert result.stderr.splitlines() == [(f'{path}: [[router.peers]]: warning: url = "http://10.0.0.2:8000" is plain '
                                          "http to another machine: the prompts forwarded there cross the network "
                                          "unencrypted; use https://")]


def test_help_explains_the_two_stages() -> None:
    result = _run("--help")
    assert result.exit_code == 0
    assert "default: the embedded config" in result.output
    assert "--files" in result.output and "metadata" in result.output
    assert "exit code is 2" in result.output
