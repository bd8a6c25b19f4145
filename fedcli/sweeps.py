"""Sweeps: expand a grid (algorithms x hyperparameters x seeds) into run configs and run them.

A sweep spec (YAML, docs/architecture.md §9)::

    experiment: femnist-fedpa-vs-fedavg
    base: {task: femnist, rounds: 200, clients_per_round: 10, local_epochs: 5}
    grid: {algo: [fedavg, fedpa], hp.rho: [0.01, 0.1]}
    seeds: [0, 1, 2]
    report: {metric: accuracy, thresholds: [0.7, 0.8], at: [100, 200]}

Keys are config keys: dotted (`train.rounds`), short (`rounds`, `task`, `algo`, the last part
of a dotted key when unambiguous) or `hp.<name>` for algorithm hyperparameters. A grid
value applies only to algorithms that have that hyperparameter (so `hp.rho` does not
multiply FedAvg's runs).

A sweep owns its trials:

- `plan_trials` matches each trial to the experiment's runs with the same config hash: a
  finished run is skipped, a live one (another process trains it) is never started again,
  an interrupted or failed run is resumed from its newest checkpoint with
  `fedcli train --resume` (a diverged one is not: it would diverge again), and only a trial
  without a run starts a new one. Rerunning the same command therefore continues a sweep.
- `TrialClaims`: right before a trial starts, the sweep claims it in the store
  (`SqlStore.claim_trial`: one row per (experiment, config hash), taken atomically) and plans
  it again; a trial claimed by another live sweep reads "running elsewhere" and is left to
  it, so two sweeps of one spec split the trials between them. The claim is released when
  the trial's process ends; one whose sweep died is taken over.
- `Scheduler` starts the trials (`WorkerScheduler`: in long-lived worker processes, docs/sweeps.md) from the main thread as child processes in the sweep's
  process group, each with PR_SET_PDEATHSIG=SIGTERM (Linux), so a SIGKILLed sweep still
  stops its trials in order (they checkpoint and read as `interrupted`). SIGTERM, SIGINT
  and SIGHUP to the sweep are forwarded to its running trials as SIGTERM; it waits for
  them to checkpoint and exit, starts nothing new, and reports the signal.
- `parent_run` makes the sweep one MLflow parent run (tags `fedcli.sweep`,
  `fedcli.sweep_spec_hash`) whose trials are nested children; a rerun reuses it.

Layout (this module re-exports every name; no module imports one below it back):
fedcli/sweep_spec.py (reading, checking and expanding a spec) -> sweep_plan.py (`Plan`,
`plan_trials`, a trial's command and environment) -> sweep_scheduler.py (`TrialProcess`,
`TrialClaims`, `Scheduler`, `TrialOutcome`, `TrialSource`) -> sweep_rows.py (the live table's rows,
`parent_run`); the long-lived workers that run the trials are fedcli/sweep_worker_pool.py (the
sweep's side, `WorkerScheduler`) and fedcli/sweep_worker.py (the worker process).
"""

from fedcli.sweep_plan import (  # noqa: F401
    DIVERGED,
    ELSEWHERE,
    NEW,
    RESUME,
    SETTLE_S,
    SKIP,
    Plan,
    plan_settled,
    plan_trials,
    trial_args,
    trial_command,
    trial_config_text,
    trial_env,
)
from fedcli.sweep_process import PR_SET_PDEATHSIG, die_with_parent  # noqa: F401
from fedcli.sweep_rows import (  # noqa: F401
    METRIC_KEYS,
    SPEC_HASH_TAG,
    SWEEP_TAG,
    TrialRow,
    _row_status,
    _run_of,
    experiment_runs,
    parent_run,
    trial_rows,
)
from fedcli.sweep_scheduler import (  # noqa: F401
    KILL_AFTER_S,
    STOP_SIGNALS,
    Scheduler,
    TrialClaims,
    TrialOutcome,
    TrialProcess,
    TrialSource,
    in_terminal_foreground,
    with_suppressed_lookup,
)
from fedcli.sweep_spec import (  # noqa: F401
    MAX_TRIALS,
    REPORT_KEYS,
    SPEC_KEYS,
    Trial,
    _dotted,
    _has_hp,
    check_hp_keys,
    check_report_keys,
    check_report_values,
    check_spec_values,
    expand,
    load_spec,
    short_keys,
    spec_hash,
    trial_name,
)

__all__ = [
    "DIVERGED",
    "ELSEWHERE",
    "KILL_AFTER_S",
    "MAX_TRIALS",
    "METRIC_KEYS",
    "NEW",
    "PR_SET_PDEATHSIG",
    "Plan",
    "REPORT_KEYS",
    "RESUME",
    "SETTLE_S",
    "SKIP",
    "SPEC_HASH_TAG",
    "SPEC_KEYS",
    "STOP_SIGNALS",
    "SWEEP_TAG",
    "Scheduler",
    "Trial",
    "TrialClaims",
    "TrialOutcome",
    "TrialProcess",
    "TrialSource",
    "TrialRow",
    "_dotted",
    "_has_hp",
    "_row_status",
    "_run_of",
    "check_hp_keys",
    "check_report_keys",
    "check_report_values",
    "check_spec_values",
    "die_with_parent",
    "expand",
    "experiment_runs",
    "in_terminal_foreground",
    "load_spec",
    "parent_run",
    "plan_settled",
    "plan_trials",
    "short_keys",
    "spec_hash",
    "trial_args",
    "trial_command",
    "trial_config_text",
    "trial_env",
    "trial_name",
    "trial_rows",
    "with_suppressed_lookup",
]
