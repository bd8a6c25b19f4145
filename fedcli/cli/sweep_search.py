"""`fedcli sweep` of a spec with a `search:` block: check it, show its plan, run it (docs/sweeps.md, "Search").

The trials come from an Optuna study in the store's database (fedcli/sweep/search_source.py `SearchSource`)
and run through the same scheduler, workers, claims, live table and report as a grid's
(fedcli/cli/sweep_run.py `run_plans`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from fedcli.errors import ConfigError
from fedcli.runs.progress import console


def prepare_search(body: Mapping[str, Any], tracking: Mapping[str, Any], report_path: Any) -> Any:
    """Check the search whole (ConfigError: exit 2, one line, nothing written) and print its plan; return
    the trials' tracking config. `fedcli sweep` then runs it with a `SearchSource` (or stops, `--dry-run`)."""
    from fedcli.runs.outputs import check_output
    from fedcli.sweep.search import check_space_configs, trial_of
    from fedcli.sweep.spec import check_report_keys

    try:
        import optuna  # noqa: F401 - the search's sampler, pruner and study
    except ImportError:
        raise ConfigError(
            "a `search:` sweep needs Optuna; install it with pip install 'fedcli[search]', or sweep "
            "a grid instead."
        ) from None
    tracking = {k: v for k, v in tracking.items() if v is not None}
    check_space_configs(body, tracking)  # every corner of the space builds a valid config
    sample = trial_of(body, {}, 0, tracking)
    check_report_keys(body.get("report") or {}, [sample])
    metric = body["search"].get("metric") or (body.get("report") or {}).get("metric") or "accuracy"
    try:
        check_report_keys({"metric": metric}, [sample])  # the objective is a metric the task logs
    except ConfigError as err:
        raise ConfigError(str(err).replace("report.metric", "search.metric", 1)) from None
    if report_path is not None:
        check_output(report_path, "report.output")
    show_search(body, sample.config.tracking)
    return sample.config.tracking


def show_search(body: Mapping[str, Any], track: Any) -> None:
    """The search's plan: sampler, budget, metric, space, pruner, and how far its study is (read only)."""
    from fedcli.sweep.search import search_metric, study_name, trial_of
    from fedcli.sweep.spec_keys import budget

    search, pruner = body["search"], body.get("pruner")
    done = study_progress(
        track.store_url, body["experiment"]
    )  # first: a store it cannot read is the one line shown
    out = console()
    out.print(
        f"search {study_name(body['experiment'])}: sampler {search.get('sampler', 'tpe')} "
        f"(seed {search.get('seed', 0)}), {budget(search)} trials, "
        f"{search.get('direction', 'max')}imise {search_metric(search, body)} at the last round, "
        f"seed {body.get('seeds', [0])[0]} per trial",
        highlight=False,
        soft_wrap=True,
    )
    for key, value in search["space"].items():
        shown = (
            f"one of {value}"
            if isinstance(value, list)
            else f"{next(iter(value))} in [{next(iter(value.values()))[0]}, {next(iter(value.values()))[1]}]"
        )
        out.print(f"  {key}: {shown}", highlight=False, soft_wrap=True)
    if pruner:
        options = ", ".join(f"{k} {v}" for k, v in pruner.items() if k != "type")
        out.print(
            f"pruner: {pruner['type']}{f' ({options})' if options else ''}, at evaluation rounds "
            f"(every {trial_of(body, {}, 0).config.train.eval_every} rounds)",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print("pruner: none (every trial runs all its rounds)", highlight=False)
    if done:
        out.print("study so far: " + ", ".join(f"{n} {state}" for state, n in done.items()), highlight=False)


def study_progress(url: str, experiment: str) -> dict[str, int]:
    """Trial counts by state of the experiment's study, read without writing (empty when there is none)."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    from fedcli.sweep.search import study_name
    from fedcli.tracking.store.sql_store import SqlStore

    reader = SqlStore.reader(url)
    if reader is None:
        return {}
    try:
        with reader._engine.connect() as conn:
            if "studies" not in inspect(conn).get_table_names():
                return {}
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            storage = optuna.storages.RDBStorage(url, skip_table_creation=True, skip_compatibility_check=True)
            study = optuna.load_study(study_name=study_name(experiment), storage=storage)
        except (
            KeyError,
            SQLAlchemyError,
        ):  # none yet, or another sweep is creating Optuna's tables right now
            return {}
        trials = study.get_trials(deepcopy=False)
        return Counter(t.state.name.lower() for t in trials if "fedcli.void" not in t.user_attrs)
    finally:
        reader.close()
