"""The GPUs of cuda instances: read from `devices`, laid out in config order when left out, and the
device each rank selects (`InstanceConfig.rank_device`, what the rank loop and the arena use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.config.errors import ConfigError
from talaria.config.loader import parse_config
from talaria.config.schema import Device, InstanceConfig, Pool

REPO = Path(__file__).parents[2]
MODEL = '[[models]]\nname = "m"\nsource = "synthetic:"\n[models.shape]\n'


def instances(*entries: str) -> str:
    return MODEL + "".join(f'\n[[instances]]\nname = "i{n}"\npool = "cold"\nmodels = ["m"]\n{e}'
                           for n, e in enumerate(entries))


def devices(text: str) -> list[tuple[int, ...]]:
    return [i.devices for i in parse_config(text, None).instances]


def test_instances_without_devices_take_gpus_in_config_order() -> None:
    text = instances('tp = 2\ndevice = "cuda"\n', 'device = "cpu"\n', 'tp = 4\ndevice = "cuda"\n',
                     'device = "cuda"\n')
    assert devices(text) == [(0, 1), (), (2, 3, 4, 5), (6,)]  # a CPU instance takes none


def test_the_default_layout_continues_after_the_highest_gpu_named_before() -> None:
    text = instances('tp = 2\ndevice = "cuda"\ndevices = [6, 7]\n', 'tp = 2\ndevice = "cuda"\n',
                     'tp = 2\ndevice = "cuda"\ndevices = [0, 1]\n')
    assert devices(text) == [(6, 7), (8, 9), (0, 1)]


def test_explicit_devices_may_be_in_any_order() -> None:
    assert devices(instances('tp = 2\ndevice = "cuda"\ndevices = [5, 3]\n')) == [(5, 3)]


def test_a_default_layout_that_runs_into_named_gpus_is_an_overlap() -> None:
    text = instances('tp = 2\ndevice = "cuda"\n', 'tp = 2\ndevice = "cuda"\ndevices = [1, 2]\n')
    with pytest.raises(ConfigError) as info:
        parse_config(text, None)
    (line,) = info.value.problems
    assert '"i1": devices = [1, 2] overlap instance "i0" on GPU 1; give each instance its own GPUs' in line
    assert "e.g. devices = [2, 3]" in line


def test_every_problem_with_devices_is_reported_at_once() -> None:
    text = instances('tp = 2\ndevice = "cuda"\ndevices = [0, 0, 1]\n', 'device = "cuda"\ndevices = [1]\n')
    with pytest.raises(ConfigError) as info:
        parse_config(text, None)
    problems = info.value.problems
    assert len(problems) == 3
    assert "lists 3 GPUs for tp = 2" in problems[0] and "names GPU 0 twice" in problems[1]
    assert 'overlap instance "i0" on GPU 1' in problems[2]


@pytest.mark.parametrize("rank, want", [(0, "cuda:4"), (3, "cuda:7")])
def test_each_rank_selects_its_gpu_from_the_instance_devices(rank: int, want: str) -> None:
    from talaria.config.loader import load_config

    cold = load_config(REPO / "examples" / "hot-cold-split.toml").instances_by_name("cold-0")
    assert cold.devices == (4, 5, 6, 7)  # "the other 4": not the hot instance's GPUs 0-3
    assert cold.rank_device(rank) == want


def test_rank_device_on_the_cpu_and_for_configs_built_in_code() -> None:
    base = InstanceConfig(name="x", pool=Pool.COLD, models=("m",), tp=2)
    assert [base.rank_device(r) for r in range(2)] == ["cpu", "cpu"]
    cuda = InstanceConfig(name="x", pool=Pool.COLD, models=("m",), tp=2, device=Device.CUDA)
    assert [cuda.rank_device(r) for r in range(2)] == ["cuda:0", "cuda:1"]  # no layout: rank index


def test_the_summary_shows_each_instance_gpus(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from talaria.cli.config_cmd import config

    path = tmp_path / "t.toml"
    path.write_text(instances('tp = 2\ndevice = "cuda"\n', 'device = "cuda"\ndevices = [5]\n'))
    out = CliRunner().invoke(config, ["check", str(path)]).output
    rows = [line.split() for line in out.splitlines() if line.startswith("  i")]
    assert [(r[0], r[4], r[5]) for r in rows] == [("i0", "cuda", "0,1"), ("i1", "cuda", "5")]
