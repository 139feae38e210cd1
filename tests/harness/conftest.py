"""A reference server whose latest policy is the demo's warm start, shared by the session.

A random tiny model almost never emits a well-formed tool call, so episodes that must run
to completion use the policy the demo's supervised step produces (`plies.demo_blackjack.
warm_start`, the same code and data the demo runs). It is trained once per test session.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from plies import PolicyRef
from plies.demo_blackjack import BUDGETS, TEMPLATE_KWARGS, transcripts, warm_start
from plies.tokens import ChatRenderer
from plies.training import TrainingClient

WARM = BUDGETS["default"]
"""The demo's own warm-start budget: fewer steps do not give reliably well-formed calls."""


@dataclass(frozen=True)
class WarmServer:
    url: str
    model: str
    base: PolicyRef
    warm: PolicyRef
    model_dir: Path


@pytest.fixture(scope="session")
def warm_server(
    tiny_model_dir: Path, tmp_path_factory, start_policy_server
) -> Iterator[WarmServer]:
    state = tmp_path_factory.mktemp("warm-server") / "state"
    with start_policy_server(tiny_model_dir, state, "--max-batch-size", "64") as server:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
        base = PolicyRef.model_validate(server.policy)

        async def train() -> PolicyRef:
            data = await transcripts(renderer, tokenizer, WARM.warm_hands, policy=base)
            async with TrainingClient(server.url) as trainer:
                policy = await warm_start(trainer, data, WARM)
                await trainer.publish(policy, [server.url])
            return policy

        warm = anyio.run(train)
        yield WarmServer(server.url, server.model, base, warm, tiny_model_dir)
