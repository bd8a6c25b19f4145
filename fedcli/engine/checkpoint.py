"""Atomic checkpoints: server state + client states + round + resolved config.

Written to a temporary file in the same folder and renamed over the target, so a crash
or kill never leaves a half-written checkpoint; a temporary file left by a kill during a
write is removed when the run starts or resumes. Tensors are saved on CPU so a
checkpoint written on a GPU loads anywhere.

Files never run code (docs/architecture.md, "Security"). Checkpoints and `model.pt` hold
tensors in plain containers only (dicts, lists, tuples, numbers, strings): an algorithm's
NamedTuple (or dataclass) states are written as `{TYPE_KEY: name, "fields": {...}}`
(`to_plain`) and rebuilt on load from the types of the run's own freshly built state
(`from_plain`), never from a name in the file. Everything is read with
`torch.load(weights_only=True)`, which refuses any other pickled object; a file that needs
more is refused with one line (`CheckpointError`). Files of format 1 (fedcli before
checkpoint format 2 pickled the NamedTuples) still load: their only non-plain objects may
be the run's own state NamedTuples, which are allowed for that load and cannot run code.

A checkpoint also says whose it is: run id, round and config hash, checked against the
store's row before it is used (`check_identity`); one that does not match is skipped like
an unreadable one (docs/architecture.md, "Checkpoints").

`CheckpointWriter` is what the round loop uses (docs/architecture.md, "Checkpoints"):
checkpoints are on by default, written on a background thread from a snapshot taken
between rounds, kept `keep` at a time (older files and rows are pruned), and in the
default `auto` cadence written after every round unless writing one takes longer than
`AUTO_BUDGET` of a round, in which case they are spaced so that they cost about that.

Format 3 (the current format) is incremental: `round-NNNNNN.pt` holds the server state
and a manifest (`client_index`: client -> (file, row) for every client with a state, and the
slot layout), and the client states changed since the previous checkpoint go to
`round-NNNNNN.clients.npy` beside it (a numpy array of [changed clients, slot bytes], the
slots of engine/clientstate.py; read with `allow_pickle=False` and `os.pread`, never run).
A checkpoint thus writes O(cohort x rounds since the last one) bytes, not O(clients visited).
A checkpoint also rewrites the live states of the most superseded files when the files hold
more than twice the live states, so that they stay within that (compaction:
`ClientStateStore._to_compact`, docs/scaling.md "Client state").
The `.clients.npy` file is written (temp file, fsync, rename) before the `.pt` that names it,
so a `.pt` in place always has its files; a file no kept checkpoint names is deleted when the
old checkpoints are pruned. Formats 1 and 2 (every client state in the `.pt`) still load.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.engine.clientstate import ClientDelta, SlotLayout, SpilledSlot, delta_file_name
from fedcli.errors import DataError, TrackingError

log = logging.getLogger(__name__)

AUTO_BUDGET = 0.03  # auto cadence: checkpoint writing may take up to 3 % of the rounds' time
TEMP_PREFIX = "."  # atomic_save's temporary files: .<name>.<random>

FORMAT_VERSION = 3  # 3: incremental client states (a manifest + .clients.npy files); 2 (read only): plain
# containers, run id and config hash, every client state in the file; 1 (read only): pickled state NamedTuples
LEGACY_FORMAT = 2  # `checkpoint_payload`'s form (every client state in one file), still read
FORMATS = (1, 2, 3)
TYPE_KEY = "__fedcli_type__"  # to_plain's marker of a NamedTuple or dataclass node
CHECKPOINT_KEYS = ("format_version", "round_idx", "seed", "config", "server_state", "client_states")
CHECKPOINT_KEYS_V3 = ("format_version", "round_idx", "seed", "config", "server_state", "client_index")
MODEL_KEYS = ("params", "server_state", "config", "task", "algorithm", "model")


class CheckpointError(DataError):
    """A checkpoint or model file fedcli will not use: unreadable, needing code to load, or another
    run's or round's. The message is one line naming the file and the reason."""


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
    return _atomic_write(path, lambda fh: fh.write(buffer.getbuffer()))


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> int:
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
        "server_state": pytree.tree_map(_cpu_copy, server_state),
        "client_states": dict(client_states),
    }


def plain_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with its states in plain containers (`to_plain`), ready for `atomic_save`."""
    return {
        **payload,
        "server_state": to_plain(payload["server_state"]),
        "client_states": {int(k): to_plain(v) for k, v in payload["client_states"].items()},
    }


def to_plain(tree: Any) -> Any:
    """A state pytree as tensors in dicts, lists and tuples: what `torch.load(weights_only=True)` reads.

    A NamedTuple or dataclass node becomes `{TYPE_KEY: "module.QualName", "fields": {name: value}}`.

    Raises:
        TypeError: the state holds another kind of object (docs/style.md rule 6: states are
            NamedTuples of tensors and Params).
    """
    if tree is None or isinstance(tree, (torch.Tensor, bool, int, float, str)):
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        fields = zip(tree._fields, tree, strict=True)  # type: ignore[attr-defined]  # a NamedTuple
        return {TYPE_KEY: _type_name(type(tree)), "fields": {k: to_plain(v) for k, v in fields}}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return {
            TYPE_KEY: _type_name(type(tree)),
            "fields": {f.name: to_plain(getattr(tree, f.name)) for f in dataclasses.fields(tree) if f.init},
        }
    if isinstance(tree, dict):
        return {k: to_plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_plain(v) for v in tree)
    raise TypeError(
        f"a checkpointed state holds a {type(tree).__name__}; states must be tensors in NamedTuples, "
        "dataclasses, dicts, lists and tuples (docs/style.md rule 6)"
    )


def from_plain(plain: Any, template: Any, what: str) -> Any:
    """Rebuild a state `to_plain` wrote, with the node types of `template` (the run's own fresh state).

    The result must have the template's structure and its tensors the template's shapes and
    dtypes: a file of another algorithm, model or data set is refused, not half-used.

    Raises:
        CheckpointError: a type the template does not have, or another structure or shape.
    """
    types = _node_types(template)

    def build(node: Any) -> Any:
        if isinstance(node, dict) and TYPE_KEY in node:
            cls = types.get(str(node[TYPE_KEY]))
            if cls is None or not isinstance(node.get("fields"), dict):
                raise CheckpointError(
                    f"{what} holds a state of type {node[TYPE_KEY]!r}, which this run's algorithm "
                    "does not have; it is another algorithm's file"
                )
            try:
                return cls(**{k: build(v) for k, v in node["fields"].items()})
            except TypeError as err:
                raise CheckpointError(f"{what} does not fit this run's state ({err})") from None
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(build(v) for v in node)
        return node

    tree = build(plain)
    check_like(tree, template, what)
    return tree


def check_like(tree: Any, template: Any, what: str) -> None:
    """Raise CheckpointError unless `tree` has the structure of `template` and tensors of its shapes and dtypes."""
    leaves, spec = pytree.tree_flatten(tree)
    expected, expected_spec = pytree.tree_flatten(template)
    if spec != expected_spec:
        raise CheckpointError(
            f"{what} does not fit this run's state (another structure: another algorithm, "
            "model or fedcli version)"
        )
    for leaf, want in zip(leaves, expected, strict=True):
        if isinstance(want, torch.Tensor) and (
            not isinstance(leaf, torch.Tensor) or leaf.shape != want.shape or leaf.dtype != want.dtype
        ):
            got = (
                f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            )
            raise CheckpointError(
                f"{what} does not fit this run's state (a tensor of {got} where the run has "
                f"{tuple(want.shape)} {want.dtype})"
            )


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


def named_tuple_types(*templates: Any) -> tuple[type, ...]:
    """The NamedTuple types in the given state pytrees (what a format-1 file of the run may hold)."""
    found: dict[str, type] = {}
    for template in templates:
        found.update({k: v for k, v in _node_types(template).items() if issubclass(v, tuple)})
    return tuple(found.values())


def _node_types(tree: Any) -> dict[str, type]:
    """module.QualName -> type of every NamedTuple and dataclass node in a state pytree."""
    found: dict[str, type] = {}

    def visit(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            found[_type_name(type(node))] = type(node)
            for value in node:
                visit(value)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            found[_type_name(type(node))] = type(node)
            for f in dataclasses.fields(node):
                visit(getattr(node, f.name))
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(tree)
    return found


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def checkpoint_path(run_dir: Path, round_idx: int) -> Path:
    return run_dir / "checkpoints" / f"round-{round_idx:06d}.pt"


def remove_temp_files(folder: Path) -> int:
    """Delete temporary files a killed write left in `folder`; return how many."""
    if not folder.is_dir():
        return 0
    removed = 0
    for pattern in (f"{TEMP_PREFIX}*.pt.*", f"{TEMP_PREFIX}*.clients.npy.*"):
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class StoredClientStates:
    """The client states of a format-3 checkpoint: client -> (file, row) in its `.clients.npy` files.

    `items()` reads them one by one (a client's slot with `os.pread`; nothing is unpickled or
    mapped) and yields (client, state in the run's own dtypes); `raw_items()` yields the slots.
    """

    def __init__(
        self,
        folder: Path,
        index: dict[int, tuple[str, int]],
        layout: SlotLayout | None,
        offsets: dict[str, int],
        what: str,
    ) -> None:
        self.folder, self.index, self.layout, self._offsets, self._what = folder, index, layout, offsets, what

    @classmethod
    def of(cls, folder: Path, manifest: Any, template: Any, what: str) -> StoredClientStates:
        """Check a manifest against the run's state (`template`) and its files' headers.

        Raises:
            CheckpointError: a malformed manifest, another layout, a missing or short file.
        """
        try:
            files = [str(f) for f in manifest["files"]]
            clients = manifest["clients"].tolist()
            file_of, rows = manifest["file"].tolist(), manifest["row"].tolist()
            layout_written = manifest["layout"]
            index = {int(c): (files[f], int(r)) for c, f, r in zip(clients, file_of, rows, strict=True)}
        except (KeyError, TypeError, AttributeError, IndexError, ValueError):
            raise CheckpointError(f"{what} holds no readable client-state manifest") from None
        if not index:
            return cls(folder, {}, None, {}, what)
        if template is None:
            raise CheckpointError(
                f"{what} does not fit this run's state (client states of a stateful algorithm)"
            )
        try:
            layout = SlotLayout(template, str(layout_written.get("precision")))
        except Exception:  # noqa: BLE001 - an unknown precision name, a template of non-tensors
            raise CheckpointError(f"{what} does not fit this run's state (client-state layout)") from None
        if layout.describe() != layout_written:
            raise CheckpointError(
                f"{what} does not fit this run's state (its client states have another layout: "
                "another algorithm, model or state precision)"
            )
        offsets: dict[str, int] = {}
        needed: dict[str, int] = {}
        for name, row in index.values():
            needed[name] = max(needed.get(name, 0), row + 1)
        for name, rows_needed in needed.items():
            if Path(name).name != name or not name.endswith(".clients.npy"):
                raise CheckpointError(f"{what} names a client-state file {name!r} outside its folder")
            offsets[name] = _npy_offset(folder / name, rows_needed, layout.slot_bytes, what)
        return cls(folder, index, layout, offsets, what)

    def __len__(self) -> int:
        return len(self.index)

    def raw_items(self) -> Any:
        """(client, slot bytes) for every client, file by file."""
        assert self.layout is not None or not self.index
        by_file: dict[str, list[tuple[int, int]]] = {}
        for client, (name, row) in self.index.items():
            by_file.setdefault(name, []).append((row, client))
        for name, rows in sorted(by_file.items()):
            path = self.folder / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise CheckpointError(f"{self._what}: cannot read {path}: {err.strerror or err}") from None
            try:
                size = self.layout.slot_bytes if self.layout else 0
                for row, client in sorted(rows):
                    buffer = np.empty(size, dtype=np.uint8)
                    if os.preadv(fd, [buffer.data], self._offsets[name] + row * size) != size:
                        raise CheckpointError(f"{self._what}: {path} is shorter than its manifest says")
                    yield client, buffer
            finally:
                os.close(fd)

    def items(self) -> Any:
        """(client, state in the run's own dtypes) for every client."""
        for client, buffer in self.raw_items():
            assert self.layout is not None
            yield client, self.layout.widen(self.layout.unpack(buffer))

    def to_dict(self) -> dict[int, Any]:
        return dict(self.items())


def _npy_offset(path: Path, rows: int, slot_bytes: int, what: str) -> int:
    """Where the data of a `.clients.npy` file start; CheckpointError unless it is [>= rows, slot_bytes] uint8."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            offset = fh.tell()
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise CheckpointError(f"{what} needs {path}, which is missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{what}: {path} is not a readable client-state file ({err})") from None
    if (
        dtype != np.uint8
        or fortran
        or len(shape) != 2
        or shape[1] != slot_bytes
        or shape[0] < rows
        or size < offset + shape[0] * slot_bytes
    ):
        raise CheckpointError(
            f"{what}: {path} does not hold the client states its manifest names (shape {shape}, {size} bytes)"
        )
    return int(offset)


def write_delta(path: Path, delta: ClientDelta) -> int:
    """Write `delta`'s states as a [clients, slot bytes] uint8 .npy file, atomically; return its size.

    Streamed one slot at a time (no copy of the whole delta in memory), to a temp file that is
    fsynced and renamed over `path`; any failure removes the temp file and leaves `path` as it was.

    Raises:
        TrackingError: the file could not be written (a full disk says "no space left on device").
    """
    assert delta.layout is not None
    layout = delta.layout

    def write(fh: BinaryIO) -> None:
        np.lib.format.write_array_header_1_0(
            fh,
            {
                "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                "fortran_order": False,
                "shape": (len(delta.clients), layout.slot_bytes),
            },
        )
        for state in delta.states:
            if isinstance(state, SpilledSlot):
                slot = state.read()
            else:
                slot = state if isinstance(state, np.ndarray) else layout.pack(state)
            fh.write(slot.data)

    return _atomic_write(path, write)


def manifest_of(delta: ClientDelta) -> dict[str, Any]:
    """A delta's `index` as a format-3 checkpoint stores it: tensors and plain values only."""
    files = sorted({name for name, _ in delta.index.values()})
    number = {name: i for i, name in enumerate(files)}
    clients = sorted(delta.index)
    return {
        "files": files,
        "clients": torch.tensor(clients, dtype=torch.int64),
        "file": torch.tensor([number[delta.index[c][0]] for c in clients], dtype=torch.int32),
        "row": torch.tensor([delta.index[c][1] for c in clients], dtype=torch.int64),
        "layout": delta.layout.describe() if delta.layout is not None else {},
    }


class CheckpointWriter:
    """Write a run's checkpoints in the background, with a cadence and a retention.

    Args:
        run_dir: The run's folder; checkpoints go to `run_dir/checkpoints/round-NNNNNN.pt`.
        record: Called on the writer thread after a file is in place, with (round, path),
            to record it in the store; `forget` likewise with the rounds pruned.
        every: Rounds between checkpoints; None = auto (see the module docstring); 0 = off
            (the run then resumes from its last recorded checkpoint, or from round 0).
        keep: How many of the newest checkpoints to keep (>= 1).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        record: Callable[[int, str], None],
        forget: Callable[[list[int]], None],
        existing: list[tuple[int, str]],
        every: int | None,
        keep: int,
    ) -> None:
        self.folder = run_dir / "checkpoints"
        self.every, self.keep = every, max(1, keep)
        self._record, self._forget = record, forget
        self._kept = [round_idx for round_idx, _ in existing]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcli-checkpoint")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._write_s: float | None = None  # seconds of the last write (auto cadence)
        self._round_s = 0.0  # mean wall seconds of a round (kept for reference; the cadence uses medians)
        self._rounds_seen = 0
        self._writes: deque[float] = deque(maxlen=self.WRITES_WINDOW)  # recent write times (auto cadence)
        self._rounds: deque[float] = deque(maxlen=self.ROUNDS_WINDOW)  # recent round times (auto cadence)
        self._sampled: float | None = None  # the `_write_s` object last put in `_writes`
        self._since = 0  # rounds since the last checkpoint
        self.last_round: int | None = max(self._kept) if self._kept else None
        self._files: dict[int, set[str]] = {}  # round -> the .clients.npy files its manifest names
        self.bytes_written: dict[int, int] = {}  # round -> bytes its checkpoint wrote (.pt + .clients.npy)
        if removed := remove_temp_files(self.folder):
            log.info("removed %d temporary checkpoint file(s) left by a killed write", removed)

    WRITES_WINDOW = 5  # auto cadence: the median of the last 5 write times ...
    ROUNDS_WINDOW = 25  # ... over AUTO_BUDGET x the median of the last 25 round times
    MAX_GAP_S = 600.0  # auto cadence: at most this many seconds of rounds between two checkpoints

    @property
    def interval(self) -> int:
        """Rounds between checkpoints now (auto: from the measured write and round times).

        Auto: ceil(median recent write / (AUTO_BUDGET x median recent round)), at least 1 and at
        most the rounds of `MAX_GAP_S` seconds. Medians (the lower one for an even count), not
        means, so one outlier cannot switch checkpoints off: a write that stalled for minutes (the
        process stopped, the store locked) counts as one sample of five; and the cap makes the
        next write, which measures again, come even when the stalled one was the first.
        """
        if self.every is not None:
            return self.every
        if not self._writes or not self._rounds:
            return 1
        write_s, round_s = _lower_median(self._writes), _lower_median(self._rounds)
        if round_s <= 0:
            return 1
        most = max(1, int(self.MAX_GAP_S / round_s))
        return max(1, min(most, math.ceil(write_s / (AUTO_BUDGET * round_s))))

    def due(self, round_idx: int, round_s: float) -> bool:
        """Account one finished round (`round_s`: its wall seconds); True when it should be checkpointed."""
        self._rounds_seen += 1
        self._round_s += (round_s - self._round_s) / self._rounds_seen
        self._rounds.append(round_s)
        written = self._write_s  # set by the writer thread; each write stores a new float object
        if written is not None and written is not self._sampled:
            self._writes.append(written)
            self._sampled = written
        self._since += 1
        return self.every != 0 and self._since >= self.interval

    def submit(
        self,
        round_idx: int,
        state: Any,
        client_states: ClientDelta | dict[int, Any],
        config: dict[str, Any],
        seed: int,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Snapshot the state now; write it on the background thread (after the previous write).

        `client_states`: what changed since the previous checkpoint (ClientStateStore.take_changes),
        or a dict of every client's state (then all are written). `buffers`: the global model's
        BatchNorm running statistics (train.bn_stats aggregate), saved beside the server state
        under "buffers" (a file without them, written before, still loads: `load_checkpoint`).
        """
        self.wait()  # at most one write in flight: memory stays bounded, errors surface a round later
        delta = (
            client_states
            if isinstance(client_states, ClientDelta)
            else ClientDelta.of_all(client_states, delta_file_name(round_idx))
        )
        from fedcli.config.sections import config_hash_of

        snapshot = {
            "format_version": FORMAT_VERSION,
            "round_idx": round_idx,
            "seed": seed,
            "run_id": self.folder.parent.name,  # runs/<id>/
            "config_hash": config_hash_of(config),
            "config": config,
            "server_state": pytree.tree_map(_cpu_copy, state),
        }
        if buffers is not None:
            snapshot["buffers"] = {k: _cpu_copy(v) for k, v in buffers.items()}
        self._since = 0
        self.last_round = round_idx
        self._pending = self._pool.submit(self._write, round_idx, snapshot, delta)

    def _write(self, round_idx: int, snapshot: dict[str, Any], delta: ClientDelta) -> None:
        start = time.perf_counter()
        path = checkpoint_path(self.folder.parent, round_idx)
        written = 0
        if delta.clients:  # the changed states first: a .pt in place always has its files
            try:
                written += write_delta(self.folder / delta.file, delta)
            finally:
                for spill in {s.path for s in delta.states if isinstance(s, SpilledSlot)}:
                    spill.unlink(missing_ok=True)
        manifest = manifest_of(delta)
        payload = {**snapshot, "server_state": to_plain(snapshot["server_state"]), "client_index": manifest}
        written += atomic_save(payload, path)
        self._record(round_idx, str(path.resolve()))
        self._write_s = time.perf_counter() - start
        self.bytes_written[round_idx] = written
        log.debug(
            "checkpoint of round %d: %d bytes (%d client states)", round_idx, written, len(delta.clients)
        )
        with self._lock:
            self._files[round_idx] = set(manifest["files"])
            self._kept = sorted(set(self._kept) | {round_idx})
            old, self._kept = self._kept[: -self.keep], self._kept[-self.keep :]
        if old:
            self._forget(old)
            for stale in old:
                checkpoint_path(self.folder.parent, stale).unlink(missing_ok=True)
                self._files.pop(stale, None)
            self._remove_unnamed_files()

    def _remove_unnamed_files(self) -> None:
        """Delete the .clients.npy files no kept checkpoint names (format 3 manifests)."""
        named: set[str] = set()
        for round_idx in self._kept:
            if round_idx not in self._files:  # a checkpoint of an earlier process: read its manifest
                try:
                    payload = read_file(checkpoint_path(self.folder.parent, round_idx), "a kept checkpoint")
                    self._files[round_idx] = {
                        str(f) for f in (payload.get("client_index") or {}).get("files", [])
                    }
                except CheckpointError:
                    self._files[round_idx] = set()
            named |= self._files[round_idx]
        for path in self.folder.glob("round-*.clients.npy"):
            if path.name not in named:
                path.unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until the write in flight is done; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def _lower_median(values: Any) -> float:
    """The median of a non-empty collection of numbers; the lower middle value for an even count."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


def _cpu_copy(t: Any) -> Any:
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
