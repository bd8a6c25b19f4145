"""Tracking: the SQL results store, its MLflow copy, the reports, and the per-run `Tracker` fan-out.

Import from the module that defines a name; this package imports nothing, so that `import
fedcli.tracking` stays cheap and MLflow is only imported where it is used. Its layout:

- `store/` — the SQL results store (`store.sql_store.SqlStore`, SQLAlchemy 2), the source of truth;
- `mlflow/` — the MLflow copy: `mlflow.sink.MlflowSink`, the mirror processes that keep it, the
  logged model, the saved view of `fedcli ui`;
- `report/` — `fedcli report`'s tables and figures, read from the SQL store only;
- loose, what several of those share: `sinks` (`Tracker`, one per run: every round to the store
  and, when given, to the run's MLflow mirror), `keys` (metric-key and metric-value checks,
  `flatten_config`), `urls` (credentials masked in URLs, `sqlite_path`), `metric_defs` (the paper
  tables' definitions, which the engine's evaluation reads too), `served` (a logged model's
  weights; every logged MLflow model imports it by this path, so it stays here).

Nothing here imports the sweep, the run layer, the Python API, the CLI or the engine
(tests/test_layering.py).

Importing this package sets two MLflow defaults (a user's own setting is kept), before any of
fedcli's modules imports MLflow:

- `MLFLOW_DISABLE_TELEMETRY=true`: MLflow 3 sends usage telemetry over the network from every
  process that imports it, and joins its sender threads at exit (up to 1 s each). fedcli runs
  offline by default (no network at run time), and the wait was ~2 s at the end of every
  run's mirror. Set `MLFLOW_DISABLE_TELEMETRY=false` to let MLflow send it.
- `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false`: MLflow draws a tqdm bar on stderr for every
  artifact download when tqdm is installed (optuna and datasets bring it): `fedcli sync`
  printed six bar lines per run.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
