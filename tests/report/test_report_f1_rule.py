"""`fedcli report` states the F1 decision rule under a table that shows an F1 metric (issue 36)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcli.config.build import build_config
from fedcli.tracking.report.build import build_report
from fedcli.tracking.report.model import ReportSpec
from fedcli.tracking.report.render import render_markdown
from fedcli.tracking.store.sql_store import SqlStore


def _run(task: str, root: Path) -> None:
    from fedcli.engine.train import train
    from fedcli.tracking.sinks import Tracker

    url = f"sqlite:///{root / 'fedcli.db'}"
    cfg = build_config(
        overrides={
            "data.task": task,
            "train.rounds": 2,
            "train.threads": 1,
            "tracking.store": url,
            "tracking.root": str(root),
            "tracking.use_mlflow": False,
            "tracking.experiment": task,
        }
    )
    with SqlStore(url) as store:
        train(cfg, tracker=Tracker(store))


@pytest.mark.slow
def test_the_f1_table_names_the_decision_rule_the_run_recorded(tmp_path: Path) -> None:
    """A bibtex run records data.f1_rule (top-2); the report's macro-F1 table and its eval table say it, once
    each; a report of a classification run (no F1 anywhere) says nothing about F1 decisions."""
    _run("bibtex", tmp_path)
    _run("synthetic-1-1", tmp_path)
    with SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}") as store:
        run = store.list_runs(experiment="bibtex")[0]
        assert run.config["data"]["f1_rule"].startswith("the 2 highest-scoring tags of each example")
        page = render_markdown(
            build_report(store, ReportSpec(experiments=("bibtex",), metric="eval/macro_f1"))
        )
        other = render_markdown(build_report(store, ReportSpec(experiments=("synthetic-1-1",))))
    rule = (
        "F1 decision rule (micro_f1, macro_f1): the 2 highest-scoring tags of each example are predicted "
        "(top-2); k = the training split's mean label cardinality 2.40, rounded (bibtex)."
    )
    assert page.count(rule) == 2, page
    assert "F1 decision rule" not in other
