"""The README's "A tour of the command line" runs as written, in a smoke mode.

Every `fedcli` line of the tour's shell block is run in order, in a tmp folder, through Typer's
CliRunner (one process: no interpreter start per command), changed only where a smoke run
must differ: trainings get `--rounds 1` and `--clients-per-round 2` (a resume: `--rounds 2`),
sweeps `--smoke`, every command that reads or writes runs a tmp `--root`, trainings after
the first `--no-mlflow` (the first one fills the MLflow store that `fedcli ui` and `sync`
open), `fedcli ui` `--print-only` (it would serve until stopped), report's `--at` the one
round there is. The run ids the tour writes as `3f2a9c` and `7c1e04` stand for its first run
and its first run of an algorithm that keeps a posterior (fola). `mydata.npz` and `spec.yaml`
are made here (the spec is the README's own sweep spec plus a smoke block). Each command
must exit 0.

Several minutes on 2 busy cores (FEMNIST and MNIST loads, sweep trials as processes, a process
pool, --compile).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from fedcli.cli.main import app

REPO = Path(__file__).resolve().parents[2]
FIRST_RUN, POSTERIOR_RUN = (
    "3f2a9c",
    "7c1e04",
)  # the tour's run ids: its first run; a run that keeps a posterior


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def fenced(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def tour_commands() -> list[list[str]]:
    """The tour's shell lines as argv lists (continuations joined, comments dropped)."""
    (block,) = fenced(readme_section("A tour of the command line"), "bash")
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [argv for argv in commands if argv]


def set_option(argv: list[str], option: str, value: str) -> list[str]:
    if option in argv:
        i = argv.index(option)
        return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, option, value]


def smoke(argv: list[str], root: Path, run_ids: dict[str, str]) -> list[str]:
    """The tour command `argv` (without `fedcli`) as the smoke run executes it; `run_ids` maps
    the tour's placeholder ids to the runs made so far."""
    argv = [run_ids.get(a, a) for a in argv]
    command = argv[0]
    if command == "train":
        resume = "--resume" in argv
        argv = set_option(argv, "--rounds", "2" if resume else "1")
        if not resume:
            argv = set_option(argv, "--clients-per-round", "2")
        if run_ids and not resume:
            argv.append("--no-mlflow")
    elif command == "sweep":
        argv.append("--smoke")
    elif command == "ui":
        argv.append("--print-only")
    elif command == "report" and "--at" in argv:
        argv = set_option(argv, "--at", "1")
    if command in ("train", "sweep", "evaluate", "report", "ui", "sync") or argv[:2] == ["list", "runs"]:
        argv += ["--root", str(root)]
    return argv


def write_inputs(folder: Path) -> None:
    """mydata.npz (bring-your-own data) and spec.yaml (the README's sweep spec, plus a smoke block)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 6)).astype(np.float32)  # 12 clients: the default 10 per round fit
    np.savez(folder / "mydata.npz", x=x, y=(x[:, 0] > 0).astype(np.int64), client=np.arange(240) % 12)
    (spec_text,) = fenced(readme_section("Running many experiments"), "yaml")
    spec = yaml.safe_load(spec_text)
    spec["smoke"] = {
        "base": {"rounds": 1, "clients_per_round": 2, "local_epochs": 1},
        "grid": {"hp.rho": [0.1]},
        "seeds": [0],
        "report": {"at": [1]},
    }
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))


def test_tour_lists_the_commands_it_promises() -> None:
    commands = tour_commands()

    assert all(argv[0] == "fedcli" for argv in commands), [a for a in commands if a[0] != "fedcli"]
    assert ["fedcli", "list", "algos"] in commands and ["fedcli", "ui"] in commands
    assert any("--resume" in argv for argv in commands) and any(argv[1] == "sweep" for argv in commands)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_tour_command_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_inputs(tmp_path)
    root = tmp_path / "fedcli-runs"
    runner = CliRunner()
    run_ids: dict[str, str] = {}
    for argv in tour_commands():
        args = smoke(argv[1:], root, run_ids)
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (
            f"fedcli {' '.join(args)} exited {result.exit_code}:\n{result.output[-3000:]}"
        )
        if args[0] == "train" and "--resume" not in args:
            made = result.stdout.strip().splitlines()[-1]
            run_ids.setdefault(FIRST_RUN, made)
            if "fola" in args or any(a.startswith("bayesadmm") for a in args):
                run_ids.setdefault(POSTERIOR_RUN, made)
    assert set(run_ids) == {FIRST_RUN, POSTERIOR_RUN}
    assert (tmp_path / "report.md").exists() and (tmp_path / "p.png").exists()


def test_the_old_tour_line_fails_with_a_hint_train_understands(tmp_path: Path) -> None:
    """Dirichlet(0.1) over 100 clients of the 10,000 bundled MNIST images leaves some client below
    10 examples: the error suggests --min-size, which `train` now accepts (it did not)."""
    runner = CliRunner()
    base = [
        "train",
        "--task",
        "mnist",
        "--scheme",
        "dirichlet",
        "--alpha",
        "0.1",
        "--clients",
        "100",
        "--rounds",
        "1",
        "--no-mlflow",
        "--root",
        str(tmp_path),
    ]

    failed = runner.invoke(app, base)
    helped = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})

    assert failed.exit_code == 2 and "lower --min-size" in failed.stderr
    hinted = set(re.findall(r"--[a-z][a-z-]+", failed.stderr.split("attempts", 1)[1]))
    assert hinted == {"--alpha", "--clients", "--min-size"} and all(flag in helped.stdout for flag in hinted)
