"""Seeds that a recorded episode carries implicitly, so any of its turns can be re-sampled.

A turn is fully determined by its episode's id, its prompt and the sampling parameters; the
seed is derived from the first two (`turn_seed`), so nothing needs to be stored per turn and
`plies replay` recomputes it from the record alone. Within an episode prompts only grow, so
the prompt length tells turns apart; episodes have unique ids, so members of one group draw
independently.
"""

from __future__ import annotations

import hashlib

from ._types import Completion, PolicyChoice, PolicyClient, PolicyClientBase, SamplingParams

__all__ = ["SeededPolicy", "turn_seed"]

SEED_BITS = 31
"""Every engine accepts a seed below 2**31 (vLLM, SGLang and the reference server)."""


def turn_seed(session: str, prompt_len: int) -> int:
    """The seed of the request that sampled after `prompt_len` prompt tokens in `session`."""
    digest = hashlib.sha256(f"{session}:{prompt_len}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (1 << SEED_BITS)


class SeededPolicy(PolicyClientBase):
    """A `PolicyClient` that seeds each request of an episode with `turn_seed`.

    Requests that name no session (the episode id), or that carry a seed already, pass
    through unchanged. The wrapped client stays its owner's to close.

    Example::

        harness = ToolCallingHarness(renderer, SeededPolicy(client), params)
    """

    def __init__(self, client: PolicyClient):
        self.client = client

    async def _draw(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        if session is not None and params.seed is None:
            params = params.model_copy(update={"seed": turn_seed(session, len(prompt))})
        return await self.client.sample(prompt, params, policy=policy, session=session)

    async def aclose(self) -> None:
        """Nothing to release: the wrapped client belongs to whoever opened it."""
