"""plies.view: a recorded run, for people. `plies view RUN_DIR` and `plies replay`.

- `RunView` reads a run directory (`groups.jsonl`, `metrics.jsonl`, `summary.json`,
  `run.json`, `quarantine.json`) and renders one self-contained, offline HTML page: the run,
  its steps, groups and members, and every turn's tokens with mask and sampler logprob.
  Missing files, torn lines and records of older versions become sentences on the page.
- `write_page` writes that page; `plies view --live` serves it on 127.0.0.1 as the run grows.
- `plies replay --group` re-samples a recorded episode's turns on the reference server and
  says, turn by turn, whether tokens and logprobs came back equal; `plies replay --step`
  re-feeds a recorded training step's batch to a trainer restored at that step and compares
  every metric the run recorded (loss, ratios, KL, gradient norm).

It only reads run directories, so it sits above the core and beside the recipes.
"""

from .._exports import name_after as _name_after
from ._view import RunView as RunView
from ._view import write_page as write_page

__all__ = [
    "RunView",
    "write_page",
]

_name_after(__name__, globals())
