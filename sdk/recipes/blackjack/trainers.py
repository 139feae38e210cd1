"""Which trainer and sampler a run uses: plies' own wire, or the Tinker API.

- `native`: the embedded `plies serve`, driven by `TrainingClient` (training) and
  `VLLMClient` (sampling, publication by LoRA-style loading of each policy).
- `tinker`: `TinkerTrainingClient` and `TinkerPolicyClient`, against `--tinker-url` (or
  `TINKER_BASE_URL`), else the embedded `plies serve`'s Tinker API. The model trains every
  weight, as on the native path, so one learning rate means the same steps; each
  `save_policy` is a training checkpoint plus sampler weights, and a resumed run starts
  from the checkpoint of the last policy in the run log (`resume_from`), so no step is
  applied twice along the run's policies. Only the two newest training checkpoints are
  kept (a resume needs the last logged one; a crash may leave one newer than that).

Everything else in the recipe sees only the `Trainer` protocol and a sampler that is a
`PolicyClient` and a `PolicyLoader`.
"""

from __future__ import annotations

import os
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from anyio.abc import Process
from rich.console import Console

from plies import ConfigError, PolicyError, PolicyRef, TrainingError
from plies.policy import TinkerPolicyClient, VLLMClient
from plies.rl import last_policy
from plies.testing import ServerProcess
from plies.training import TinkerTrainingClient, Trainer, TrainingClient

from .config import DemoConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

__all__ = ["Clients", "Serving", "open_clients"]

Serving = AbstractAsyncContextManager[ServerProcess[Process]]
"""A server started on entry and stopped on exit (`open_clients` starts `plies serve` so)."""

LOCAL_KEY = "tml-local"
"""The API key sent to the embedded server (the SDK insists on a `tml-` key; it ignores it)."""


@dataclass(frozen=True, slots=True)
class Clients:
    """The run's trainer and sampler, and the policy it starts from (the base model)."""

    trainer: Trainer
    sampler: VLLMClient | TinkerPolicyClient
    base: PolicyRef


async def open_clients(
    config: DemoConfig,
    stack: AsyncExitStack,
    *,
    server: Callable[[], Serving],
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    console: Console,
) -> Clients:
    """Open the trainer and sampler `config.trainer` names, on `stack`.

    `server()` is the embedded `plies serve`, started only when something uses it.
    """
    url = config.tinker_url or os.environ.get("TINKER_BASE_URL")
    if config.trainer == "native" or url is None:
        running = await stack.enter_async_context(server())
        console.print(f"reference server at {running.url}")
        if config.trainer == "native":
            trainer = await stack.enter_async_context(TrainingClient(running.url))
            sampler = await stack.enter_async_context(
                VLLMClient(running.url, running.ready["model"])
            )
            return Clients(trainer, sampler, PolicyRef.model_validate(running.ready["policy"]))
        url, key = running.url, LOCAL_KEY
    else:
        key = os.environ.get("TINKER_API_KEY")
    base_model = model_dir.name  # what `plies serve` names the model by default
    resume = last_policy(config.out, kinds=("step", "warm_start"))  # the newest of either
    console.print(
        f"Tinker service at {url}, base model {base_model}"
        + (f", resuming from {resume.uri}" if resume else "")
    )
    try:
        trainer = await stack.enter_async_context(
            TinkerTrainingClient(
                url, base_model=base_model, api_key=key, resume_from=resume, keep_checkpoints=2
            )
        )
        sampler = await stack.enter_async_context(
            TinkerPolicyClient(
                url, base_model=base_model, api_key=key, eos_token_ids=[tokenizer.eos_token_id]
            )
        )
    except (TrainingError, PolicyError) as exc:  # a wrong URL or key: one line at the CLI
        raise ConfigError(f"--trainer tinker: {exc}") from exc
    return Clients(trainer, sampler, sampler.base)
