"""Rank 0's answer to an admin switch (talaria/executor/rank_loop.py), in-process: every forced
switch is answered with its record, the 17th and later too (the scheduler keeps only the last 16
records, and counting them once made every later admin switch wait for ever)."""

from __future__ import annotations

from talaria.config.schema import Pool
from talaria.contracts.call import SwitchDone, SwitchModel
from talaria.executor.rank_loop import _force_switch, _switched
from tests.tiny_models import engine, tiny_files


def test_every_admin_switch_is_answered_past_the_kept_records(model_cache):
    files = [tiny_files(f, model_cache) for f in ("llama", "qwen3")]
    driver = engine(files, pool=Pool.COLD, ttft_s=3600.0)
    waiting: list = []
    for i in range(20):
        target = files[(i + 1) % 2].name
        assert _force_switch(driver, SwitchModel(target, f"s{i}"), waiting) == []
        driver.step()
        [done] = _switched(driver, waiting)
        assert isinstance(done, SwitchDone) and done.request_id == f"s{i}" and done.error is None
        assert done.record["to_model"] == target and waiting == []
    assert driver.scheduler.switch_count == 20 and len(driver.scheduler.switches) == 16
