"""Output files the user names, all or nothing (docs/style.md rule 13).

Output files (`partition --out`, `--plot`, `report --output`, `fedcli.report(output=...)`) are
checked before any work (`check_output`) and written through a temp file beside the target that is
renamed over it (`write_output`), so a rejected or failed command leaves nothing behind; an
OSError on them becomes a one-line ConfigError (`output_error`). Empty path values get the
messages of `EMPTY_PATH_MESSAGES` (`check_path_value`).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from fedcli.errors import ConfigError

# the line of an OSError on an output file by its errno (`output_error`); any other: "not writable"
OUTPUT_ERRORS = {
    errno.ENOSPC: "no space left on device: {path}; free some space or pass {flag} a path on another disk.",
    errno.EACCES: "permission denied: {path}; pass {flag} a path in a directory you can write.",
    errno.EPERM: "permission denied: {path}; pass {flag} a path in a directory you can write.",
    errno.EISDIR: "{flag} must be a file path; got {name!r}, which is a directory. Name a file inside it.",
    errno.ENOTDIR: "{flag} must be a path under a directory; got {name!r}: not a directory (a parent is a "
    "file). Pick another path.",
}


def output_error(path: Path, flag: str, exc: OSError) -> ConfigError:
    """The one-line ConfigError for an OSError on an output file the user named."""
    if exc.errno in OUTPUT_ERRORS:
        return ConfigError(OUTPUT_ERRORS[exc.errno].format(path=path, flag=flag, name=str(path)))
    why = "" if exc.errno == errno.ENOENT else f" ({exc.strerror or exc})"  # ENOENT here: /proc and the like
    return ConfigError(f"{path}: not writable{why}; pass {flag} a path in a writable directory.")


def check_output(path: Path | None, flag: str) -> None:
    """Fail now, before any work, when `path` cannot be written (nothing is left behind).

    A missing parent folder is fine (it is created on success); a directory at `path`, a
    file where a parent folder should be, or a parent that refuses a file is a ConfigError.
    """
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise output_error(path, flag, IsADirectoryError(errno.EISDIR, "Is a directory"))
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise output_error(path, flag, NotADirectoryError(errno.ENOTDIR, "Not a directory"))
    try:  # a real probe: os.access is wrong for root, read-only mounts and /proc
        handle, probe = tempfile.mkstemp(dir=ancestor, prefix=".fedcli-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise output_error(path, flag, exc) from None


@contextmanager
def all_or_nothing(*paths: Path | None) -> Iterator[None]:
    """On any error inside, remove those of `paths` and of their parent folders that did not exist before."""
    given = [Path(p) for p in paths if p is not None]
    new_files = [p for p in given if not p.exists()]
    new_dirs = sorted({a for p in given for a in p.parents if not a.exists()}, key=lambda d: -len(d.parts))
    try:
        yield
    except BaseException:
        for leftover in new_files:
            with suppress(OSError):
                leftover.unlink(missing_ok=True)
        for folder in new_dirs:  # deepest first; a folder something else wrote into stays
            with suppress(OSError):
                folder.rmdir()
        raise


@contextmanager
def staging_dir(output: Path, flag: str) -> Iterator[Path]:
    """A temp folder beside `output` for the files that go with it (report PNGs); always removed.

    Draw into it, then `publish` it: a failure half-way leaves no half-written file beside `output`.
    """
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.staging-"))
    except OSError as exc:
        raise output_error(output, flag, exc) from None
    try:
        yield folder
    except OSError as exc:
        raise output_error(output, flag, exc) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def publish(folder: Path, destination: Path, flag: str) -> None:
    """Move every file of a staging folder into `destination` (a rename on the same file system)."""
    for item in sorted(folder.iterdir()):
        try:
            os.replace(item, destination / item.name)
        except OSError as exc:
            raise output_error(destination / item.name, flag, exc) from None


def write_output(path: Path, data: str | bytes, flag: str) -> None:
    """Write `data` to `path` atomically (temp file beside it, then rename); ConfigError on OSError."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise output_error(path, flag, exc) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# Options and arguments that name a file or folder, and what an empty value must say. Typer turns `--root ""`
# into Path("."), so an unset shell variable (`--data-dir "$DIR"`) silently meant the working directory; the
# raw value is checked before that conversion (OneLineUsageErrors.resolve_command). The messages of --root and
# --data-dir are the config's (config_checks: a YAML file or the Python API giving "" says the same).
EMPTY_PATH_MESSAGES: dict[str, str] = {
    "root": "tracking.root must be a folder; got {value!r}. Pass --root a value, or leave it out for the default.",
    "data_dir": "data.data_dir must be a folder; got {value!r}. Pass --data-dir a folder, or leave it out for the "
    "default.",
    "partition": "partition.file must be a partition file; got {value!r}. Pass --partition the .json file "
    "`fedcli partition --out` wrote, or leave it out.",
    "output": "--output must name a file; got {value!r}. Pass --output a file path, or leave it out for the default.",
    "out": "--out must name a file; got {value!r}. Pass --out the partition file to write (.json).",
    "plot": "--plot must name a file; got {value!r}. Pass --plot an image path (.png), or leave it out.",
    "spec": "the sweep spec must name a file; got {value!r}. Pass a spec YAML file, or --recipe NAME.",
}


def check_path_value(name: str, value: object) -> None:
    """ConfigError when a path-valued option or argument `name` (EMPTY_PATH_MESSAGES) is empty or blank."""
    if isinstance(value, str) and not value.strip():
        raise ConfigError(EMPTY_PATH_MESSAGES[name].format(value=value))
