"""The run layer under both front ends: the CLI (fedcli/cli/) and the Python API (fedcli/api.py) call it;
nothing here imports fedcli.cli (tests/test_layering.py).

Import each name from the module that defines it (this package re-exports nothing): `request` (the
typed run request `TrainOptions`: `fedcli train`'s options and their config keys), `run` (options ->
RunConfig, validation before anything is written, one run in this process, `preserved_state`),
`stores` (the SQL store, the MLflow mirror, the tracker), `progress` (the console and the progress
bar), `outputs` (output files the user names, all or nothing), `reports` (a report's options and
files), `arguments` (the checks of the Python API's arguments) and `objects` (live models and data
objects given to the Python API, recorded as references).
"""
