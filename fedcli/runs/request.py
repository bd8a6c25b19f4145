"""The typed request of one run: `fedcli train`'s options as one frozen dataclass (docs/python-api.md, "Settings").

    options = TrainOptions(rounds=20, client_lr=0.05, no_mlflow=True)   # the CLI: from its parameters
    options = TrainOptions.from_settings(settings)                       # the API: from its keywords
    options.overrides()   # {"train.rounds": 20, "train.client_lr": 0.05, "tracking.use_mlflow": False}

Each field is one option under its Python name (`--client-lr` is `client_lr`), None = not given;
its `field(metadata=...)` names the config key it sets (`key`), whether it is a switch that only
switches on (`flag`: False = not given, as on the command line) and whether a `pathlib.Path` may
give it (`path`). `fedcli train` (fedcli/cli/train.py) builds it from its parameters, `fedcli.train`
(fedcli/api.py) from its keyword settings; `resolve_config` (fedcli/runs/run.py) turns it into
dotted config overrides. The field types are what the options take; values are checked when the
config is built (fedcli/config/build.py), the switches and paths here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from fedcli.errors import ConfigError

__all__ = ["TrainOptions"]


def _option(key: str, *, flag: bool = False, path: bool = False) -> Any:
    """A field of `TrainOptions`: not given (None) by default; `key` the config key it sets."""
    return dataclasses.field(default=None, metadata={"key": key, "flag": flag, "path": path})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """`fedcli train`'s options that set a config key; None = not given (module docstring)."""

    algo: str | None = _option("algorithm.name")
    task: str | None = _option("data.task")
    model: str | None = _option("data.model")
    data_dir: str | Path | None = _option("data.data_dir", path=True)
    data: str | Path | None = _option("data.file", path=True)
    download: bool | None = _option("data.download", flag=True)
    max_clients: int | None = _option("data.max_clients")
    data_store: str | None = _option("data.data_store")
    partition: str | Path | None = _option("partition.file", path=True)
    scheme: str | None = _option("partition.scheme")
    alpha: float | None = _option("partition.alpha")
    clients: int | None = _option("partition.num_clients")
    shards_per_client: int | None = _option("partition.shards_per_client")
    labels_per_client: int | None = _option("partition.labels_per_client")
    min_size: int | None = _option("partition.min_size")
    balanced: bool | None = _option("partition.balanced", flag=True)
    sigma: float | None = _option("partition.sigma")
    size_alpha: float | None = _option("partition.size_alpha")
    rounds: int | None = _option("train.rounds")
    clients_per_round: int | None = _option("train.clients_per_round")
    local_epochs: int | None = _option("train.local_epochs")
    batch_size: int | None = _option("train.batch_size")
    client_lr: float | None = _option("train.client_lr")
    client_momentum: float | None = _option("train.client_momentum")
    server_opt: str | None = _option("train.server_opt")
    server_lr: float | None = _option("train.server_lr")
    server_momentum: float | None = _option("train.server_momentum")
    device: str | None = _option("train.device")
    executor: str | None = _option("train.executor")
    cohort_chunk: int | None = _option("train.cohort_chunk")
    workers: int | None = _option("train.workers")
    threads: int | None = _option("train.threads")
    compile: bool | None = _option("train.compile", flag=True)
    graph: bool | None = _option("train.graph", flag=True)
    precision: str | None = _option("train.precision")
    eval_every: int | None = _option("train.eval_every")
    eval_sample: int | None = _option("train.eval_sample")
    checkpoint_every: int | None = _option("train.checkpoint_every")
    keep_checkpoints: int | None = _option("train.keep_checkpoints")
    state_store: str | None = _option("train.state_store")
    state_cache_mb: int | None = _option("train.state_cache_mb")
    state_precision: str | None = _option("train.state_precision")
    bn_stats: str | None = _option("train.bn_stats")
    seed: int | None = _option("seed")
    experiment: str | None = _option("tracking.experiment")
    run_name: str | None = _option("tracking.run_name")
    root: str | Path | None = _option("tracking.root", path=True)
    store: str | None = _option("tracking.store")
    tracking_uri: str | None = _option("tracking.tracking_uri")
    no_mlflow: bool | None = _option("tracking.use_mlflow", flag=True)  # True sets use_mlflow to False
    # the API's only: per-example augmentation, e.g. ["crop:4", "flip"] (docs/python-api.md)
    augment: Sequence[str] | None = _option("data.augment")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> TrainOptions:
        """The options from keyword settings by Python name (`fedcli.train(**settings)`), checked in
        the order given: the first unknown name or bad switch / path is the one named.

        Raises:
            ConfigError: a name that is no option, with the closest option named; a switch that is
                not True/False; a Path for a setting that is no path.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, value in settings.items():
            if name not in fields:
                from fedcli.config.checks import suggest

                raise ConfigError(
                    f"unknown setting {name!r}{suggest(name, list(fields))}; the settings are "
                    '`fedcli train`\'s options (docs/python-api.md, "Settings").'
                )
            _override(fields[name], value)
        return cls(**settings)

    def overrides(self) -> dict[str, Any]:
        """The options given, as dotted config overrides (`{"train.rounds": 20}`).

        Enums give their value and paths their text; a switch set to False is not given, and
        `no_mlflow=True` sets `tracking.use_mlflow` to False.

        Raises:
            ConfigError: a switch that is not True/False; a Path for a setting that is no path.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = _override(f, getattr(self, f.name))
            if value is not None:
                out[f.metadata["key"]] = value
        return out


def _override(f: dataclasses.Field[Any], value: Any) -> Any:
    """One option's value as its config key's (None = not given), checked (`TrainOptions.overrides`)."""
    name = f.name
    if f.metadata["flag"]:
        if value is not None and not isinstance(value, bool):  # no_mlflow="no" was truthy: MLflow off
            raise ConfigError(f"{name} must be True or False; got {type(value).__name__} {value!r}.")
        return (False if name == "no_mlflow" else True) if value else None
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        if not f.metadata["path"]:  # store=Path("x.db") was str()-ed into a URL SQLAlchemy refused
            hint = (
                " (a URL such as sqlite:////abs/path/fedcli.db)" if name in ("store", "tracking_uri") else ""
            )
            raise ConfigError(
                f"{name} must be str{hint}, not a path; got {type(value).__name__} {str(value)!r}."
            )
        return str(value)
    return value
