"""Metric-key rules (docs/style.md rule 15), value checks and config flattening."""

from __future__ import annotations

import math

import pytest

from fedcli.tracking.keys import NonFiniteMetricsError, check_metric_key, check_metrics, flatten_config


@pytest.mark.parametrize("key", ["eval/accuracy", "comm/bytes_up", "train/loss 2", "a.b-c_d", "x"])
def test_check_metric_key_accepts_split_name_keys(key: str) -> None:
    """Keys made of [A-Za-z0-9_./ -] without '//' or a leading '/' pass unchanged."""
    assert check_metric_key(key) == key


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("eval|acc", r"must be made of \[A-Za-z0-9_./ -\] \(e.g. 'eval/accuracy'\); got 'eval\|acc'"),
        ("", r"must be made of"),
        ("eval/accuracy%", r"got 'eval/accuracy%'"),
        ("eval//acc", r"must not contain '//'"),
        ("/eval/acc", r"must not contain '//' or start with '/'"),
        ("k" * 251, r"at most 250 characters; got 251"),
    ],
)
def test_check_metric_key_rejects_bad_keys_with_the_value(key: str, message: str) -> None:
    """Each rule violation raises ValueError whose message names the rule and the key."""
    with pytest.raises(ValueError, match=message):
        check_metric_key(key)


def test_check_metrics_lists_every_non_finite_key() -> None:
    """NaN, +inf and -inf are all reported, sorted, with the round; finite ones are not."""
    metrics = {"train/loss": math.nan, "eval/accuracy": 0.5, "eval/loss": math.inf, "a/b": -math.inf}

    with pytest.raises(
        NonFiniteMetricsError, match=r"at round 7: a/b=-inf, eval/loss=inf, train/loss=nan"
    ) as info:
        check_metrics(metrics, round_idx=7)

    assert info.value.keys == ("a/b", "eval/loss", "train/loss")
    assert info.value.round_idx == 7
    assert isinstance(info.value, ValueError)


def test_check_metrics_converts_to_float_and_rejects_non_numbers() -> None:
    """Integers become floats; a string value is a ValueError naming the key."""
    assert check_metrics({"comm/bytes_up": 3}) == {"comm/bytes_up": 3.0}
    with pytest.raises(ValueError, match=r"metric 'eval/acc' must be a real number; got 'high'"):
        check_metrics({"eval/acc": "high"})


def test_flatten_config_joins_nested_keys_and_writes_lists_as_json() -> None:
    """Nested dicts give dot-joined keys; lists are compact JSON; scalars are str()'d."""
    cfg = {
        "seed": 3,
        "algorithm": {"name": "fedpa", "rho": 0.01, "burn_in": {"rounds": 100}},
        "train": {"lrs": [0.1, 0.01], "use_momentum": True, "extra": {}},
        "partition": {"alpha": None},
    }

    flat = flatten_config(cfg)

    assert flat == {
        "algorithm.burn_in.rounds": "100",
        "algorithm.name": "fedpa",
        "algorithm.rho": "0.01",
        "partition.alpha": "None",
        "seed": "3",
        "train.extra": "{}",
        "train.lrs": "[0.1,0.01]",
        "train.use_momentum": "True",
    }
    assert list(flat) == sorted(flat)
