"""Issue 33, item 4: one validation path for a config's values (fedcli/config/checks.py `validated`).

pydantic validates a section or an algorithm's hyperparameters against the dataclass declaration;
`config_error` turns its first error into the one line of docs/style.md rule 11. The CLI cases of
these messages are in tests/reliability/test_bad_input.py and test_coercions.py; here the function
itself, on the real sections and on a declaration of the test's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from fedcli.algorithms.base import HyperparameterError
from fedcli.config.checks import build_section, make_hyperparameters, type_names, validated
from fedcli.config.sections import DataConfig, PartitionConfig, TrainConfig, opt
from fedcli.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    steps: int  # required: no default
    scale: float = opt(1.0, "a scale", ge=0, le=10, fix="Pick 10 or less.")
    tags: Mapping[str, Any] = opt(factory=dict)
    mode: str = opt("a", choices=("a", "b"))

    def __post_init__(self) -> None:
        if self.steps == 13:
            raise HyperparameterError("steps must not be 13; got 13.")
        if self.steps == 7:
            raise ValueError("steps 7 is unlucky")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {},
            "p.steps must be given (it has no default); got none. Pass it with `steps: VALUE` in the p section.",
        ),
        ({"steps": "4"}, "p.steps must be int; got '4'."),
        ({"steps": 4.0}, "p.steps must be int; got 4.0."),
        ({"steps": True}, "p.steps must be int; got True."),
        ({"steps": None}, "p.steps must be set; got None."),
        ({"steps": 2**31}, "p.steps must be at most 2147483647 (2**31 - 1) in size; got 2147483648."),
        ({"steps": 1, "scale": -1}, "p.scale must be >= 0; got -1."),
        ({"steps": 1, "scale": "-1"}, "p.scale must be >= 0; got '-1'."),
        ({"steps": 1, "scale": False}, "p.scale must be float; got False."),
        ({"steps": 1, "scale": True}, "p.scale must be float; got True."),
        ({"steps": 1, "scale": 11}, "p.scale must be <= 10; got 11. Pick 10 or less."),
        ({"steps": 1, "scale": float("nan")}, "p.scale must be a finite number; got nan."),
        ({"steps": 1, "scale": "inf"}, "p.scale must be a finite number; got 'inf'."),
        ({"steps": 1, "scale": b"1"}, "p.scale must be float; got b'1'."),
        ({"steps": 1, "tags": [1]}, "p.tags must be Mapping[str, Any]; got [1]."),
        ({"steps": 1, "mode": "c"}, "p.mode must be one of a, b; got 'c'."),
        ({"steps": 13}, "steps must not be 13; got 13."),
        ({"steps": 7}, "p: steps 7 is unlucky"),
    ],
)
def test_each_kind_of_pydantic_error_is_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validated("p", Probe, values)
    assert str(caught.value) == message


def test_allowed_conversions_only() -> None:
    got = validated("p", Probe, {"steps": 3, "scale": 2, "tags": {"x": 1}})
    assert got == Probe(steps=3, scale=2.0, tags={"x": 1}) and isinstance(got.scale, float)
    assert validated("p", Probe, {"steps": 3, "scale": "5e-1"}).scale == 0.5  # YAML 1.1 reads 5e-1 as text
    assert build_section("data", DataConfig, {"augment": "flip, crop:4"}).augment == ("flip", "crop:4")
    assert build_section("data", DataConfig, {"augment": ["flip"]}).augment == ("flip",)
    assert build_section("data", DataConfig, {"augment": ""}).augment is None


def test_type_names_are_the_annotations_as_written() -> None:
    assert type_names(TrainConfig, "client_lr") == "float"
    assert type_names(DataConfig, "augment") == "tuple[str, ...]"
    assert type_names(Probe, "tags") == "Mapping[str, Any]"
    with pytest.raises(ConfigError, match=r"^data.augment must be tuple\[str, \.\.\.\]; got \[1\]\.$"):
        build_section("data", DataConfig, {"augment": [1]})


def test_sections_and_hyperparameters_share_the_path() -> None:
    with pytest.raises(
        ConfigError, match=r"^unknown config key 'partition.alpah' \(did you mean 'alpha'\?\)\.$"
    ):
        build_section("partition", PartitionConfig, {"alpah": 1.0})
    with pytest.raises(
        ConfigError, match=r"^train.state_precision must be one of state, bf16, fp16; got 'fp8'\.$"
    ):
        build_section("train", TrainConfig, {"state_precision": "fp8"})
    with pytest.raises(ConfigError, match=r"^train.rounds must be int; got '0'\.$"):
        build_section("train", TrainConfig, {"rounds": "0"})  # its type is named before its bound
    with pytest.raises(ConfigError, match=r"^train.rounds must be int; got 0\.0\.$"):
        build_section("train", TrainConfig, {"rounds": 0.0})
    with pytest.raises(ConfigError, match=r"^hp.mu must be float; got 'big'\.$"):
        make_hyperparameters("fedprox", {"mu": "big"})
    assert make_hyperparameters("fedprox", {"mu": 1}).mu == 1.0
