"""The learning curve: each held-out evaluation's mean return by step, with its 95% band.

Drawn from the run log's `eval` records alone, so a resumed run's curve covers every session,
and any run directory that follows the schema (docs/rl.md) can be drawn again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._stats import Z95

__all__ = ["plot_curve"]

_REFERENCE_STYLES = (":", "--", "-.", (0, (1, 4)))


def plot_curve(
    evals: Iterable[Mapping[str, Any]],
    path: Path,
    *,
    references: Mapping[str, float] | None = None,
    title: str = "GRPO: held-out return (labels: episodes scored)",
    xlabel: str = "GRPO step (0: before the first)",
    ylabel: str = "mean return",
) -> None:
    """Write a PNG of each evaluation's return against its step, its 95% band shaded.

    Args:
        evals: `eval` records of a run log (`return`, `step`, `episodes`, `stderr`); each
            point is labelled with the episodes it scored.
        references: returns to draw as level lines, by name (known policies, say).
    """
    import matplotlib  # heavy, and only needed here

    matplotlib.use("Agg")  # no display: a file, on any machine
    import matplotlib.pyplot as plt

    points = sorted(
        (e["step"], e["return"], e["episodes"], e.get("stderr", math.nan))
        for e in evals
        if e.get("return") is not None and math.isfinite(e["return"])
    )
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if points:
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], "o-", color="C0", label="evaluation return")
        band = [(x, r, Z95 * se) for x, r, _, se in points if math.isfinite(se)]
        if band:
            ax.fill_between(
                [b[0] for b in band],
                [b[1] - b[2] for b in band],
                [b[1] + b[2] for b in band],
                color="C0",
                alpha=0.2,
                label="95% confidence",
            )
        for step, value, episodes, _ in points:
            ax.annotate(
                str(episodes), (step, value), textcoords="offset points", xytext=(0, 6),
                ha="center", fontsize=7,
            )  # fmt: skip
    for index, (name, value) in enumerate((references or {}).items()):
        style = _REFERENCE_STYLES[index % len(_REFERENCE_STYLES)]
        ax.axhline(value, linestyle=style, color="grey", linewidth=1)
        ax.text(0, value, f" {name} ({value})", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if points:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
