"""Atomic checkpoints: server state + client states + round + resolved config.

Written to a temporary file in the same folder and renamed over the target, so a crash
or kill never leaves a half-written checkpoint; a temporary file left by a kill during a
write is removed when the run starts or resumes. Tensors are saved on CPU so a
checkpoint written on a GPU loads anywhere.

Files never run code (docs/operations.md, "Security"). Checkpoints and `model.pt` hold
tensors in plain containers only (dicts, lists, tuples, numbers, strings): an algorithm's
NamedTuple (or dataclass) states are written as `{TYPE_KEY: name, "fields": {...}}`
(engine/plain.py `to_plain`) and rebuilt on load from the types of the run's own freshly built state
(`from_plain`), never from a name in the file. Everything is read with
`torch.load(weights_only=True)`, which refuses any other pickled object; a file that needs
more is refused with one line (`CheckpointError`). Files of format 1 (fedcli before
checkpoint format 2 pickled the NamedTuples) still load: their only non-plain objects may
be the run's own state NamedTuples, which are allowed for that load and cannot run code.

A checkpoint also says whose it is: run id, round and config hash, checked against the
store's row before it is used (`check_identity`); one that does not match is skipped like
an unreadable one (docs/operations.md, "Checkpoints").

The writer the round loop uses is engine/checkpoint_writer.py; the plain-container form of
state pytrees is engine/plain.py.
Format 3 (the current format) is incremental: `round-NNNNNN.pt` holds the server state
and a manifest (`client_index`: client -> (file, row) for every client with a state, and the
slot layout), and the client states changed since the previous checkpoint go to
`round-NNNNNN.clients.npy` beside it (a numpy array of [changed clients, slot bytes], the
slots of engine/slots.py; read with `allow_pickle=False` and `os.pread`, never run).
A checkpoint thus writes O(cohort x rounds since the last one) bytes, not O(clients visited).
A checkpoint also rewrites the live states of the most superseded files when the files hold
more than twice the live states, so that they stay within that (compaction:
`ClientStateStore._to_compact`, docs/scaling.md "Client state").
The `.clients.npy` file is written (temp file, fsync, rename) before the `.pt` that names it,
so a `.pt` in place always has its files; a file no kept checkpoint names is deleted when the
old checkpoints are pruned. Formats 1 and 2 (every client state in the `.pt`) still load.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.utils import _pytree as pytree

from fedcli.engine.client_files import StoredClientStates
from fedcli.engine.plain import check_like, from_plain, named_tuple_types, to_plain
from fedcli.errors import CheckpointError, TrackingError

log = logging.getLogger(__name__)

TEMP_PREFIX = "."  # atomic_save's temporary files: .<name>.<random>

FORMAT_VERSION = 3  # 3: incremental client states (a manifest + .clients.npy files); 2 (read only): plain
# containers, run id and config hash, every client state in the file; 1 (read only): pickled state NamedTuples
LEGACY_FORMAT = 2  # `checkpoint_payload`'s form (every client state in one file), still read
FORMATS = (1, 2, 3)
CHECKPOINT_KEYS = ("format_version", "round_idx", "seed", "config", "server_state", "client_states")
CHECKPOINT_KEYS_V3 = ("format_version", "round_idx", "seed", "config", "server_state", "client_index")
MODEL_KEYS = ("params", "server_state", "config", "task", "algorithm", "model")


def to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def atomic_save(obj: Any, path: Path) -> int:
    """torch.save to a temp file beside `path`, fsync, then rename over `path`.

    The object is serialised in memory first and written with plain file writes, so a full
    disk is an `OSError(ENOSPC)` (torch's zip writer reports it as an opaque RuntimeError);
    any failure leaves `path` as it was and removes the temp file.

    Raises:
        TrackingError: the file could not be written (the message names the path and, for a
            full disk, says "no space left on device").
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write(path, lambda fh: fh.write(buffer.getbuffer()))


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> int:
    """`write(fh)` into a temp file beside `path`, fsync, rename over `path`; return the bytes written.

    Any failure removes the temp file and leaves `path` as it was; an OSError (a full disk) is a
    TrackingError naming the path.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", dir=path.parent)
    except OSError as err:
        raise TrackingError(_os_message(err, path)) from err
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
            size = fh.tell()
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise TrackingError(_os_message(err, path)) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def checkpoint_payload(
    *,
    round_idx: int,
    server_state: Any,
    client_states: dict[int, Any],
    config: dict[str, Any],
    seed: int,
    run_id: str,
) -> dict[str, Any]:
    """Everything needed to resume exactly after `round_idx`, as a snapshot on the CPU, in format 2
    (every client state in the one file: what fedcli wrote before format 3; kept to read and test
    those files). `CheckpointWriter` writes format 3.

    The server state is copied (the caller goes on to the next round); client states are
    taken as they are: the client-state store replaces them, never changes them in place.
    The states are still pytrees here; `plain_payload` makes the file's form of them.
    """
    from fedcli.config.sections import config_hash_of

    return {
        "format_version": LEGACY_FORMAT,
        "round_idx": round_idx,
        "seed": seed,
        "run_id": run_id,
        "config_hash": config_hash_of(config),
        "config": config,
        "server_state": pytree.tree_map(cpu_copy, server_state),
        "client_states": dict(client_states),
    }


def plain_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with its states in plain containers (`to_plain`), ready for `atomic_save`."""
    return {
        **payload,
        "server_state": to_plain(payload["server_state"]),
        "client_states": {int(k): to_plain(v) for k, v in payload["client_states"].items()},
    }


def read_file(path: Path, what: str, legacy_types: tuple[type, ...] = ()) -> dict[str, Any]:
    """`torch.load(path, weights_only=True)` onto the CPU, every failure one `CheckpointError` line.

    `legacy_types`: NamedTuple types a format-1 file may hold (the run's own state types; their
    construction runs no code). Nothing else beyond tensors and plain containers is accepted.
    """
    import pickle
    import re

    try:
        with torch.serialization.safe_globals(list(legacy_types)):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        named = f" ({found[1]})" if found else ""
        raise CheckpointError(
            f"{what} needs code to load: it holds a pickled object{named} besides tensors and "
            "plain containers, and fedcli never runs code from a file. If you wrote it and trust "
            f"it, convert it: python -m fedcli.engine.checkpoint --trust {path}"
        ) from None
    except OSError as err:
        raise CheckpointError(f"{what} cannot be read: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001 - torch reports a damaged file as RuntimeError, EOFError, ...
        first = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise CheckpointError(f"{what} is not a readable torch file ({first})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{what} holds a {type(payload).__name__}, not a fedcli checkpoint or model")
    return payload


def check_identity(
    payload: dict[str, Any],
    what: str,
    keys: tuple[str, ...],
    *,
    run_id: str,
    config_hash: str,
    requested: dict[str, Any] | None,
    round_idx: int | None = None,
) -> None:
    """Raise CheckpointError unless `payload` has `keys` and is the file of this run (and round).

    The config must hash to `config_hash` (the store row's) or differ from the row's
    `requested` config only in what `--resume` may change (fedcli.config.build.same_run_config):
    a checkpoint written before a resume that added rounds still fits. A format-1 file
    carries no run id and no hash; its round and config are checked.
    """
    from fedcli.config.build import same_run_config
    from fedcli.config.sections import config_hash_of

    missing = [k for k in keys if k not in payload]
    if missing:
        raise CheckpointError(
            f"{what} lacks {', '.join(map(repr, missing))}; it is not a complete fedcli file"
        )
    version = payload.get("format_version", 1)
    if version not in FORMATS:
        raise CheckpointError(
            f"{what} has format {version!r}; this fedcli reads formats 1 to {FORMAT_VERSION} (upgrade fedcli)"
        )
    if version >= 2 and payload.get("run_id") != run_id:
        raise CheckpointError(f"{what} belongs to run {str(payload.get('run_id'))[:8]}, not {run_id[:8]}")
    if round_idx is not None and payload.get("round_idx") != round_idx:
        raise CheckpointError(f"{what} holds round {payload.get('round_idx')!r}, not {round_idx}")
    config = payload.get("config")
    try:
        written = payload.get("config_hash") or config_hash_of(config)  # type: ignore[arg-type]
    except (AttributeError, KeyError, TypeError):
        raise CheckpointError(f"{what} holds no readable config") from None
    if written != config_hash and not (
        requested and isinstance(config, dict) and same_run_config(config, requested)
    ):
        raise CheckpointError(
            f"{what} was written under config hash {str(written)[:10]}, and run {run_id[:8]} has "
            f"{config_hash[:10]}; it is another configuration's file"
        )


def load_checkpoint(
    path: Path,
    what: str,
    *,
    server_template: Any,
    client_template: Any,
    run_id: str,
    config_hash: str,
    requested: dict[str, Any] | None,
    round_idx: int,
    extras: dict[str, Any] | None = None,
) -> tuple[Any, dict[int, Any] | StoredClientStates]:
    """Read, check and rebuild a checkpoint of `run_id` at `round_idx`: (server state, client states) on the CPU.

    Templates: the run's fresh `server_init` state and `init_client_state` (None: stateless).
    `extras`, when given, receives the file's "buffers" (the global BatchNorm statistics; None
    in a file written without them).
    The client states of a format-3 file are a `StoredClientStates` (read when iterated; its
    files are checked here); of older formats, a dict.

    Raises:
        CheckpointError: unreadable, needing code, another run's, round's or configuration's, or
            not fitting the run's state (one line; the resume skips such a checkpoint).
    """
    payload = read_file(path, what, named_tuple_types(server_template, client_template))
    v3 = payload.get("format_version", 1) == 3
    check_identity(
        payload,
        what,
        CHECKPOINT_KEYS_V3 if v3 else CHECKPOINT_KEYS,
        run_id=run_id,
        config_hash=config_hash,
        requested=requested,
        round_idx=round_idx,
    )
    if extras is not None:
        buffers = payload.get("buffers")
        if buffers is not None and not (
            isinstance(buffers, dict) and all(isinstance(v, torch.Tensor) for v in buffers.values())
        ):
            raise CheckpointError(f"{what} holds BatchNorm statistics that are not tensors by name")
        extras["buffers"] = buffers
    if v3:
        return (
            from_plain(payload["server_state"], server_template, what),
            StoredClientStates.of(Path(path).parent, payload["client_index"], client_template, what),
        )
    states = payload["client_states"]
    if not isinstance(states, dict) or (states and client_template is None):
        raise CheckpointError(f"{what} does not fit this run's state (client states of a stateful algorithm)")
    if payload.get("format_version", 1) == 1:  # the NamedTuples were unpickled as they were written
        check_like(payload["server_state"], server_template, what)
        for state in states.values():
            check_like(state, client_template, what)
        return payload["server_state"], {int(k): v for k, v in states.items()}
    return (
        from_plain(payload["server_state"], server_template, what),
        {int(k): from_plain(v, client_template, what) for k, v in states.items()},
    )


def load_model(path: Path, what: str, *, server_template: Any = None) -> dict[str, Any]:
    """Read a run's `model.pt` (`params`, `server_state`, `config`, `task`, `algorithm`, `model`, `example`).

    With `server_template` its server state is rebuilt into the run's state types (format 1
    files then load too); without, it stays in its plain form (the MLflow mirror needs the
    parameters only).

    Raises:
        CheckpointError: unreadable, needing code, incomplete, or not fitting the template.
    """
    legacy = named_tuple_types(server_template) if server_template is not None else ()
    payload = read_file(path, what, legacy)
    missing = [k for k in MODEL_KEYS if k not in payload]
    if missing or not isinstance(payload["params"], dict):
        raise CheckpointError(
            f"{what} lacks {', '.join(map(repr, missing or ['params']))}; it is not a complete "
            "fedcli model file"
        )
    if server_template is not None:
        state = payload["server_state"]
        if payload.get("format_version", 1) == 1:
            check_like(state, server_template, what)
        else:
            payload["server_state"] = from_plain(state, server_template, what)
    return payload


def convert_trusted(path: Path) -> str:
    """Rewrite a checkpoint or `model.pt` that needs code to load as format 2; return what was done.

    For files you trust only: this one load runs whatever the file holds (`weights_only=False`).
    The run id comes from the file or from its place, `<root>/runs/<id>/...`.
    """
    from fedcli.config.sections import config_hash_of

    payload = torch.load(
        path, map_location="cpu", weights_only=False
    )  # trusted by the caller: the one exception
    if not isinstance(payload, dict) or "server_state" not in payload or "config" not in payload:
        raise CheckpointError(f"{path} is not a fedcli checkpoint or model.pt (no server_state or config)")
    parts = Path(path).resolve().parts
    run_id = payload.get("run_id") or next(
        (parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "runs"), ""
    )
    out = {
        **payload,
        "format_version": LEGACY_FORMAT,
        "run_id": run_id,
        "config_hash": config_hash_of(payload["config"]),
        "server_state": to_plain(payload["server_state"]),
    }
    if "client_states" in payload:
        out["client_states"] = {int(k): to_plain(v) for k, v in payload["client_states"].items()}
    atomic_save(out, Path(path))
    return f"{path}: rewritten as format {LEGACY_FORMAT} (run {run_id[:8] or '?'}); it now loads without running code"


def checkpoint_path(run_dir: Path, round_idx: int) -> Path:
    return run_dir / "checkpoints" / f"round-{round_idx:06d}.pt"


def remove_temp_files(folder: Path) -> int:
    """Delete temporary files a killed write left in `folder`; return how many."""
    patterns = (f"{TEMP_PREFIX}*.pt.*", f"{TEMP_PREFIX}*.clients.npy.*")
    stale = [path for pattern in patterns for path in folder.glob(pattern)]  # none in a missing folder
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def cpu_copy(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().to("cpu", copy=True)


def _os_message(err: OSError, path: Path) -> str:
    import errno

    if err.errno == errno.ENOSPC:
        return (
            f"no space left on device: could not write {path}; free disk space, then resume "
            "with `fedcli train --resume RUN` (the previous checkpoint is intact)"
        )
    return f"could not write {path}: {err.strerror or err}; check the folder's permissions and free space"


def main(argv: list[str] | None = None) -> int:
    """`python -m fedcli.engine.checkpoint --trust FILE...`: convert trusted files (convert_trusted)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fedcli.engine.checkpoint",
        description="Rewrite checkpoints or model.pt files you trust so that they load "
        "without running code (format 2).",
    )
    parser.add_argument(
        "--trust",
        nargs="+",
        type=Path,
        required=True,
        metavar="FILE",
        help="files you wrote or trust: loading them once runs any code they hold",
    )
    args = parser.parse_args(argv)
    try:
        for path in args.trust:
            print(convert_trusted(path))
    except (CheckpointError, TrackingError, OSError, RuntimeError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
