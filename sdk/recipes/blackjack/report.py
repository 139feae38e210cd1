"""The run's outputs for people: `summary.json`, `learning_curve.png` and `strategy.png`.

Everything comes from the run log, so a resumed run's summary covers all its sessions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plies import rl
from plies.environments.blackjack_exact import (
    ALWAYS_STAND_RETURN,
    HARD_TOTALS,
    OPTIMAL_RETURN,
    RANDOM_RETURN,
    REFERENCES,
    SOFT_TOTALS,
    UP_CARDS,
    difference,
    expected_return,
    on_deals,
    optimal_hits,
    price_record,
    strategy_table,
)
from plies.rl import RunLog, ci95, paired_improvement

from .config import EVAL_SEEDS, DemoConfig

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "disk_bytes",
    "exact_figures",
    "plot_strategy",
    "print_result",
    "result_lines",
    "write_summary",
]


def _scored(record: dict[str, Any]) -> int:
    """Episodes an evaluation scored (`hands` in run logs written before `plies.rl.evaluate`)."""
    return record["episodes"] if "episodes" in record else record["hands"]


def _eval_interval(record: dict[str, Any] | None) -> list[float] | None:
    return None if record is None else ci95(record["return"], record.get("stderr", math.nan))


def write_summary(config: DemoConfig, log: RunLog) -> dict[str, Any]:
    """Write `summary.json`, the learning curve and the strategy grid."""
    evals = log.all("eval")
    warm = next((e for e in evals if e["label"] == "warm_start"), None)
    final = next((e for e in evals if e["label"] == "final"), None)
    steps = log.all("step")
    warm_start = log.last("warm_start")
    improvement: float | None = None
    improvement_ci: list[float] | None = None
    paired = 0
    if warm and final and "rewards" in warm and "rewards" in final:
        mean, stderr, paired = paired_improvement(warm["rewards"], final["rewards"])
        if paired:
            improvement, improvement_ci = round(mean, 4), ci95(mean, stderr)
    latest = final or warm
    summary = {
        "config": config.key(),
        **exact_figures(warm, final),
        "warm_start_return": warm["return"] if warm else None,
        "warm_start_ci95": _eval_interval(warm),
        "final_return": final["return"] if final else None,
        "final_ci95": _eval_interval(final),
        "improvement": improvement,
        "improvement_ci95": improvement_ci,
        "paired_hands": paired,
        "eval_hands": _scored(latest) if latest else 0,
        "ill_formed": {
            "warm_start": warm["ill_formed"] if warm else None,
            "final": final["ill_formed"] if final else None,
        },
        "truncated": {
            "warm_start": warm.get("truncated") if warm else None,
            "final": final.get("truncated") if final else None,
        },
        "stand_rate": {
            "warm_start": warm["stand_rate"] if warm else None,
            "final": final["stand_rate"] if final else None,
        },
        "minutes": round(sum(r["seconds"] for r in log.all("session")) / 60, 2),
        "policies": len(
            {s["policy"]["version"] for s in steps}
            | ({warm_start["policy"]["version"]} if warm_start else set())
        ),
        "grpo_steps": len(steps),
        "skipped_steps": len(log.all("skipped")),
        "complete": final is not None,
        "references": {name: round(expected_return(p), 4) for name, p in REFERENCES.items()},
        "references_on_held_out": _on_held_out(latest),
        "strategy": None,
    }  # fmt: skip
    if latest is not None and "decisions" in latest:
        summary["strategy"] = {
            "policy": "final" if final else "warm_start",
            "how": "hit share of the held-out evaluation's decisions, per cell",
            **strategy_table(tuple(d) for d in latest["decisions"]),
        }
        plot_strategy(summary["strategy"], config.out / "strategy.png")
    rl.plot_curve(
        [{**e, "episodes": _scored(e)} for e in evals],
        config.out / "learning_curve.png",
        references={"random": RANDOM_RETURN, "always stand": ALWAYS_STAND_RETURN,
                    "optimal": OPTIMAL_RETURN},
        title="Blackjack GRPO, tiny Qwen3 (labels: hands evaluated)",
        xlabel="GRPO step (0 = warm start)",
        ylabel="mean return per hand",
    )  # fmt: skip
    summary["disk_mb"] = round(disk_bytes(config.out) / 1e6, 1)  # the figures included
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def exact_figures(
    warm: dict[str, Any] | None, final: dict[str, Any] | None
) -> dict[str, float | list[float] | None]:
    """The headline: each evaluation's decision shares priced exactly
    (`blackjack_exact.price`), with 95% intervals for how well the evaluation measured them,
    and GRPO's improvement so priced."""
    priced = {
        label: None if record is None else price_record(record)
        for label, record in (("warm_start", warm), ("final", final))
    }
    if priced["warm_start"] is not None and priced["final"] is not None:
        priced["improvement"] = difference(priced["final"], priced["warm_start"])
    else:
        priced["improvement"] = None
    out: dict[str, float | list[float] | None] = {}
    for label, value in priced.items():
        out[f"{label}_exact"] = None if value is None else round(value.value, 4)
        out[f"{label}_exact_ci95"] = None if value is None else ci95(value.value, value.stderr)
    return out


def _on_held_out(record: dict[str, Any] | None) -> dict[str, float] | None:
    """The reference policies' expected reward on the deals `record` scored (its rewards by
    index): what those deals were worth to them, to read the sampled return against."""
    if record is None or "rewards" not in record:
        return None
    seeds = [EVAL_SEEDS + i for i, reward in enumerate(record["rewards"]) if reward is not None]
    return {name: round(on_deals(p, seeds), 4) for name, p in REFERENCES.items()}


def result_lines(summary: dict[str, Any], out: Path) -> list[str]:
    """What the terminal shows at the end: the policies priced exactly (the headline), the
    sampled before/after result beside what the same deals gave the references, where the
    run is and how big, how to look at it, and the files written (always the last line)."""

    def ret(value: float | None, ci: list[float] | None) -> str:
        if value is None:
            return "not evaluated"
        return f"{value:+.3f}" + (f" (95% CI {ci[0]:+.3f} to {ci[1]:+.3f})" if ci else "")

    def refs(values: dict[str, float]) -> str:
        return ", ".join(f"{name.replace('_', ' ')} {v:+.3f}" for name, v in values.items())

    final, warm = summary["final_exact"], summary["warm_start_exact"]
    lines = [
        f"priced exactly, per hand: final {ret(final, summary['final_exact_ci95'])}, "
        f"warm start {ret(warm, summary['warm_start_exact_ci95'])}; "
        f"references {refs(summary['references'])}",
    ]
    if summary["improvement_exact"] is not None:
        lines.append(
            "improvement on the warm start, priced exactly: "
            + ret(summary["improvement_exact"], summary["improvement_exact_ci95"])
        )
    sampled = (
        f"sampled on {summary['eval_hands']} held-out hands: "
        f"final {ret(summary['final_return'], summary['final_ci95'])}, "
        f"warm start {ret(summary['warm_start_return'], summary['warm_start_ci95'])}"
    )
    if summary["references_on_held_out"]:
        sampled += f"; the same deals played by {refs(summary['references_on_held_out'])}"
    lines.append(sampled)
    if summary["improvement"] is not None:
        ci = summary["improvement_ci95"]
        span = f" (95% CI {ci[0]:+.3f} to {ci[1]:+.3f})" if ci else ""
        lines.append(
            f"sampled improvement {summary['improvement']:+.3f}{span}, "
            f"paired on {summary['paired_hands']} hands"
        )
    steps = f"{summary['grpo_steps']} GRPO steps"
    if summary.get("skipped_steps"):
        steps += f" (and {summary['skipped_steps']} batches that trained nothing, not counted)"
    lines.append(
        f"{steps} in {summary['minutes']:.1f} min; {out} holds {summary['disk_mb']:.0f} MB"
    )
    lines.append(f"look at it: plies view {out}  (one HTML page: curve, steps, every episode)")
    names = ("summary.json", "learning_curve.png", "strategy.png", "metrics.jsonl", "groups.jsonl")
    lines.append(f"wrote in {out}: " + ", ".join(n for n in names if (out / n).exists()))
    return lines


def print_result(console: Console, summary: dict[str, Any], out: Path) -> None:
    """`result_lines` under a rule titled by whether the run is complete."""
    title = "result" if summary["complete"] else "result so far (run the command again to finish)"
    console.rule(f"[bold]{title}", align="left")
    for line in result_lines(summary, out):
        console.print(line, soft_wrap=True, highlight=False)


def disk_bytes(path: Path) -> int:
    """Bytes in the files under `path` (links not followed): what a run takes on disk."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile (a pruned policy)
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def plot_strategy(table: dict[str, Any], path: Path) -> None:
    """The classic chart: learned hit share per (total, up card) beside the optimal hit/stand.

    Hard totals on top, soft below; a learned cell is coloured by how often the policy hit
    there (blank: never visited) and shows the number of decisions behind it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    heights = {"height_ratios": [len(HARD_TOTALS), len(SOFT_TOTALS)]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 9), gridspec_kw=heights)
    cols = ["A" if u == 1 else str(u) for u in UP_CARDS]
    for row, (kind, totals) in enumerate((("hard", HARD_TOTALS), ("soft", SOFT_TOTALS))):
        cells = table[kind]
        learned = np.full((len(totals), len(cols)), np.nan)
        optimal = np.zeros((len(totals), len(cols)))
        for i, player in enumerate(totals):
            for j, up in enumerate(UP_CARDS):
                rate = cells[str(player)][cols[j]]["hit_rate"]
                learned[i, j] = np.nan if rate is None else rate
                optimal[i, j] = optimal_hits(player, up, kind == "soft")
        for col, (grid, title) in enumerate(
            ((learned, f"learned ({table['policy']}), {kind}: hit share"),
             (optimal, f"optimal, {kind}"))
        ):  # fmt: skip
            ax = axes[row][col]
            ax.imshow(grid, cmap="RdYlGn_r", vmin=0, vmax=1, aspect="auto")
            for i, player in enumerate(totals):
                for j in range(len(cols)):
                    if col == 1:
                        text = "H" if grid[i, j] else "S"
                    else:
                        n = cells[str(player)][cols[j]]["decisions"]
                        text = "" if n == 0 else f"{grid[i, j]:.1f}\n{n}"
                    ax.text(j, i, text, ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(cols)), cols)
            ax.set_yticks(range(len(totals)), [("A+" + str(t - 11)) if kind == "soft" else str(t)
                                               for t in totals])  # fmt: skip
            ax.set_xlabel("dealer up card")
            ax.set_ylabel("player total")
            ax.set_title(title, fontsize=9)
    fig.suptitle("Blackjack strategy: red = hit, green = stand (learned cells: share, decisions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
