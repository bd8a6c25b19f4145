"""Write a federation in the publishers' layouts: TFF h5 files and LEAF JSON folders.

Clients are generated and written `BATCH` at a time, each batch from its own seed
(`[seed, split, first client]`), with a progress bar; every file is written under a
`.partial` name and renamed when complete, so a killed run leaves no half-written file.
Used by datasets/formats/generate.py, which makes the clients' content.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 2048  # clients generated (and written) together


# ----------------------------------------------------------------------------- progress


@contextlib.contextmanager
def progress(total: int, label: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over clients on stderr (silent with quiet=True or when stderr is not a TTY); yields
    advance(n)."""
    if quiet:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


# ----------------------------------------------------------------------------- TFF h5


def _put(group: Any, name: str, value: np.ndarray | list[bytes]) -> None:
    import h5py

    if isinstance(value, list):  # variable-length UTF-8 byte strings, as TFF stores text
        group.create_dataset(name, data=np.array(value, dtype=object), dtype=h5py.string_dtype("utf-8"))
    else:
        group.create_dataset(name, data=value)


def write_tff(
    out: Path,
    files: dict[str, np.ndarray],
    ids: list[str],
    make: Callable[[np.random.Generator, np.ndarray], list[dict[str, Any]]],
    seed: int,
    quiet: bool,
) -> None:
    """One h5 file per split name: files maps file name -> per-client counts (0 = client absent)."""
    import h5py

    out.mkdir(parents=True, exist_ok=True)
    for split, (name, counts) in enumerate(files.items()):
        tmp = out / f".{name}.partial"
        # libver="latest": new-style groups index their links in a B-tree, so 342k clients stay fast
        with progress(len(ids), f"{name}", quiet) as advance, h5py.File(tmp, "w", libver="latest") as h5:
            examples = h5.create_group("examples")
            for a in range(0, len(ids), BATCH):
                b = min(len(ids), a + BATCH)
                rng = np.random.default_rng([seed, split, a])
                present = [k for k in range(a, b) if counts[k] > 0]
                for k, fields in zip(present, make(rng, counts[present]), strict=True):
                    group = examples.create_group(ids[k])
                    for field, value in fields.items():
                        _put(group, field, value)
                advance(b - a)
        tmp.replace(out / name)  # a killed run leaves only the .partial file


# ----------------------------------------------------------------------------- LEAF JSON

LEAF_USERS_PER_FILE = 1000


def write_leaf(
    out: Path,
    ids: list[str],
    splits: dict[str, np.ndarray],
    make_user: Callable[[np.random.Generator, np.ndarray], list[tuple[bytes, bytes]]],
    seed: int,
    quiet: bool,
    stem: str,
) -> None:
    """LEAF folders out/train, out/test: files of up to 1,000 users; x/y JSON text from make_user."""
    for split, (name, counts) in enumerate(splits.items()):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        with progress(len(ids), f"{stem} {name}", quiet) as advance:
            for f, a in enumerate(range(0, len(ids), LEAF_USERS_PER_FILE)):
                b = min(len(ids), a + LEAF_USERS_PER_FILE)
                users = [k for k in range(a, b) if counts[k] > 0]
                path = folder / f"all_data_{f}_niid_0_keep_0_{name}_9.json"
                tmp = folder / f".{path.name}.partial"
                rng = np.random.default_rng([seed, split, a])
                with tmp.open("wb") as fh:
                    fh.write(b'{"users": ' + json.dumps([ids[k] for k in users]).encode())
                    fh.write(b', "num_samples": ' + json.dumps([int(counts[k]) for k in users]).encode())
                    fh.write(b', "user_data": {')
                    for i, ((x, y), k) in enumerate(zip(make_user(rng, counts[users]), users, strict=True)):
                        fh.write(
                            (b", " if i else b"")
                            + json.dumps(ids[k]).encode()
                            + b': {"x": '
                            + x
                            + b', "y": '
                            + y
                            + b"}"
                        )
                    fh.write(b"}}")
                tmp.replace(path)
                advance(b - a)
