"""plies.testing: what tests, benchmarks, examples and recipes share, shipped with plies.

- The offline model kit: a real Qwen3 tokenizer and a tiny random Qwen3 model, built from
  installed packages (no model hub) and cached (`qwen3_tokenizer_dir`, `tiny_model_dir`).
- `ScriptedPolicy`: a policy client that answers each turn from a script, rendered in the
  model's own tool-call format through the real tokenizer, so agents
  finish tasks through a real gateway with a tiny random model behind nothing; and
  `tiny_model_dir(max_positions=LONG_MAX_POSITIONS)` for the long prompts of agent CLIs.
- `serve_process` / `serve_process_sync`: start a server that prints one JSON ready line on
  stdout, hand it out as a `ServerProcess`, stop it on every path; `plies_command`
  spells `python -m plies ...` for this interpreter; `free_port` and `closed_url` name a
  loopback port to bind and a URL where nothing answers.
- `sandbox_processes`: the processes still labelled with a sandbox under a directory, the
  leak check after an episode or a Ctrl-C; `process_alive`: whether one pid still runs (a
  zombie does not).

It imports only the low layers, so users test their own envs against real servers the same
way plies tests itself.
"""

from .._exports import name_after as _name_after
from ._leaks import process_alive as process_alive
from ._leaks import sandbox_processes as sandbox_processes
from ._models import LONG_MAX_POSITIONS as LONG_MAX_POSITIONS
from ._models import qwen3_tokenizer_dir as qwen3_tokenizer_dir
from ._models import tiny_model_dir as tiny_model_dir
from ._scripted import ScriptedPolicy as ScriptedPolicy
from ._serve import ServerProcess as ServerProcess
from ._serve import closed_url as closed_url
from ._serve import free_port as free_port
from ._serve import plies_command as plies_command
from ._serve import serve_process as serve_process
from ._serve import serve_process_sync as serve_process_sync

__all__ = [
    "LONG_MAX_POSITIONS",
    "ScriptedPolicy",
    "ServerProcess",
    "closed_url",
    "free_port",
    "plies_command",
    "process_alive",
    "qwen3_tokenizer_dir",
    "sandbox_processes",
    "serve_process",
    "serve_process_sync",
    "tiny_model_dir",
]

_name_after(__name__, globals())
