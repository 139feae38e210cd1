"""A held-out evaluation's statistics: the mean's standard error and interval, and the paired
difference of two evaluations on the same tasks."""

from __future__ import annotations

import math

import pytest

from plies.rl import ci95, mean_stderr, paired_improvement


def test_the_improvement_pairs_hands_and_its_interval_is_narrower_than_unpaired():
    before = [-1.0, 1.0, -1.0, 0.0, 1.0, -1.0, None, 1.0]
    after = [-1.0, 1.0, 1.0, 0.0, 1.0, -1.0, 1.0, None]
    mean, stderr, n = paired_improvement(before, after)
    assert n == 6 and mean == pytest.approx(2 / 6)
    diffs = [0, 0, 2, 0, 0, 0]
    sd = math.sqrt(sum((d - 1 / 3) ** 2 for d in diffs) / 5)
    assert stderr == pytest.approx(sd / math.sqrt(6))


def test_the_standard_error_is_nan_where_it_cannot_be_estimated():
    assert math.isnan(mean_stderr([])[0])
    assert math.isnan(mean_stderr([1.0])[1])
    mean, stderr = mean_stderr([1.0, -1.0, 1.0, -1.0])
    assert mean == 0 and stderr == pytest.approx(math.sqrt(4 / 3) / 2)


def test_the_interval_is_none_where_the_standard_error_is_unknown():
    assert ci95(0.5, 0.1) == [round(0.5 - 0.196, 4), round(0.5 + 0.196, 4)]
    assert ci95(0.5, math.nan) is None and ci95(math.nan, 0.1) is None
