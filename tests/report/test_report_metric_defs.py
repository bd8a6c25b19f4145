"""The paper-table metric definitions (tracking/metric_defs.py) against hand-computed curves."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcli.tracking import metric_defs as md


def _curve(rounds: list[int], values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(rounds, dtype=np.int64), np.asarray(values, dtype=np.float64)


def test_running_average_is_trailing_mean_over_full_windows_only() -> None:
    """avg_t = mean{v_s : t-S < s <= t}, defined at t >= S; round 0 never enters.
    With v_s = s and S = 3: avg_3 = (1+2+3)/3 = 2, avg_4 = 3, avg_5 = 4; rounds 0..2 undefined,
    and the initial value v_0 = 100 must not leak into any window."""
    rounds, values = _curve([0, 1, 2, 3, 4, 5], [100, 1, 2, 3, 4, 5])

    avg = md.running_average(rounds, values, smooth=3)

    expected = np.array([np.nan, np.nan, np.nan, (1 + 2 + 3) / 3, (2 + 3 + 4) / 3, (3 + 4 + 5) / 3])
    np.testing.assert_allclose(avg, expected, rtol=0, atol=1e-15)


def test_running_average_skips_rounds_that_were_not_evaluated() -> None:
    """Round 3 missing, S = 3: avg_4 = mean(v_2, v_4) = (2+4)/2, avg_5 = mean(v_4, v_5) = 4.5 (no interpolation)."""
    rounds, values = _curve([1, 2, 4, 5], [1, 2, 4, 5])

    avg = md.running_average(rounds, values, smooth=3)

    np.testing.assert_allclose(avg, [np.nan, np.nan, (2 + 4) / 2, (4 + 5) / 2], rtol=0, atol=1e-15)


def test_running_average_partial_windows_for_plots() -> None:
    """full_window=False: avg_1 = v_1, avg_2 = (v_1+v_2)/2, then the full trailing window."""
    rounds, values = _curve([0, 1, 2, 3], [9, 1, 2, 6])

    avg = md.running_average(rounds, values, smooth=3, full_window=False)

    np.testing.assert_allclose(avg, [np.nan, 1.0, 1.5, 3.0], rtol=0, atol=1e-15)


def test_rounds_to_threshold_first_crossing_of_running_average() -> None:
    """v = 0.1 r (r = 1..10), S = 2: avg_t = 0.1 t - 0.05. avg_t >= 0.5 first at t = 6 (0.55);
    the raw value reaches 0.5 already at r = 5, which must not count."""
    rounds = np.arange(1, 11)
    values = 0.1 * rounds

    assert md.rounds_to_threshold(rounds, values, 0.5, smooth=2) == 6


def test_rounds_to_threshold_never_reached_is_none() -> None:
    """A curve that peaks at 0.8 never reaches 0.84."""
    rounds = np.arange(1, 51)
    values = 0.8 * (1 - np.exp(-rounds / 5.0))

    assert md.rounds_to_threshold(rounds, values, 0.84, smooth=10) is None


@pytest.mark.parametrize("level", [0.5, 0.84, 0.86])
def test_rounds_to_threshold_exact_equality_counts_as_reached(level: float) -> None:
    """A flat curve at exactly X reaches X at the first full window t = S (>=, with rounding
    of the window mean absorbed by TIE_RTOL); a shortfall of 1e-6 does not."""
    rounds = np.arange(1, 21)

    assert md.rounds_to_threshold(rounds, np.full(20, level), level, smooth=10) == 10
    assert md.rounds_to_threshold(rounds, np.full(20, level - 1e-6), level, smooth=10) is None


def test_rounds_to_threshold_lower_is_better() -> None:
    """Loss 1/r, S = 1: first r with 1/r <= 0.25 is r = 4."""
    rounds = np.arange(1, 11)

    assert md.rounds_to_threshold(rounds, 1.0 / rounds, 0.25, smooth=1, lower_is_better=True) == 4


def test_window_mean_is_mean_over_last_w_rounds_up_to_r() -> None:
    """v_r = r, R = 10, W = 4: mean(7, 8, 9, 10) = 8.5; with round 8 missing: (7+9+10)/3."""
    rounds, values = np.arange(0, 13), np.arange(0, 13, dtype=np.float64)
    gappy = rounds != 8

    assert md.window_mean(rounds, values, at=10, window=4) == pytest.approx((7 + 8 + 9 + 10) / 4, abs=1e-15)
    assert md.window_mean(rounds[gappy], values[gappy], at=10, window=4) == pytest.approx(
        (7 + 9 + 10) / 3, abs=1e-15
    )


def test_window_mean_excludes_round_zero_and_needs_the_run_to_reach_r() -> None:
    """W larger than R: the mean covers rounds 1..R only (v_0 = 100 excluded): (1+2+3)/3 = 2.
    A run that stopped at round 3 has no value at R = 5; given last_round=5 (trained on,
    evaluated sparsely) it does."""
    rounds, values = _curve([0, 1, 2, 3], [100, 1, 2, 3])

    assert md.window_mean(rounds, values, at=3, window=100) == pytest.approx(2.0, abs=1e-15)
    assert md.window_mean(rounds, values, at=5, window=100) is None
    assert md.window_mean(rounds, values, at=5, window=100, last_round=5) == pytest.approx(2.0, abs=1e-15)


def test_cumulative_best_final() -> None:
    """Bytes to round t = sum over rounds 1..t; best/final ignore round 0."""
    rounds, values = _curve([0, 1, 2, 3], [50, 10, 30, 20])

    assert md.cumulative_at(rounds, values, at=2) == 10 + 30
    assert md.cumulative_at(rounds, values) == 10 + 30 + 20
    assert md.best_value(rounds, values) == 30
    assert md.best_value(rounds, values, lower_is_better=True) == 10
    assert md.final_value(rounds, values) == 20


def test_summarize_seeds_mean_sample_std_and_counts() -> None:
    """Seeds [1, 2, 3, None]: mean 2, sample std sqrt(((1-2)^2 + 0 + (3-2)^2)/2) = 1, 3 of 4 seeds."""
    summary = md.summarize_seeds([1.0, 2.0, 3.0, None])

    assert (summary.mean, summary.count, summary.total) == (2.0, 3, 4)
    assert summary.std == pytest.approx(math.sqrt(2 / 2), abs=1e-15)
    assert md.summarize_seeds([4.0]) == md.SeedSummary(4.0, 0.0, 1, 1)
    assert md.summarize_seeds([None, None]) == md.SeedSummary(None, None, 0, 2)


@pytest.mark.parametrize(
    ("key", "lower"),
    [
        ("eval/accuracy", False),
        ("eval/loss", True),
        ("eval/dist_to_opt", True),
        ("comm/bytes_up", True),
        ("time/round_s", True),
        ("eval/macro_f1", False),
        ("eval/ece", True),
        ("eval/perplexity", True),
    ],
)
def test_direction_of_metrics(key: str, lower: bool) -> None:
    assert md.is_lower_better(key) is lower


def test_unsorted_rounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        md.running_average(np.array([2, 1]), np.array([0.0, 1.0]), smooth=1)


def test_cumulative_sums_rounds_one_to_t_at_every_logged_round() -> None:
    """bytes b_r logged at rounds 0, 1, 2, 4: cumulative = [0, b_1, b_1+b_2, b_1+b_2+b_4]
    (round 0, the initial model, sends nothing even if a value is logged there)."""
    rounds, values = _curve([0, 1, 2, 4], [7.0, 10.0, 20.0, 40.0])

    np.testing.assert_allclose(
        md.cumulative(rounds, values), [0.0, 10.0, 10.0 + 20.0, 10.0 + 20.0 + 40.0], rtol=0, atol=0
    )
    assert md.cumulative(rounds, values)[-1] == md.cumulative_at(rounds, values)
