"""Fitting a profile's linear time models to measured steps: least squares, no negative cost.

A cost model is `ms = sum(coefficient_i * feature_i)` with features such as 1 (the step's
base), prompt tokens and attended token pairs. Measured times are noisy and the features of
a small sweep are correlated, so an unconstrained fit can price a feature below zero (a
negative cost per token), which would make a simulated step faster the more it holds. A
coefficient that comes out negative is fixed at 0 and the others are fitted again, until none
is (an active-set solution of non-negative least squares, enough for three features).

The wake after idleness is not linear in its two parameters (`SimProfile.wake_ms`):
`fit_wake` scans the half-way gap on a log grid and takes the best amplitude for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    coefficients: list[float]
    predicted: list[float]
    measured: list[float]

    @property
    def relative_errors(self) -> list[float]:
        return [abs(p - m) / m if m > 0 else 0.0 for p, m in zip(self.predicted, self.measured)]

    @property
    def max_relative_error(self) -> float:
        return max(self.relative_errors, default=0.0)


def fit_nonnegative(features: Sequence[Sequence[float]], measured: Sequence[float]) -> Fit:
    """Coefficients >= 0 minimising the squared error of `features @ c` against `measured`,
    each measurement weighted by 1 / itself (relative error: a 2 ms step counts as much as a
    200 ms one)."""
    if not features or len(features) != len(measured):
        raise ValueError(f"{len(features)} feature rows for {len(measured)} measurements")
    x = np.asarray(features, dtype=float)
    y = np.asarray(measured, dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured times must be > 0")
    weights = 1.0 / y
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        coefficients[:] = 0.0
        coefficients[active] = solution
        negative = [i for i, c in zip(active, solution) if c < 0]
        if not negative:
            break
        worst = min(negative, key=lambda i: coefficients[i])
        active.remove(worst)
    predicted = x @ coefficients
    return Fit([float(c) for c in coefficients], [float(p) for p in predicted],
               [float(m) for m in y])


def fit_wake(gaps_ms: Sequence[float], excess_ms: Sequence[float]) -> Fit:
    """[idle_wake_ms, idle_wake_half_ms] minimising the squared error of
    `wake * g / (g + half)` against the measured excess of a step after `g` ms idle; an
    excess that is never positive gives a wake of 0."""
    if not gaps_ms or len(gaps_ms) != len(excess_ms) or min(gaps_ms) <= 0:
        raise ValueError(f"{len(gaps_ms)} idle gaps (> 0 ms) for {len(excess_ms)} excesses")
    g = np.asarray(gaps_ms, dtype=float)
    y = np.asarray(excess_ms, dtype=float)
    best = (float(np.sum(y * y)), 0.0, 10.0)
    for half in np.geomspace(0.1, 10.0 * g.max(), 400):
        f = g / (g + half)
        wake = max(0.0, float(f @ y / (f @ f)))
        error = float(np.sum((y - wake * f) ** 2))
        if error < best[0]:
            best = (error, wake, float(half))
    _, wake, half = best
    predicted = wake * g / (g + half)
    return Fit([wake, half], [float(p) for p in predicted], [float(m) for m in y])
