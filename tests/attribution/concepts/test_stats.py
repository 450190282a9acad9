"""The t-test, the scores' formulas and the Bonferroni correction, against closed forms, slow loops and scipy."""

from __future__ import annotations

import math

import pytest
import torch

from attribution.concepts._math import bonferroni, magnitude, sign_count
from attribution.concepts._stats import incomplete_beta, t_test, t_two_sided


@pytest.mark.parametrize("t", [0.0, 0.3, 1.7, 4.2, 25.0])
def test_the_t_distribution_equals_its_closed_forms_for_one_and_two_degrees_of_freedom(t):
    assert t_two_sided(t, 1.0) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-12, abs=1e-15)  # Cauchy
    assert t_two_sided(t, 2.0) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("x", "a"), [(0.1, 0.5), (0.37, 2.5), (0.9, 7.0)])
def test_the_incomplete_beta_function_equals_x_to_the_a_when_b_is_one(x, a):
    assert incomplete_beta(x, a, 1.0) == pytest.approx(x**a, rel=1e-13)
    assert incomplete_beta(x, 1.0, a) == pytest.approx(1 - (1 - x) ** a, rel=1e-13)


def test_student_and_welch_p_values_equal_scipy_to_1e_10():
    stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        na, nb = 2 + trial % 9, 3 + (trial * 7) % 11
        a = (torch.randn(na, generator=generator, dtype=torch.float64) * (0.2 + trial % 3)).tolist()
        b = (torch.randn(nb, generator=generator, dtype=torch.float64) + 0.1 * (trial % 13 - 6)).tolist()
        for test, equal_var in (("student", True), ("welch", False)):
            expected = float(stats.ttest_ind(a, b, equal_var=equal_var).pvalue)
            assert t_test(a, b, test) == pytest.approx(expected, rel=1e-10, abs=1e-300), (trial, test)


def test_constant_samples_give_nan_when_equal_and_zero_when_they_differ_as_scipy():
    assert math.isnan(t_test([0.5, 0.5], [0.5, 0.5, 0.5]))
    assert t_test([1.0, 1.0, 1.0], [0.5, 0.5]) == 0.0
    with pytest.raises(ValueError, match="at least two values per sample"):
        t_test([1.0], [0.5, 0.4])


def test_sign_count_and_magnitude_equal_their_definitions_computed_slowly():
    generator = torch.Generator().manual_seed(1)
    d = torch.randn(13, 4, generator=generator, dtype=torch.float64) + torch.tensor([0.8, -0.5, 0.0, 2.0])
    d[3, 2] = 0.0  # a zero derivative counts as not positive
    for k in range(4):
        column = d[:, k].tolist()
        assert sign_count(d)[k].item() == sum(v > 0 for v in column) / len(column)
        expected = sum(max(v, 0.0) for v in column) / sum(abs(v) for v in column)
        assert magnitude(d)[k].item() == pytest.approx(expected, rel=1e-14)
    assert magnitude(torch.zeros(3, 2)).tolist() == [0.0, 0.0]  # all derivatives zero: no positive share, not nan


def test_bonferroni_multiplies_by_the_number_of_tests_and_caps_at_one():
    assert bonferroni(0.01, 4) == pytest.approx(0.04)
    assert bonferroni(0.4, 4) == 1.0
    assert math.isnan(bonferroni(float("nan"), 4))
