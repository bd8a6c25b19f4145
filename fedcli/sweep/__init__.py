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
- the sweep has one MLflow parent run (tags `fedcli.sweep`, `fedcli.sweep_spec_hash`: `parent_tags`)
  whose trials are nested children; a rerun reuses it. The sweep's MLflow mirror opens it.

Layout (no module imports one below it back; import each name from the module that defines it):
`spec_keys` (a spec's declared keys and their checks) -> `spec` (reading a spec, expanding it
into trials) -> `plan` (`Plan`, `plan_trials`,
a trial's config and environment) -> `scheduler` (`TrialProcess`, `TrialClaims`, `Scheduler`,
`TrialOutcome`, `TrialSource`) -> `rows` (the live table's rows, `parent_tags`); `process` starts sweep
workers so that they end with the sweep; the long-lived workers that run the trials are `worker_pool`
(the sweep's side, `WorkerScheduler`) and `worker` (the worker process); `search` sets up the Optuna
study and `search_source` (`SearchSource`) runs it; `estimate` is `fedcli sweep --dry-run`'s probe;
`ray_runner` (`RayScheduler`), `ray_checks` (what a cluster must offer) and `ray_actor` (what runs on a
Ray node) are `--backend ray`.
"""
