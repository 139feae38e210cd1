"""How sure a held-out evaluation is: a mean with its 95% interval, and a paired comparison.

An evaluation of a policy on held-out tasks is a sample, so its mean return comes with a
standard error (`mean_stderr`) and an interval (`ci95`). Two evaluations of one run (before
and after training) that play the same tasks pair up task by task (`paired_improvement`):
the tasks' own luck cancels out of the difference, so its interval is narrower than that of
two independent means.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["Z95", "ci95", "mean_stderr", "paired_improvement"]

Z95 = 1.96
"""A 95% normal-approximation interval is the mean +- Z95 standard errors."""


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (NaN where it cannot be estimated)."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, math.nan
    return mean, statistics.stdev(values, mean) / math.sqrt(len(values))


def ci95(mean: float, stderr: float) -> list[float] | None:
    """The 95% interval [low, high], rounded to 4 places, or None where the standard error
    is unknown."""
    if not (math.isfinite(mean) and math.isfinite(stderr)):
        return None
    return [round(mean - Z95 * stderr, 4), round(mean + Z95 * stderr, 4)]


def paired_improvement(
    before: list[float | None], after: list[float | None]
) -> tuple[float, float, int]:
    """Mean of after - before over the tasks both evaluations scored (None: not scored), its
    standard error, and how many tasks paired: the same tasks, so their luck cancels out."""
    diffs = [b - a for a, b in zip(before, after, strict=False) if a is not None and b is not None]
    mean, stderr = mean_stderr(diffs)
    return mean, stderr, len(diffs)
