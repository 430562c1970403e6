"""`pdserve profile`'s fit: least squares that never prices a feature below zero."""

from __future__ import annotations

import pytest
from pdserve.plan.fit import fit_nonnegative, fit_wake
from pdserve.plan.measure import fit_points

pytestmark = pytest.mark.unit


def test_exact_points_give_back_their_coefficients():
    rows = [[1.0, t, a] for t, a in ((32, 528), (128, 8256), (512, 131328), (64, 2080))]
    fit = fit_nonnegative(rows, [2 + 0.05 * t + 1e-5 * a for _, t, a in rows])
    assert fit.coefficients == pytest.approx([2.0, 0.05, 1e-5], rel=1e-6)
    assert fit.max_relative_error < 1e-9


def test_a_coefficient_that_would_be_negative_is_fixed_at_zero_and_the_rest_refitted():
    # times falling with the second feature: unconstrained, its cost would be negative
    rows = [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    fit = fit_nonnegative(rows, [3.0, 2.9, 2.8])
    assert fit.coefficients[1] == 0.0
    assert 2.8 < fit.coefficients[0] < 3.0  # a constant: the (relative) least-squares mean
    with pytest.raises(ValueError):
        fit_nonnegative(rows, [1.0, 0.0, 2.0])


def test_profile_models_are_fitted_from_prefill_and_decode_points():
    prefill = [{"length": n, "batch": k, "tokens": n * k, "attended": k * n * (n + 1) / 2,
                "ms": 1.0 + 0.01 * n * k + 1e-5 * k * n * (n + 1) / 2}
               for n in (32, 256, 1024) for k in (1, 2)]
    decode = [{"batch": b, "context_tokens": b * c, "ms": 3.0 + 0.2 * b + 0.001 * b * c}
              for b in (1, 8) for c in (64, 512)]
    measured = fit_points(prefill, decode)
    assert measured.prefill_fit.coefficients == pytest.approx([1.0, 0.01, 1e-5], rel=1e-6)
    assert measured.decode_fit.coefficients == pytest.approx([3.0, 0.2, 0.001], rel=1e-6)


def test_the_wake_after_idleness_is_fitted_from_its_excess_per_gap():
    gaps = [2.0, 10.0, 50.0, 200.0]
    fit = fit_wake(gaps, [5.0 * g / (g + 20.0) for g in gaps])
    assert fit.coefficients == pytest.approx([5.0, 20.0], rel=0.02)
    assert fit.predicted == pytest.approx(fit.measured, abs=0.02)
    # no step slower after idling than back to back: nothing to model
    assert fit_wake(gaps, [-0.1, 0.0, -0.2, 0.05]).coefficients[0] == pytest.approx(0.0, abs=0.05)
    with pytest.raises(ValueError):
        fit_wake([0.0, 10.0], [1.0, 2.0])
