"""Metric definitions of the paper tables: running average, rounds to a threshold, metric@R.

Pure NumPy over one run's curve, given as `rounds` (int, ascending, unique) and `values`
(float, same length): the rounds at which the metric was logged and its values there.
Round 0 is the initial model (docs/style.md rule 2); it is plotted but never enters a window,
a running average, a best or a final value, because the papers count rounds 1..R.

Definitions (FedPA, Al-Shedivat et al. 2021, Table 3 caption and reference/fedpa.md §4.5):

- running average (`smooth` = S): `avg_t = mean{ v_s : t - S < s <= t, s >= 1 }`, defined
  only at logged rounds t >= S (a full window, as the paper's `t >= 10`); rounds that were
  not evaluated are left out of the mean, never interpolated.
- rounds to threshold X: `min{ t : avg_t >= X }` (`<= X` for lower-is-better metrics);
  None when never reached. Equality counts as reached; a relative tolerance of
  `TIE_RTOL` absorbs floating-point rounding of the window mean.
- metric@R (`window` = W): `mean{ v_s : R - W < s <= R, s >= 1 }`; None when the run stopped
  before round R or no round of the window was logged.
- bytes to round t: the sum of the per-round byte counts of rounds 1..t (`cumulative_at`;
  `cumulative` gives it at every logged round, the x-axis of the bytes and time figures
  when a run did not log comm/cum_bytes_* or time/cum_train_s).
- over seeds: mean, sample standard deviation (ddof = 1; 0 for one seed) and the number of
  seeds with a value out of all seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "TIE_RTOL",
    "SeedSummary",
    "best_value",
    "cumulative",
    "cumulative_at",
    "final_value",
    "is_lower_better",
    "running_average",
    "rounds_to_threshold",
    "summarize_seeds",
    "window_mean",
]

TIE_RTOL = 1e-9  # relative tolerance for "reaches the threshold" (rounding of the window mean)
_LOWER_IS_BETTER = ("loss", "dist_to_opt", "nll", "brier", "ece", "perplexity", "error", "bytes", "round_s")


def is_lower_better(key: str) -> bool:
    """Return True for losses, distances, calibration errors, perplexity, bytes and time.

    Args:
        key: A metric key (`eval/loss`, `comm/bytes_up`) or bare name (`accuracy`).
    """
    name = key.rsplit("/", 1)[-1]
    return key.startswith(("comm/", "time/")) or any(part in name for part in _LOWER_IS_BETTER)


def _checked(rounds: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rounds = np.asarray(rounds, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    if rounds.shape != values.shape or rounds.ndim != 1:
        raise ValueError(
            f"rounds and values must be 1-d of equal length; got {rounds.shape} and {values.shape}."
        )
    if rounds.size > 1 and np.any(np.diff(rounds) <= 0):
        raise ValueError("rounds must be strictly increasing.")
    return rounds, values


def running_average(
    rounds: np.ndarray, values: np.ndarray, smooth: int, full_window: bool = True
) -> np.ndarray:
    """Trailing `smooth`-round running average at each logged round (NaN where undefined).

    Args:
        rounds: Logged rounds, strictly increasing.
        values: The metric at those rounds.
        smooth: Window length S in rounds (>= 1).
        full_window: True (the definition): only rounds t >= S have a value. False (for
            plots): rounds 1 <= t < S average the rounds 1..t they have.

    Returns:
        float64 array like `values`: `avg_t` at rounds t >= S (t >= 1 without
        `full_window`), NaN elsewhere and at round 0.
    """
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1; got {smooth}.")
    rounds, values = _checked(rounds, values)
    out = np.full(values.shape, np.nan)
    if rounds.size == 0:
        return out
    last = int(rounds[-1])
    dense = np.zeros(last + 1)
    present = np.zeros(last + 1)
    keep = rounds >= 1
    dense[rounds[keep]] = values[keep]
    present[rounds[keep]] = 1.0
    padded_sum = np.concatenate([np.zeros(smooth), dense])
    padded_cnt = np.concatenate([np.zeros(smooth), present])
    # [1:]: the window ending at round t
    sums = np.lib.stride_tricks.sliding_window_view(padded_sum, smooth)[1:].sum(axis=1)
    counts = np.lib.stride_tricks.sliding_window_view(padded_cnt, smooth)[1:].sum(axis=1)
    defined = (rounds >= (smooth if full_window else 1)) & (counts[rounds] > 0)
    out[defined] = sums[rounds[defined]] / counts[rounds[defined]]
    return out


def rounds_to_threshold(
    rounds: np.ndarray, values: np.ndarray, threshold: float, smooth: int, lower_is_better: bool = False
) -> int | None:
    """First round whose trailing running average reaches `threshold`, or None if none does.

    Args:
        rounds: Logged rounds, strictly increasing.
        values: The metric at those rounds.
        threshold: X; reached when `avg_t >= X` (or `<= X` if `lower_is_better`).
        smooth: Running-average window S in rounds.
        lower_is_better: Direction of the metric (see `is_lower_better`).
    """
    rounds, _ = _checked(rounds, values)
    avg = running_average(rounds, values, smooth)
    tol = TIE_RTOL * max(1.0, abs(threshold))
    with np.errstate(invalid="ignore"):
        reached = avg <= threshold + tol if lower_is_better else avg >= threshold - tol
    hits = np.flatnonzero(reached)
    return int(rounds[hits[0]]) if hits.size else None


def window_mean(
    rounds: np.ndarray, values: np.ndarray, at: int, window: int, last_round: int | None = None
) -> float | None:
    """metric@R: mean over the logged rounds s with R - W < s <= R and s >= 1.

    Args:
        rounds: Logged rounds, strictly increasing.
        values: The metric at those rounds.
        at: R, the round limit.
        window: W, the window length in rounds (>= 1).
        last_round: The last round the run trained; default the last logged round. None
            is returned when it is below R (the run did not reach R).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}.")
    rounds, values = _checked(rounds, values)
    last = int(rounds[-1]) if last_round is None and rounds.size else last_round
    if last is None or last < at:
        return None
    chosen = values[(rounds > at - window) & (rounds <= at) & (rounds >= 1)]
    return float(chosen.mean()) if chosen.size else None


def final_value(rounds: np.ndarray, values: np.ndarray) -> float | None:
    """The value at the last logged round >= 1, or None."""
    rounds, values = _checked(rounds, values)
    chosen = values[rounds >= 1]
    return float(chosen[-1]) if chosen.size else None


def best_value(rounds: np.ndarray, values: np.ndarray, lower_is_better: bool = False) -> float | None:
    """The best per-round value over rounds >= 1 (max, or min if lower is better), or None."""
    rounds, values = _checked(rounds, values)
    chosen = values[rounds >= 1]
    if not chosen.size:
        return None
    return float(chosen.min() if lower_is_better else chosen.max())


def cumulative_at(rounds: np.ndarray, values: np.ndarray, at: int | None = None) -> float:
    """Sum of per-round values over rounds 1..at (all rounds if `at` is None), e.g. bytes sent."""
    rounds, values = _checked(rounds, values)
    keep = rounds >= 1 if at is None else (rounds >= 1) & (rounds <= at)
    return float(values[keep].sum())


def cumulative(rounds: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running sum of per-round values over rounds 1..t at each logged round t (0 at round 0)."""
    rounds, values = _checked(rounds, values)
    return np.cumsum(np.where(rounds >= 1, values, 0.0))


@dataclass(frozen=True)
class SeedSummary:
    """One table cell over seeds: mean and sample std of the seeds that have a value."""

    mean: float | None
    std: float | None
    count: int  # seeds with a value
    total: int  # seeds in the group


def summarize_seeds(values: Sequence[float | None]) -> SeedSummary:
    """Mean and sample standard deviation (ddof = 1) over the seeds whose value is not None.

    One seed gives std 0.0; no seed with a value gives mean and std None.
    """
    present = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not present:
        return SeedSummary(None, None, 0, len(values))
    arr = np.asarray(present)
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return SeedSummary(float(arr.mean()), std, arr.size, len(values))
