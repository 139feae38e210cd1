"""Reinforcement learning on any env: one resumable GRPO loop and its run directory.

`train` is the whole loop for a script: give it a config, the tasks, an env factory, an
episode (`ToolCallingHarness.play` or an agent harness's), a trainer and a sampler, and it
trains in a run directory that the same call resumes after Ctrl-C or a crash (a trainer that
keeps no weights between sessions, as on the Tinker API, is opened from `last_policy(out)`).
Recipes that own more of the run (a warm start, evaluations, a report) call `grpo` with their
own `Run` (its log opened and timed by `run_session`), and use what such a run needs besides:
a held-out evaluation's mean and 95% interval (`mean_stderr`, `ci95`) and the paired
comparison of two (`paired_improvement`), the learning curve of its evaluations
(`plot_curve`), and pruning the policies a run published (`retain`, wherever they are kept).
docs/rl.md describes the loop and the run directory's schema.
"""

from .._exports import name_after as _name_after
from ._curve import plot_curve as plot_curve
from ._evaluate import evaluate as evaluate
from ._evaluate import play_tasks as play_tasks
from ._grpo import GRPOConfig as GRPOConfig
from ._grpo import Interrupted as Interrupted
from ._grpo import Run as Run
from ._grpo import grpo as grpo
from ._grpo import train_on as train_on
from ._progress import RunProgress as RunProgress
from ._repeat import REPEATS as REPEATS
from ._repeat import played as played
from ._repeat import repeat_certain as repeat_certain
from ._retention import retain as retain
from ._runlog import RunLog as RunLog
from ._session import run_session as run_session
from ._stats import ci95 as ci95
from ._stats import mean_stderr as mean_stderr
from ._stats import paired_improvement as paired_improvement
from ._step import train_step as train_step
from ._train import RUN_SCHEMA as RUN_SCHEMA
from ._train import last_policy as last_policy
from ._train import remove_run_dir as remove_run_dir
from ._train import train as train

__all__ = [
    "REPEATS",
    "RUN_SCHEMA",
    "GRPOConfig",
    "Interrupted",
    "Run",
    "RunLog",
    "RunProgress",
    "ci95",
    "evaluate",
    "grpo",
    "last_policy",
    "mean_stderr",
    "paired_improvement",
    "play_tasks",
    "played",
    "plot_curve",
    "remove_run_dir",
    "repeat_certain",
    "retain",
    "run_session",
    "train",
    "train_on",
    "train_step",
]

_name_after(__name__, globals())
