"""Long-lived Ray actors (fedcli/sweep/ray_runner.py `RayScheduler`, fedcli/sweep/ray_actor.py `TrialActor`), on a real
Ray head on loopback (the fixture of tests/sweeps/test_ray_backend.py): one actor runs several trials, each a
complete run of its own, with the actor's CPUs as its threads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sweeps.test_ray_backend import finish, ray_head, runs, sweep, write_spec  # noqa: F401 - ray_head: fixture

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_one_ray_actor_runs_several_trials_each_its_own_run(tmp_path: Path, ray_head: str) -> None:  # noqa: F811
    spec = write_spec(tmp_path, "ray-actors", rounds=2, algos="fedavg", seeds="0, 1, 2")
    code, err = finish(
        sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head, "--workers", "1", "--no-mlflow")
    )
    assert code == 0, err
    records = runs(tmp_path)
    assert len(records) == 3 and {r.status for r in records} == {"finished"}
    assert len({r.tags["fedcli.config_hash"] for r in records}) == 3
    assert len({r.pid for r in records}) == 1, "one actor's worker trained every trial"
    assert {r.config["train"]["threads"] for r in records} == {1}  # --cpus-per-trial 1 (the default)
    code, err = finish(sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head, "--no-mlflow"))
    assert code == 0 and "3 finished (skip)" in err, err
