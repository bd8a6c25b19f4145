"""A run's life (docs/operations.md, "Run lifecycle"): start or resume it, train its rounds
(engine/rounds.py) under stop signals, heartbeats and background checkpoints, save the model, end it.

    train(cfg, tracker)                                  rank 0, or the only process
        setup = build(cfg)                               engine/setup.py (the CLI builds it first)
        state = server_init(...) | _restore(checkpoint)  resume: the newest readable checkpoint
        start the run in the store (or resume it), heartbeat, CheckpointWriter
        RoundLoop(...).run(signals, progress)            engine/rounds.py
        save model.pt, mark finished                     failures: failed / interrupted (below)
    serve(peers)                                         ranks 1..K-1 of --executor distributed
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcli.algorithms.base import HyperparameterError
from fedcli.config.build import run_tags
from fedcli.config.sections import RunConfig
from fedcli.datasets.tasks import data_record
from fedcli.engine import checkpoint as ckpt
from fedcli.engine.backends.distributed import serve as serve_slices
from fedcli.engine.checkpoint_writer import CheckpointWriter
from fedcli.engine.client_files import StoredClientStates
from fedcli.engine.clientstate import ClientStateStore, make_store
from fedcli.engine.distributed import Peers
from fedcli.engine.evaluation import resolve_eval_sample
from fedcli.engine.lifecycle import GracefulSignals, Heartbeat, RunInterrupted, graceful_signals, signal_name
from fedcli.engine.model import final_buffers
from fedcli.engine.plain import to_plain
from fedcli.engine.rounds import CUMULATIVE, DivergenceError, EvalHook, ProgressFn, RoundLoop, Timing
from fedcli.engine.setup import Setup, build
from fedcli.errors import CheckpointError, ConfigError, FedcliError
from fedcli.tracking.store.common import RunTakenOver, StoreUnavailable
from fedcli.tracking.store.protocol import RunStore

if TYPE_CHECKING:
    from fedcli.tracking.sinks import Tracker

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_id: str
    status: str
    rounds_completed: int
    final_metrics: dict[str, float]
    model_path: Path | None
    executor: str  # the back end as summaries name it: "vmap", "vmap + graph", "process + compile"
    timing: Timing = field(default_factory=Timing)
    wall_s: float = 0.0


def train(
    cfg: RunConfig,
    *,
    tracker: Tracker,
    progress: ProgressFn | None = None,
    resume_run_id: str | None = None,
    setup: Setup | None = None,
    signals: GracefulSignals | None = None,
    on_eval: EvalHook | None = None,
) -> RunResult:
    """Run (or resume) one training run to completion, logging every round to `tracker`.

    `setup` is `build(cfg)` when the caller built it already (the CLI does, to validate the
    data and the options before it opens any store); `signals`, stop-signal handlers the
    caller installed already (the CLI does, before its set-up), else this installs its own.
    The run's life (docs/operations.md, "Run lifecycle"): a heartbeat while it trains;
    SIGINT/SIGTERM/SIGHUP stop it at the next safe point (between rounds, clients or cohort
    chunks), abandon the round in flight, checkpoint the last completed round and mark it
    `interrupted`; a signal after the last round lets it finish; checkpoints in the
    background with retention; any other failure marks it `failed`. `on_eval` (a sweep's pruning
    hook, fedcli.sweep.search.make_on_eval): called after each evaluation round but the last; when it
    returns True the run stops there, checkpointed, and ends `pruned` (docs/sweeps.md, "Pruning").

    Raises:
        ConfigError: invalid settings discovered against the data (before any round).
        DivergenceError: a metric became non-finite; the run is marked failed first.
        RunInterrupted: a signal stopped it (a KeyboardInterrupt); marked interrupted first.
    """
    wall_start = time.perf_counter()
    setup = setup or build(cfg)
    log.info("executor: %s (%s)", setup.backend.name, setup.executor_reason)
    try:
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    init_client_state = setup.alg.init_client_state
    init_fn = None if init_client_state is None else partial(init_client_state, setup.init_params, setup.hp)
    with graceful_signals(signals) as signals:
        run_id = start_tracking(tracker, cfg, setup) if resume_run_id is None else resume_run_id
        run_dir = Path(cfg.tracking.root) / "runs" / run_id
        # client states: in RAM, or in files under the run with a bounded cache (docs/architecture.md,
        # "Client-state store"); a resume starts the files afresh from the checkpoint
        store = make_store(
            init_fn,
            num_clients=setup.fed.num_clients,
            folder=run_dir / "client-state",
            kind=cfg.train.state_store,
            cache_mb=cfg.train.state_cache_mb,
            precision=cfg.train.state_precision,
        )
        start_round = 1
        if resume_run_id is not None:
            state, start_round = _restore(tracker, run_id, setup, state, store)
        if start_round == 1:
            _save_partition(run_dir, setup)
        heartbeat = Heartbeat(tracker.store, run_id)
        writer = CheckpointWriter(
            run_dir,
            record=tracker.checkpoint,
            forget=lambda rounds: tracker.store.delete_checkpoints(run_id, rounds),
            existing=tracker.store.checkpoints(run_id),
            every=cfg.train.checkpoint_every,
            keep=cfg.train.keep_checkpoints,
        )
        loop = RoundLoop(
            setup,
            tracker,
            store,
            writer,
            state,
            start_round - 1,
            Timing(),
            _cumulative(tracker.store, run_id, start_round - 1),
            on_eval=on_eval,
        )
        try:
            metrics = loop.run(signals, progress)
            model_path = _save_model(tracker, run_dir, setup, loop.state)
        except RunTakenOver:  # another process resumed the run: write nothing more, not even its end
            raise
        except StoreUnavailable as exc:  # locked or unreachable for FEDCLI_STORE_RETRY_S: stop, resumable
            _stop_without_store(tracker, exc)
            raise StoreUnavailable(
                f"{exc}. Run {run_id[:8]} stopped after round {loop.completed} and is "
                f"resumable: `fedcli train --resume {run_id[:8]}` once the store answers"
            ) from exc
        except KeyboardInterrupt as exc:
            loop.save_on_exit()
            reason = f"stopped by {exc.args[0] if exc.args else 'SIGINT'} during round {loop.completed + 1}"
            tracker.finish("interrupted", reason=reason)
            raise
        except DivergenceError as exc:
            if tracker.store.get_run(run_id).stored_status == "running":  # not yet marked (aggregate's check)
                tracker.finish("failed", reason=str(exc)[:500], diverged_at_round=loop.completed + 1)
            raise
        except (
            HyperparameterError
        ) as exc:  # an algorithm's math broke down mid-run (bayesadmm-full's VON solves)
            tracker.finish("failed", reason=str(exc)[:500], diverged_at_round=loop.completed + 1)
            raise DivergenceError(
                f"run diverged at round {loop.completed + 1}: {exc} The run is marked failed."
            ) from None
        except BaseException as exc:
            if signals.pending is None:
                tracker.finish("failed", reason=f"{type(exc).__name__}: {exc}"[:500])
                raise
            # a stop was asked and something failed on its way (a worker ended by the same signal)
            log.debug("stopping after %s: %s", type(exc).__name__, exc)
            loop.save_on_exit()
            stop = RunInterrupted(signals.pending)
            tracker.finish(
                "interrupted", reason=f"stopped by {stop.args[0]} during round {loop.completed + 1}"
            )
            raise stop from None
        finally:
            heartbeat.stop()
            with contextlib.suppress(Exception):
                writer.close()
            store.close(remove=True)  # the checkpoints hold the states; a resume rebuilds the files
            setup.backend.close()  # no worker process outlives its run
        status = "finished" if loop.pruned_at is None else "pruned"
        tracker.finish(status, reason=None if loop.pruned_at is None else f"pruned at round {loop.pruned_at}")
        if signals.pending is not None:  # a signal from here on (the MLflow wait) is recorded, not raised
            log.warning("%s arrived after the last round; the run %s", signal_name(signals.pending), status)
    return RunResult(
        run_id=run_id,
        status=status,
        rounds_completed=loop.completed,
        final_metrics=metrics,
        model_path=model_path,
        executor=setup.backend.name,
        timing=loop.timing,
        wall_s=time.perf_counter() - wall_start,
    )


def serve(peers: Peers) -> None:
    """Ranks 1..K-1 of `--executor distributed`: build each run rank 0 announces and train the slices it
    sends (engine/backends/distributed.py) until rank 0 says stop; they write nothing."""
    serve_slices(peers, build)


def _stop_without_store(tracker: Tracker, exc: StoreUnavailable) -> None:
    """Mark the run `interrupted` if the store answers within a few seconds (it just failed for a
    minute); otherwise leave it: its row reads `interrupted` once this process is gone."""
    tracker.store.retry_s = min(tracker.store.retry_s, 5.0)
    with contextlib.suppress(FedcliError):
        tracker.finish("interrupted", reason=f"store unreachable: {exc}"[:500])


def _cumulative(store: RunStore, run_id: str, completed: int) -> dict[str, float]:
    """The cumulative totals a resumed run continues from (its round `completed`)."""
    if completed <= 0:
        return {}
    frame = store.metrics_frame([run_id], keys=list(CUMULATIVE.values()))
    frame = frame[frame["round_idx"] == completed]
    return {str(k): float(v) for k, v in zip(frame["key"], frame["value"], strict=True)}


def start_tracking(tracker: Tracker, cfg: RunConfig, setup: Setup) -> str:
    """Start the run in the store and MLflow with the resolved config, tags and versions."""
    import fedcli

    return tracker.start(
        experiment=cfg.tracking.experiment,
        run_name=cfg.tracking.run_name,
        config=resolved_config(setup),
        requested=cfg.to_dict(),
        config_hash=cfg.config_hash,
        algo=cfg.algorithm.name,
        task=setup.task.name,
        seed=cfg.seed,
        dataset=setup.task.name,
        partitioner=cfg.partition.scheme,
        fedcli_version=fedcli.__version__,
        torch_version=torch.__version__,
        git_commit=git_commit(),
        tags={
            "fedcli.executor": setup.executor,
            "fedcli.device": str(setup.device),
            "fedcli.executor_reason": setup.executor_reason[:250],
            "fedcli.model": cfg.data.model or setup.task.default_model,
            "fedcli.config_hash": cfg.config_hash,
            **run_tags(cfg),
        },
    )


def resolved_config(setup: Setup) -> dict[str, Any]:
    """The run's config as it runs: every `auto`/None that the set-up decided, filled in.

    Stored as the run's config and logged as its MLflow params, so that two runs that differ
    only in what `auto` chose can be told apart; the request itself (what `--resume` and the
    config hash use) is stored beside it.
    """
    cfg = setup.cfg
    out = cfg.to_dict()
    out["data"]["model"] = cfg.data.model or setup.task.default_model
    out["data"].update(
        data_record(setup.task, setup.data)
    )  # its own name and fingerprint, never the default task (docs/your-data.md)
    out["train"].update(
        device=str(setup.device),
        executor=setup.executor,
        threads=torch.get_num_threads(),
        client_lr=setup.opt.client_lr,
        eval_sample=resolve_eval_sample(cfg.train.eval_sample, setup.task.name),  # 0 = whole split
    )
    if setup.model is not None and any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in setup.model.modules()
    ):
        out["train"]["bn_stats"] = (
            "estimate" if setup.fns.client_stats is None else cfg.train.bn_stats
        )  # as it runs
    if setup.partition is not None:
        out["partition"]["num_clients"] = len(setup.partition)
    spec = setup.partition_spec
    if cfg.partition.file is not None and spec is not None:  # the file fixes the scheme and its options
        for key in (
            "scheme",
            "alpha",
            "shards_per_client",
            "labels_per_client",
            "min_size",
            "balanced",
            "sigma",
            "size_alpha",
        ):
            if hasattr(spec, key):
                out["partition"][key] = getattr(spec, key)
    if setup.backend.processes is not None:  # process, distributed: the processes the cohort is spread over
        out["train"]["workers"] = setup.backend.processes
    return out


def git_commit() -> str | None:
    """Return the HEAD commit of the git checkout fedcli runs from, or None."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _save_partition(run_dir: Path, setup: Setup) -> None:
    """Keep the run's client partition beside it (and in MLflow) so reports and reruns can share it."""
    from fedcli.datasets.partition.files import save_partition

    if setup.partition is None or setup.partition_spec is None:
        return
    if setup.partition_spec.scheme == "natural" and setup.fed.store == "disk":
        # the source's own clients, already indexed by the disk store (named by its fingerprint); a JSON copy of
        # every index would be ~10 bytes an example (206 MB for 20,000 StackOverflow clients), all labels read
        log.info(
            "partition: the data's natural clients (%d), indexed by its disk store; no partition.json",
            len(setup.partition),
        )
        return
    path = run_dir / "partition.json"
    labels = (
        setup.data.y.numpy()
        if setup.task.kind in ("classification", "multilabel")
        else np.zeros(len(setup.data.y))
    )
    save_partition(
        path,
        setup.partition,
        spec=setup.partition_spec,
        dataset=setup.task.name,
        fingerprint=setup.data.fingerprint,
        labels=labels,
    )


def _save_model(tracker: Tracker, run_dir: Path, setup: Setup, state: Any) -> Path:
    path = run_dir / "model.pt"
    params = ckpt.to_cpu(setup.alg.global_params(state))
    ckpt.atomic_save(
        {
            "format_version": ckpt.FORMAT_VERSION,
            "run_id": tracker.run_id,
            "config_hash": setup.cfg.config_hash,
            "params": params,
            "server_state": to_plain(ckpt.to_cpu(state)),
            "config": setup.cfg.to_dict(),
            "task": setup.task.name,
            "algorithm": setup.alg.name,
            "model": setup.cfg.data.model or setup.task.default_model,
            "example": setup.data.x[:2].detach().cpu(),  # MLflow model signature (tracking/served.py)
            "buffers": final_buffers(setup.fns, setup.model, params),
        },
        path,
    )  # BatchNorm statistics or None
    tracker.store.set_run_fields(tracker.run_id, model_path=str(path.resolve()))
    return path


def _restore_stats(setup: Setup, buffers: dict[str, torch.Tensor] | None, what: str) -> None:
    """Set the global BatchNorm statistics the clients carry (train.bn_stats aggregate) from a checkpoint's."""
    carried = setup.fns.client_stats
    if carried is None:
        return
    if buffers is None:  # written before the clients carried them (the server estimated them then)
        log.warning(
            "%s holds no BatchNorm statistics; the resumed run starts them afresh (mean 0, variance 1)", what
        )
        return
    try:
        carried.load(buffers, what)
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def _restore(
    tracker: Tracker, run_id: str, setup: Setup, state: Any, store: ClientStateStore
) -> tuple[Any, int]:
    """Reopen run_id at its newest readable checkpoint (or at round 0 if it has none).

    Rows of later rounds are dropped (they are trained again, to the same values) and the
    stored config becomes the one this resume runs (e.g. more rounds). Returns (state, next round).
    """
    cfg, record = setup.cfg, tracker.store.get_run(run_id)
    stored = (record.config.get("data") or {}).get("fingerprint")
    if (
        stored and setup.data.fingerprint and stored != setup.data.fingerprint
    ):  # docs/your-data.md, "Names and fingerprints"
        raise ConfigError(
            f"run {run_id} trained on data with fingerprint {stored[:16]}; the data given now has "
            f"{setup.data.fingerprint[:16]}. Resume with the same data (file, function or object)."
        )
    client_template = (
        None
        if setup.alg.init_client_state is None
        else setup.alg.init_client_state(setup.init_params, setup.hp)
    )
    for round_idx, path in reversed(tracker.store.checkpoints(run_id)):
        extras: dict[str, Any] = {}
        try:  # read without running code, checked against the run's row and state (docs/operations.md, "Checkpoints")
            server_state, client_states = ckpt.load_checkpoint(
                Path(path),
                f"checkpoint of round {round_idx} ({path})",
                server_template=state,
                client_template=client_template,
                run_id=run_id,
                config_hash=record.config_hash,
                requested=record.requested,
                round_idx=round_idx,
                extras=extras,
            )
            if isinstance(client_states, StoredClientStates):  # format 3: the next checkpoint builds on it
                store.load_state_dict(client_states, index=client_states.index)
            else:
                store.load_state_dict(client_states)
            _restore_stats(setup, extras.get("buffers"), f"checkpoint of round {round_idx} ({path})")
        except CheckpointError as err:
            log.warning("%s; trying an older one", err)
            continue
        tracker.resume(
            run_id,
            from_round=round_idx,
            config=resolved_config(setup),
            config_hash=cfg.config_hash,
            requested=cfg.to_dict(),
        )
        return ckpt.to_device(server_state, setup.device), round_idx + 1
    log.warning("run %s has no checkpoint; it restarts from round 0 under the same id", run_id)
    tracker.resume(
        run_id,
        from_round=-1,
        config=resolved_config(setup),
        config_hash=cfg.config_hash,
        requested=cfg.to_dict(),
    )
    return state, 1
