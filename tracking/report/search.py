"""The search section of a report (docs/sweeps.md, "Reports of a search"): best trial, history, importances.

Runs of a `search:` sweep carry the tags `fedcli.search_study` and `fedcli.search_trial`
(fedcli/sweep/search.py). When the selected runs do, `search_summary` reads their Optuna study from
the same database (read only: no table is created) and the report gains the best trial (its
parameters, metric and run), the trials by state, the share of trial-rounds the pruner saved, and two
figures drawn by Optuna's matplotlib visualisation (tracking/report/plots.py `search_figures`): the
optimisation history and the parameter importances (fANOVA, seed 0, which needs scikit-learn; without it
Optuna's PED-ANOVA evaluator).
Optuna is imported only for such runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STUDY_TAG, TRIAL_TAG = "fedcli.search_study", "fedcli.search_trial"


@dataclass
class SearchSummary:
    """What the report says about a study (numbers only; the figures are drawn from `study`)."""

    study: str
    metric: str
    direction: str  # maximize | minimize
    counts: dict[str, int]  # trial state -> trials
    best: dict[str, Any] | None  # number, value, params, run_id
    rounds_run: int  # trial-rounds trained (every trial's last reported round)
    rounds_budget: int  # what they would have trained without pruning
    handle: Any = field(default=None, repr=False)  # the optuna Study (figures)


def search_summary(url: str, records: Sequence[Any]) -> SearchSummary | None:
    """The summary of the study the runs belong to (the first study tag among them), else None."""
    names = sorted({r.tags[STUDY_TAG] for r in records if r.tags.get(STUDY_TAG)})
    if not names:
        return None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url, skip_table_creation=True, skip_compatibility_check=True)
    try:
        study = optuna.load_study(study_name=names[0], storage=storage)
    except KeyError:
        return None
    trials = [t for t in study.get_trials(deepcopy=False) if "fedcli.void" not in t.user_attrs]
    counts = dict(Counter(t.state.name.lower() for t in trials))  # in the order states first appear
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        b = study.best_trial
        best = {
            "number": b.number,
            "value": b.value,
            "params": dict(b.params),
            "run_id": b.user_attrs.get("fedcli.run_id"),
        }
    full = max(
        (int((r.config.get("train") or {}).get("rounds") or 0) for r in records), default=0
    )  # a trial's rounds
    ended = [
        t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    ]
    run = sum(
        full if t.state == optuna.trial.TrialState.COMPLETE else max(t.intermediate_values, default=0)
        for t in ended
    )
    return SearchSummary(
        names[0],
        str(study.user_attrs.get("fedcli.metric", "value")),
        study.direction.name.lower(),
        counts,
        best,
        run,
        full * len(ended),
        study,
    )


def search_markdown(summary: SearchSummary) -> list[str]:
    """The report's "Search" section (markdown lines)."""
    counts = ", ".join(f"{n} {state}" for state, n in sorted(summary.counts.items()))
    lines = [
        "## Search",
        "",
        f"- study: `{summary.study}` ({summary.direction} {summary.metric} at a trial's last "
        f"round); trials: {counts}",
    ]
    if summary.rounds_budget:
        saved = 1 - summary.rounds_run / summary.rounds_budget
        lines.append(
            f"- trial-rounds trained: {summary.rounds_run} of {summary.rounds_budget} "
            f"({saved:.1%} saved by pruning)"
        )
    if summary.best is not None:
        best = summary.best
        params = ", ".join(
            f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
            for k, v in sorted(best["params"].items())
        )
        lines.append(
            f"- best trial: #{best['number']}, {summary.metric} = {best['value']:.4f}, run "
            f"`{best['run_id'] or '—'}`; {params}"
        )
    return [*lines, ""]
