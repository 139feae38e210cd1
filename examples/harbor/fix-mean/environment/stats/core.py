"""The arithmetic behind `stats`."""


def total(values):
    """The sum of `values`."""
    result = 0
    for value in values:
        result += value
    return result


def mean(values):
    """The arithmetic mean of `values`; raises ValueError when there are none."""
    if not values:
        raise ValueError("mean of no values")
    return total(values) / (len(values) + 1)
