"""The caller's task data cache (a sweep worker's, fedcli/sweep/worker.py): `build(cfg, data_cache=...)`
loads a task's data once per loader options; without one every build loads afresh."""

from __future__ import annotations

from typing import Any

from fedcli.config.build import build_config
from fedcli.engine.setup import build


def test_build_reuses_the_callers_task_data_per_loader_options() -> None:
    cfg = build_config(overrides={"data.task": "lsq"})
    cache: dict[tuple[Any, ...], Any] = {}
    first, second = build(cfg, data_cache=cache), build(cfg, data_cache=cache)
    assert len(cache) == 1 and first.data.x.data_ptr() == second.data.x.data_ptr()
    build(build_config(overrides={"data.task": "lsq", "seed": 1}), data_cache=cache)
    assert len(cache) == 2  # the seed is a loader option: synthetic data differs per seed
    assert build(cfg).data.x.data_ptr() not in {first.data.x.data_ptr(), build(cfg).data.x.data_ptr()}
