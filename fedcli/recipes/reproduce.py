"""`make reproduce`: run every paper recipe (those with a `paper:` key) and time it.

    python -m fedcli.recipes.reproduce [--out reproductions] [--only NAME ...] [--smoke] [--workers 2]

Each recipe runs as users run it, `fedcli sweep --recipe NAME` with MLflow on, its runs in
<out>/runs (not committed) and its report at <out>/NAME/NAME.md with the figures beside it.
A rerun skips finished trials, so it continues an interrupted `make reproduce`. The wall time
of each recipe goes to <out>/timings.md (docs/reproductions.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from fedcli.recipes import read_recipe, recipe_names


def paper_recipes() -> list[str]:
    """Every recipe with a `paper:` key, but those that need files not bundled (`data:`, paper scale)."""
    return [
        name
        for name in recipe_names()
        if read_recipe(name).get("paper") and not read_recipe(name).get("data")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reproductions"))
    parser.add_argument("--only", nargs="*", default=None, help="recipe names (default: every paper recipe)")
    parser.add_argument("--smoke", action="store_true", help="the seconds-long smoke versions")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    names = args.only or paper_recipes()
    unknown = sorted(set(names) - set(recipe_names()))
    if unknown:
        print(
            f"error: unknown recipe {unknown[0]!r}; `fedcli sweep --list-recipes` lists them.",
            file=sys.stderr,
        )
        return 2
    fedcli = Path(sys.executable).with_name("fedcli")
    rows, failed = [], False
    for name in names:
        report = args.out / name / f"{name}.md"
        command = [
            str(fedcli),
            "sweep",
            "--recipe",
            name,
            "--root",
            str(args.out / "runs"),
            "--output",
            str(report),
            "--workers",
            str(args.workers),
            *(["--smoke"] if args.smoke else []),
        ]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        code = subprocess.call(command)
        wall = time.perf_counter() - started
        rows.append(f"| {name} | {wall / 60:.1f} | {code} |")
        failed = failed or code != 0
    table = [
        "# Recipe wall times",
        "",
        f"`make reproduce` on {platform.machine()}, {os.cpu_count()} CPUs; minutes per recipe, including its runs' "
        "start-up and report (a rerun skips finished trials, so only a first run's times count).",
        "",
        "| recipe | minutes | exit code |",
        "|---|---|---|",
        *rows,
    ]
    if not args.smoke and not args.only:
        (args.out / "timings.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
