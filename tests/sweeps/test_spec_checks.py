"""A sweep spec is checked against its declaration (fedcli/sweep/spec_keys.py `SweepSpec`, docs/sweeps.md):
the one line each mistake gets, nothing coerced, an unknown key named before anything else, and
every key declared with its help and the phrase of its error."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedcli.errors import ConfigError
from fedcli.sweep.spec import load_spec
from fedcli.sweep.spec_keys import BLOCKS, SweepSpec

SPEC = "experiment: e\nbase: {task: lsq}\n"
SEARCH = "search: {trials: 2, space: {client_lr: [0.1]}}\n"
LINES = [  # (spec, the whole error line)
    (
        "experiment: e\ngird: 1\nseeds: x\n",  # the unknown key first, before the bad seeds
        "unknown sweep key 'gird' (did you mean 'grid'?); valid: experiment, base, grid, variants, seeds, "
        "report, description, paper, smoke, study, max_trials, search, pruner, data.",
    ),
    (
        "gird: 1\n",
        "unknown sweep key 'gird' (did you mean 'grid'?); valid: experiment, base, grid, variants, "
        "seeds, report, description, paper, smoke, study, max_trials, search, pruner, data.",
    ),
    ("seeds: [0]\n", "a sweep spec needs `experiment: NAME`."),
    (
        SPEC + "seeds: ['0']\n",
        "seeds must be a non-empty list of integer seeds such as [0, 1, 2]; got ['0'].",
    ),
    (
        SPEC + "seeds: [true]\n",
        "seeds must be a non-empty list of integer seeds such as [0, 1, 2]; got [True].",
    ),
    (SPEC + "max_trials: true\n", "max_trials must be an integer >= 1; got True."),
    (SPEC + "max_trials: 2147483648\n", "max_trials must be an integer >= 1; got 2147483648."),
    (SPEC + "report: {window: '5'}\n", "report.window must be an integer number of rounds >= 1; got '5'."),
    (SPEC + "report: {thresholds: [.inf]}\n", "report.thresholds must be finite numbers; got [inf]."),
    (SPEC + "report: {at: [2.0]}\n", "report.at must be round numbers >= 1; got [2.0]."),
    (
        SPEC + "report: {group_by: ' , '}\n",
        "report.group_by must be config keys such as \"algo,hp.rho\" or [algo, hp.rho]; got ' , '.",
    ),
    (
        SPEC + "report: {colums: [a]}\n",
        "unknown report key 'colums' (did you mean 'columns'?); valid: metric, thresholds, at, window, smooth, "
        "group_by, output, columns.",
    ),
    (SPEC + "description: 5\n", "description must be text; got 5."),
    (
        SPEC + "grid: {algo: {a: 1}}\n",
        "grid key algo must be a list of values such as [0.01, 0.1]; got {'a': 1}.",
    ),
    (
        "experiment: e\nbase: {1: 2}\n",
        "base must be a mapping of config keys to values such as {task: lsq, rounds: 20}; got {1: 2}.",
    ),
    (
        SPEC + "search: {trials: 2}\n",
        "search.space must be a mapping of config keys to ranges such as {client_lr: {log_uniform: "
        "[0.001, 1]}, hp.rho: [0.01, 0.1]}; got None.",
    ),
    (
        SPEC + "search: {trials: 2, seed: -1, space: {a: [1]}}\n",
        "search.seed must be an integer >= 0 (the sampler's seed); got -1.",
    ),
    (
        SPEC + SEARCH + "pruner: {type: median, reduction_factor: 3}\n",
        "unknown pruner key 'reduction_factor' for type median; valid: warmup, startup_trials, interval.",
    ),
    (
        SPEC + SEARCH + "pruner: {type: hyperband, warmpu: 3}\n",
        "unknown pruner key 'warmpu' for type hyperband (did you mean 'warmup'?); valid: warmup, "
        "reduction_factor.",
    ),
    (
        SPEC + SEARCH + "pruner: {type: median, warmup: null}\n",
        "pruner.warmup must be an integer >= 0; got None.",
    ),
    (
        SPEC + SEARCH + "pruner: {warmup: 3}\n",
        "pruner must be a mapping with type: median | successive_halving | hyperband, e.g. {type: median, "
        "warmup: 5}; got {'warmup': 3}.",
    ),
    (
        SPEC + "search: {trials: 2000, space: {a: [1]}}\n",
        "search.trials = 2000 is more than max_trials = 1000; raise the limit with `max_trials: 2000` in the spec.",
    ),
]


@pytest.mark.parametrize(("text", "line"), LINES, ids=[t[1][:40] for t in LINES])
def test_each_mistake_is_one_line(tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_spec(path, None)
    assert str(caught.value) == line


def test_a_good_spec_is_returned_as_read(tmp_path: Path) -> None:
    text = (
        SPEC + "grid: {algo: fedavg, client_lr: [0.1, 1]}\nseeds: [0, 1]\n"
        "report: {metric: accuracy, thresholds: [1, 0.5], at: [3], window: null, group_by: algo}\n"
    )
    path = tmp_path / "s.yaml"
    path.write_text(text)
    spec = load_spec(path, None)
    assert spec["grid"] == {"algo": "fedavg", "client_lr": [0.1, 1]}  # a single value is kept as written
    assert spec["report"]["thresholds"] == [1, 0.5] and isinstance(spec["report"]["thresholds"][0], int)


def test_every_key_is_declared_with_help_and_the_phrase_of_its_error() -> None:
    for cls in (SweepSpec, *BLOCKS.values()):
        for item in dataclasses.fields(cls):
            assert item.metadata.get("description"), f"{cls.__name__}.{item.name} has no help"
            if (cls.__name__, item.name) != ("PrunerBlock", "type"):  # a bad type is reported as the block
                assert item.metadata.get("must"), f"{cls.__name__}.{item.name} has no `must` phrase"
