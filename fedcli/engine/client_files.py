"""The client states of a format-3 checkpoint as read back: `StoredClientStates` reads the
`.clients.npy` files a checkpoint's manifest names, a client at a time (engine/checkpoint.py has
the format; engine/checkpoint_writer.py writes them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.engine.slots import SlotLayout
from fedcli.errors import CheckpointError


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
