"""Tracking: the SQL results store, the MLflow sink and the per-run `Tracker` fan-out.

Modules (import them directly; this package imports nothing so that `import
fedcli.tracking` stays cheap and MLflow is only imported when its sink is used):

- `fedcli.tracking.keys` — metric-key and metric-value checks, `flatten_config`.
- `fedcli.tracking.store` — `SqlStore` (SQLAlchemy 2, the source of truth for reports),
  `RunRecord`, `canonical_json`, `config_hash`, `default_store_url`.
- `fedcli.tracking.mlflow_sink` — `MlflowSink` (explicit-client MLflow, asynchronous
  metric batches), `default_tracking_uri`. Importing it imports MLflow.
- `fedcli.tracking.sinks` — `Tracker`, one per run: writes every round to the store and,
  when given, to MLflow.
"""
