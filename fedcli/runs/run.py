"""One training run in this process, as `fedcli train` and `fedcli.train` start it (docs/python-api.md).

    cfg, resume_id = resolve_config(options, config=..., hp=..., resume=...)   TrainOptions -> RunConfig
    result = run_config(cfg, resume_run_id=resume_id)                          validate, store, train

`run_config` is the one path from a `RunConfig` to a finished (or stopped) run: check MLflow, spawn
the run's MLflow mirror, build the data, model and back end (everything is validated before the
store is opened), open the store, train (engine/train.py), and close what it opened. It runs under
`preserved_state()`, which puts back what a run changes in the process (signal handlers, torch's
thread count and float flags, the global RNG states), so that a notebook or a long-lived sweep
worker can train many runs in one process. `fedcli train` (fedcli/cli/train.py) is a thin layer
over `resolve_config` and `prepared_run`: it adds the progress bar, the printed lines and the exit codes.

Part of the run layer (fedcli/runs/__init__.py) that both front ends call: it opens the stores
and the mirror through fedcli/runs/stores.py and imports the engine, never fedcli.cli; nothing
below (engine, tracking, datasets, algorithms) imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig
    from fedcli.engine.distributed import Peers
    from fedcli.engine.lifecycle import GracefulSignals
    from fedcli.engine.rounds import ProgressFn
    from fedcli.engine.setup import Setup
    from fedcli.engine.train import RunResult
    from fedcli.runs.request import TrainOptions
    from fedcli.tracking.mlflow.handle import MirrorHandle
    from fedcli.tracking.sinks import Tracker

__all__ = [
    "PreparedRun",
    "StoppedBeforeStart",
    "prepared_run",
    "preserved_state",
    "resolve_config",
    "run_config",
]


class StoppedBeforeStart(KeyboardInterrupt):
    """A stop signal (SIGINT/SIGTERM/SIGHUP) arrived during the set-up, before the run was written:
    nothing was written. `signum` is the signal; `fedcli train` exits with 128 + it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name} before the run started; nothing was written."


def config_file(config: str | Path | None) -> Path | None:
    """A `--config` value as a file: an existing YAML file, else a config shipped with fedcli (`demo`).

    Raises:
        ConfigError: neither a file nor a packaged config's name.
    """
    from fedcli.configs import config_names, packaged_config

    if config is None:
        return None
    path = Path(config).expanduser()
    if path.is_file():
        return path.resolve()
    if str(config) in config_names():
        return packaged_config(str(config))
    raise ConfigError(
        f"--config {str(config)!r} is neither a YAML file nor a config shipped with fedcli "
        f"({', '.join(config_names())}); check the path."
    )


def resolve_config(
    options: TrainOptions,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    hp: Mapping[str, Any] | None = None,
    resume: str | None = None,
    sections: Mapping[str, Any] | None = None,
    warn: Callable[[str], None] | None = None,
    trust_code: bool = False,
) -> tuple[RunConfig, str | None]:
    """Build a run's config as `fedcli train` does: (RunConfig, the full id of the run to resume or None).

    Args:
        options: `fedcli train`'s options (`TrainOptions`, fedcli/runs/request.py).
        config: a YAML file, a packaged config's name (`demo`) or the config as a mapping; the options win.
        hp: algorithm hyperparameters (win over the config's `algorithm.hp`).
        resume: a run id, id prefix or run name: its stored config, with the options allowed to change.
        sections: more dotted overrides (`{"train.server_beta1": 0.95}`), applied like options.
        warn: called with each warning line (a config that makes the algorithm another one).
        trust_code: `resume` may import the user code its stored config names (`--trust-code`);
            without it, only code the options name again (`model`, `data`): `resumed_code`.

    Raises:
        ConfigError: anything invalid; nothing is written.
    """
    from fedcli.config.build import build_config, resume_config, warn_degenerate
    from fedcli.runs.stores import find_run

    overrides = {**options.overrides(), **dict(sections or {})}
    if resume is not None and (not isinstance(resume, str) or not resume.strip()):
        # `--resume "$RUN"` with RUN empty would otherwise train a fresh run from scratch
        raise ConfigError(
            f"--resume must name a run (its id, id prefix or name); got {resume!r}. Pass the run "
            "`fedcli list runs` shows, or leave --resume out to start a new run."
        )
    if trust_code and not resume:
        raise ConfigError(
            "--trust-code applies to --resume only (code you name with --model / --data runs without "
            "it); drop it."
        )
    if resume:
        if config is not None or hp:
            raise ConfigError("--resume continues a run with its stored config; drop --config and --hp.")
        record = find_run(resume, overrides)
        stored = record.requested or record.config
        overrides = resumed_code(record.id, stored, record.config, overrides, trust=trust_code)
        return resume_config(stored, overrides), record.id
    doc = dict(config) if isinstance(config, Mapping) else None
    cfg = build_config(
        file=None if doc is not None else config_file(config),  # type: ignore[arg-type]
        overrides=overrides,
        hp=hp,
        doc=doc,
    )
    for line in warn_degenerate([cfg]):  # a config that makes the algorithm another one
        if warn is not None:
            warn(line)
    return cfg, None


def resumed_code(
    run_id: str,
    stored: Mapping[str, Any],
    resolved: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    trust: bool,
    fix: str | None = None,
) -> dict[str, Any]:
    """Check that a resumed run's user code may run; return the overrides without the references that name it.

    The stored config's model and data function (datasets/yours/trust.py) run only when the
    options name the same reference again (`data.model`, `data.file`: then dropped from the
    overrides, as they change nothing) or with `trust` (the recorded sha256 must match).
    A different reference is left in the overrides: `resume_config` refuses the change.

    Raises:
        ConfigError: one line naming the code and how to allow it; nothing is written.
    """
    from fedcli.datasets.yours.trust import allow_code, recorded_code, same_reference

    data = stored.get("data")
    record = resolved.get("data")
    sha = record.get("source_sha256") if isinstance(record, Mapping) else None
    code = recorded_code(data if isinstance(data, Mapping) else None, data_sha256=sha)
    out = dict(overrides)
    named = []
    for key, kind in (("data.model", "model"), ("data.file", "data function")):
        given = out.get(key)
        if isinstance(given, str) and any(c.what == kind and same_reference(c, given) for c in code):
            named.append(given)
            del out[key]  # the same code: no change to the run
    flags = " ".join(f"--{'model' if c.what == 'model' else 'data'} {c.ref}" for c in code)
    allow_code(
        code,
        source=f"run {run_id[:8]}'s stored config",
        named=named,
        trust=trust,
        fix=fix or f"name it again ({flags}) or pass --trust-code (Python: trust_code=True) if you trust it",
    )
    return out


# --------------------------------------------------------------------------- process-wide state


@contextlib.contextmanager
def preserved_state() -> Iterator[None]:
    """Put back, on the way out (also after an exception), what a run changes in the process.

    Restored: the SIGINT/SIGTERM/SIGHUP handlers (main thread only), torch's intra-op thread
    count (`train.threads`), the TF32 flags (`train.precision`), the float32 matmul precision,
    the deterministic-algorithms switch and cuDNN's deterministic/benchmark flags, and the global
    RNG states of torch (CPU), numpy and `random` (the engine draws from its own streams;
    this keeps a caller's draws independent of how many runs it trained).
    """
    import threading

    import numpy as np
    import torch

    main = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {s: signal.getsignal(s) for s in stops} if main else {}
    threads = torch.get_num_threads()
    flags = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    matmul = torch.get_float32_matmul_precision()
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = flags
        if torch.get_float32_matmul_precision() != matmul:
            torch.set_float32_matmul_precision(matmul)
        # only when changed: in torch 2.14 the call imports torch._inductor, _dynamo and sympy (about 1 s)
        if (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ) != deterministic:
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


# --------------------------------------------------------------------------- one run


@dataclasses.dataclass
class PreparedRun:
    """A run validated and built, its store open: `run(progress)` trains it (engine/train.py)."""

    cfg: RunConfig
    setup: Setup
    tracker: Tracker
    signals: GracefulSignals
    resume_run_id: str | None = None
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def run_id(self) -> str | None:
        """The run's id once it exists in the store (None before `run` started it)."""
        return getattr(self.tracker, "_run_id", None)

    def run(self, progress: ProgressFn | None = None) -> RunResult:
        from fedcli.engine.train import train

        return train(
            self.cfg,
            tracker=self.tracker,
            progress=progress,
            resume_run_id=self.resume_run_id,
            setup=self.setup,
            signals=self.signals,
            **self.engine_kwargs,
        )


@contextlib.contextmanager
def prepared_run(
    cfg: RunConfig,
    *,
    resume_run_id: str | None = None,
    tracker: Tracker | None = None,
    parent_run: str | None = None,
    mlflow_optional: bool = False,
    signals: GracefulSignals | None = None,
    peers: Peers | None = None,
    on_run: Callable[[str], None] | None = None,
    data_cache: dict[tuple[Any, ...], Any] | None = None,
    **engine_kwargs: Any,
) -> Iterator[PreparedRun]:
    """Validate and build `cfg`'s run, open its store; on the way out close what was opened here.

    The order is the CLI's (docs/architecture.md §8, "Validation before anything is written"): MLflow
    is checked (`mlflow_optional`: dropped with a warning when unreachable), the run's mirror spawned
    (it imports MLflow while the data loads), the data, model and back end built; only then is the
    store opened. A stop signal during that set-up raises `StoppedBeforeStart`; afterwards signals
    are recorded and stop the run at its next safe point (`RunInterrupted`). `tracker`: the caller's
    (e.g. a sweep worker's, with one mirror per sweep); it is used as it is and not closed. Runs
    under `preserved_state()`. `data_cache`: the caller's task data kept across runs (a sweep
    worker's; `fedcli.engine.setup.load_data`).

    Raises:
        ConfigError, DataError, TrackingError: invalid input; nothing was written.
        StoppedBeforeStart: a stop signal during the set-up; nothing was written.
    """
    from fedcli.engine.lifecycle import GracefulSignals
    from fedcli.engine.setup import build
    from fedcli.runs.stores import check_mlflow, open_tracker, spawn_mirror

    with preserved_state(), contextlib.ExitStack() as cleanup:
        if signals is None:
            signals = GracefulSignals(
                immediate=True
            )  # the set-up writes nothing: a signal there stops it at once
            signals.install()
            cleanup.callback(signals.restore)
        mirror: MirrorHandle | None = None
        try:
            if tracker is None:
                cfg = dataclasses.replace(cfg, tracking=check_mlflow(cfg.tracking, mlflow_optional))
                mirror = spawn_mirror(cfg.tracking, parent_run)
                if mirror is not None:
                    cleanup.callback(mirror.abort)  # a mirror that was never finished ends with the call
                    held = signals
                    mirror.stopping = lambda: (
                        held.pending is not None
                    )  # a stop cuts the waits for MLflow short
            setup = build(cfg, peers=peers, data_cache=data_cache)
            signals.defer()  # the store is written from here on: a signal stops the run at its next safe point
        except BaseException:
            if (
                signals.pending is not None
            ):  # whatever the signal surfaced as (RunInterrupted, a library's error)
                raise StoppedBeforeStart(signals.pending) from None
            raise
        if tracker is None:
            tracker = open_tracker(cfg.tracking, mirror)
            cleanup.callback(tracker.store.close)
        if on_run is not None:
            tracker.on_run = on_run
        yield PreparedRun(cfg, setup, tracker, signals, resume_run_id, engine_kwargs)


def run_config(
    cfg: RunConfig,
    *,
    resume_run_id: str | None = None,
    tracker: Tracker | None = None,
    parent_run: str | None = None,
    mlflow_optional: bool = False,
    progress: ProgressFn | None = None,
    signals: GracefulSignals | None = None,
    peers: Peers | None = None,
    on_run: Callable[[str], None] | None = None,
    data_cache: dict[tuple[Any, ...], Any] | None = None,
    **engine_kwargs: Any,
) -> RunResult:
    """Train `cfg`'s run (or resume `resume_run_id`) to its end in this process; return its result.

    `prepared_run` then `PreparedRun.run`: the contract of docs/python-api.md, "Many runs in one
    process". `engine_kwargs` go to `fedcli.engine.train.train`.

    Raises:
        ConfigError, DataError, TrackingError: invalid input; nothing was written.
        StoppedBeforeStart: a stop signal during the set-up; nothing was written.
        RunInterrupted: a stop signal after the run started; it is `interrupted` and checkpointed.
        DivergenceError: a metric became non-finite; the run is `failed`.
    """
    with prepared_run(
        cfg,
        resume_run_id=resume_run_id,
        tracker=tracker,
        parent_run=parent_run,
        mlflow_optional=mlflow_optional,
        signals=signals,
        peers=peers,
        on_run=on_run,
        data_cache=data_cache,
        **engine_kwargs,
    ) as prepared:
        return prepared.run(progress)
