"""Pruning (docs/sweeps.md, "Pruning"): a trial the pruner stops ends `pruned` at its round, checkpointed, not
failed; `fedcli list` shows it, reports leave it out unless asked; an older store learns the new status."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.tracking.store.sql_store import SqlStore
from tests.sweeps.test_search import BASE, finish, study_of, sweep

optuna = pytest.importorskip("optuna")


@pytest.mark.slow
def test_a_bad_trial_is_pruned_at_its_round_listed_and_left_out_of_reports(tmp_path: Path) -> None:
    """Trials enqueued by hand run first, in order: two good learning rates, then one that barely learns,
    which the median pruner (2 start-up trials, no pruning in round 1) stops at round 2."""
    url = f"sqlite:///{tmp_path / 'fedcli.db'}"
    study = optuna.create_study(study_name="fedcli:prune", storage=url, direction="minimize")
    for lr in (0.05, 0.03, 1e-6):
        study.enqueue_trial({"client_lr": lr})
    spec = tmp_path / "prune.yaml"
    spec.write_text(
        f"experiment: prune\nbase: {BASE % (6, 1)}\n"
        "search: {sampler: tpe, trials: 3, metric: loss, direction: min,\n"
        "         space: {client_lr: [0.05, 0.03, 0.000001]}}\n"
        "pruner: {type: median, warmup: 1, startup_trials: 2}\nreport: {metric: loss}\n"
    )
    code, err = finish(sweep(tmp_path, spec))
    assert code == 0, err  # a pruned trial does not fail the sweep
    assert "2 finished, 1 pruned" in err
    trials = {t.number: t for t in study_of(url, "prune")}
    assert [trials[n].state.name for n in range(3)] == ["COMPLETE", "COMPLETE", "PRUNED"]
    db = SqlStore(url)
    bad = db.get_run(trials[2].user_attrs["fedcli.run_id"])
    assert (bad.status, bad.failure_reason, db.last_round(bad.id)) == ("pruned", "pruned at round 2", 2)
    assert sorted(trials[2].intermediate_values) == [1, 2]
    assert 2 in [r for r, _ in db.checkpoints(bad.id)]  # stopped in order: its last round is checkpointed
    listed = CliRunner().invoke(app, ["list", "runs", "--root", str(tmp_path), "--json"])
    assert listed.exit_code == 0, listed.output
    assert {r["id"]: (r["status"], r["rounds"]) for r in json.loads(listed.stdout)}[bad.id] == ("pruned", 2)

    report = tmp_path / "out" / "r.md"
    result = CliRunner().invoke(
        app, ["report", "--experiment", "prune", "--root", str(tmp_path), "--output", str(report)]
    )
    assert result.exit_code == 0, result.output
    text = report.read_text()
    assert bad.id not in text and "## Search" in text  # pruned runs are left out by default
    best = min((trials[0], trials[1]), key=lambda t: t.value)
    assert f"best trial: #{best.number}, eval/loss = {best.value:.4f}" in text
    assert "trials: 2 complete, 1 pruned" in text
    for name in ("r-search-history.png", "r-search-importances.png"):
        assert (report.parent / name).stat().st_size > 1000 and f"]({name})" in text
    every = CliRunner().invoke(
        app,
        [
            "report",
            "--experiment",
            "prune",
            "--root",
            str(tmp_path),
            "--include-unfinished",
            "--output",
            str(tmp_path / "all" / "r.md"),
        ],
    )
    assert every.exit_code == 0 and bad.id in (tmp_path / "all" / "r.md").read_text()


def test_an_older_store_takes_the_pruned_status(tmp_path: Path) -> None:
    """A store made before `pruned` existed has a CHECK constraint without it: opening it widens the constraint."""
    path = tmp_path / "old.db"
    SqlStore(f"sqlite:///{path}").close()
    conn = sqlite3.connect(path)  # put the old constraint back, as a fedcli before this change wrote it
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
    old = sql.replace("'interrupted', 'pruned'", "'interrupted'")
    assert old != sql
    version = conn.execute("PRAGMA schema_version").fetchone()[0]
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'runs'", (old,))
    conn.execute(f"PRAGMA schema_version = {version + 1}")
    conn.execute("PRAGMA writable_schema = OFF")
    conn.commit()
    conn.close()
    db = SqlStore(f"sqlite:///{path}")
    run = db.start_run(
        experiment="e",
        run_name="r",
        config={},
        algo="fedavg",
        task="lsq",
        seed=0,
        tags={},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
    )
    db.end_run(run, "pruned", reason="pruned at round 3")
    assert db.get_run(run).status == "pruned"
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with pytest.raises(sqlite3.IntegrityError):  # still a constraint: an unknown status is refused
        check.execute("UPDATE runs SET status = 'bogus'")
