"""Tiny random-weight models (float64) and helpers to run the engine in-process against the reference.

The `model_cache` and `tiny` fixtures are registered for every folder by tests/conftest.py.

Two environment variables move the engine tests elsewhere (bench/gpu_check.sh sets them):
`TALARIA_TEST_DEVICE=cuda` runs the in-process engine on the GPU, and `TALARIA_TEST_DTYPE=float32`
builds the tiny models in float32. The reference stays float64 on the CPU either way."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from talaria.config.schema import (
    DTYPES,
    Device,
    InstanceConfig,
    ModelConfig,
    Pool,
    SyntheticShape,
)
from talaria.contracts.call import CallOutput, InstanceCall, SamplingParams
from talaria.executor.driver import Driver, start_driver
from talaria.executor.executor import Executor
from talaria.executor.parallel import TPGroup
from talaria.models.source import ModelFiles, prepare_model

SHAPES = {
    # 4 query / 2 KV heads: GQA, tp 1, 2 (split KV) and 4 (replicated KV)
    "llama": SyntheticShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            vocab_size=320, max_position=512, family="llama"),
    "qwen2": SyntheticShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            vocab_size=320, max_position=512, family="qwen2", tie_word_embeddings=True),
    "qwen3": SyntheticShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            vocab_size=320, max_position=512, family="qwen3", head_dim=32),
}

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def engine_device() -> str:
    """The device the engine tests run on: TALARIA_TEST_DEVICE (cpu, the default, or cuda)."""
    name = os.environ.get("TALARIA_TEST_DEVICE", "cpu")
    if name not in {d.value for d in Device}:
        raise ValueError(f"TALARIA_TEST_DEVICE={name!r}; use one of: {', '.join(d.value for d in Device)}")
    return name


def engine_dtype() -> str:
    """The dtype of the tiny models: TALARIA_TEST_DTYPE (float64, the default, or float32)."""
    name = os.environ.get("TALARIA_TEST_DTYPE", "float64")
    if name not in DTYPES:
        raise ValueError(f"TALARIA_TEST_DTYPE={name!r}; use one of: {', '.join(DTYPES)}")
    return name


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


def tiny_files(family: str, cache, dtype: str | None = None, seed: int = 0) -> ModelFiles:
    dtype = dtype or engine_dtype()
    cfg = ModelConfig(name=f"tiny-{family}", source="synthetic:", dtype=dtype, seed=seed, shape=SHAPES[family])
    return prepare_model(cfg, None, cache)


@pytest.fixture(scope="session", params=sorted(SHAPES))
def tiny(request, model_cache) -> ModelFiles:
    return tiny_files(request.param, model_cache)


def instance(files: list[ModelFiles], **overrides) -> InstanceConfig:
    base = InstanceConfig(name="test", pool=Pool.HOT, models=tuple(f.name for f in files),
                          device=Device(engine_device()), arena_bytes=32 << 20, page_size=4,
                          max_batch_tokens=64, max_running=16)
    return replace(base, **overrides)


def driver(config: InstanceConfig, files: list[ModelFiles], **options) -> Driver:
    """An instance in-process at TP=1, as a worker builds rank 0: the Executor, then the Driver.
    `options`: the Executor's `fault`, the Driver's `probes`."""
    fault = options.pop("fault", None)
    return start_driver(Executor(config, files, TPGroup(0, 1), fault=fault), **options)


def engine(files: list[ModelFiles], **overrides) -> Driver:
    return driver(instance(files, **overrides), files)


def arena_for_pages(files: ModelFiles, pages: int, **overrides) -> int:
    """arena_bytes that leaves exactly `pages` KV pages for this model (plus the null page)."""
    plan = engine([files], **overrides).executor.substrate.layout.plan(files.name)
    size = plan.kv.start + (pages + 1) * plan.page_bytes + plan.runtime.size  # kv.start: past any state slots
    return -(-size // 256) * 256 + 256


def call(request_id: str, model: str, prompt, sampling: SamplingParams = GREEDY) -> InstanceCall:
    return InstanceCall(request_id, model, tuple(prompt), sampling)


def run(core: Driver, calls: list[InstanceCall], max_steps: int = 10_000) -> dict[str, list[CallOutput]]:
    """Submit every call, step until idle; outputs per request id."""
    outs: dict[str, list[CallOutput]] = {}
    for c in calls:
        for o in core.add(c):
            outs.setdefault(o.request_id, []).append(o)
    for _ in range(max_steps):
        if not core.has_work:
            return outs
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outputs: list[CallOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]
