"""The run's outputs for people: `summary.json` and `learning_curve.png`, from the run log."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .config import ALWAYS_STAND_RETURN, OPTIMAL_RETURN, RANDOM_RETURN, DemoConfig
from .runlog import RunLog

__all__ = ["plot_curve", "write_summary"]


def write_summary(config: DemoConfig, log: RunLog, seconds: float) -> dict[str, Any]:
    """Write `summary.json` and the learning curve; `seconds` is the run's total wall time.

    Everything comes from the run log, so a resumed run's summary covers all its sessions.
    """
    evals = log.all("eval")
    warm = next((e for e in evals if e["label"] == "warm_start"), None)
    final = next((e for e in evals if e["label"] == "final"), None)
    steps = log.all("step")
    warm_start = log.last("warm_start")
    summary = {
        "config": config.key(),
        "warm_start_return": warm["return"] if warm else None,
        "final_return": final["return"] if final else None,
        "improvement": (final["return"] - warm["return"]) if warm and final else None,
        "eval_hands": final["hands"] if final else (warm["hands"] if warm else 0),
        "ill_formed": {
            "warm_start": warm["ill_formed"] if warm else None,
            "final": final["ill_formed"] if final else None,
        },
        "minutes": round(seconds / 60, 2),
        "policies": len(
            {s["policy"]["version"] for s in steps}
            | ({warm_start["policy"]["version"]} if warm_start else set())
        ),
        "grpo_steps": len(steps),
        "complete": final is not None,
        "references": {
            "random": RANDOM_RETURN, "always_stand": ALWAYS_STAND_RETURN, "optimal": OPTIMAL_RETURN,
        },
    }  # fmt: skip
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_curve(evals, config.out / "learning_curve.png")
    return summary


def plot_curve(evals: Iterable[dict[str, Any]], path: Path) -> None:
    """Evaluation return per step against the random, always-stand and optimal references."""
    import matplotlib  # heavy, and only needed here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted((e["step"], e["return"], e["hands"]) for e in evals)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="C0",
                label="evaluation return")  # fmt: skip
        for step, ret, hands in points:
            ax.annotate(f"{hands}", (step, ret), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)  # fmt: skip
    for value, name, style in (
        (RANDOM_RETURN, "random", ":"),
        (ALWAYS_STAND_RETURN, "always stand", "--"),
        (OPTIMAL_RETURN, "optimal", "-."),
    ):
        ax.axhline(value, linestyle=style, color="grey", linewidth=1)
        ax.text(0, value, f" {name} ({value})", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("GRPO step (0 = warm start)")
    ax.set_ylabel("mean return per hand")
    ax.set_title("Blackjack GRPO, tiny Qwen3 (labels: hands evaluated)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
