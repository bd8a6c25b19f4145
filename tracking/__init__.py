"""Tracking: the SQL results store, the MLflow sink and the per-run `Tracker` fan-out.

Modules (import them directly; this package imports nothing so that `import
fedcli.tracking` stays cheap and MLflow is only imported when its sink is used):

- `fedcli.tracking.keys` — metric-key and metric-value checks, `flatten_config`.
- `fedcli.tracking.store` — `SqlStore` (SQLAlchemy 2, the source of truth for reports),
  `RunRecord`, `canonical_json`, `config_hash`, `default_store_url`.
- `fedcli.tracking.mlflow.sink` — `MlflowSink` (explicit-client MLflow, asynchronous
  metric batches), `default_tracking_uri`. Importing it imports MLflow.
- `fedcli.tracking.sinks` — `Tracker`, one per run: writes every round to the store and,
  when given, to MLflow.

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
