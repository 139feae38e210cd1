"""`plies.RetryPolicy` is the one retry policy of the clients plies owns: the native training
client's tries are bounded by its attempts as well as by `reconcile_timeout`, and a policy
client, which has no deadline, refuses a policy without attempts."""

from __future__ import annotations

import time

import pytest
from training_batches import random_batch

from plies import ConfigError, RetryPolicy, TrainingError
from plies.policy import VLLMClient
from plies.testing import closed_url
from plies.training import TrainingClient

pytestmark = pytest.mark.anyio


async def unreachable_after(retry: RetryPolicy, reconcile_timeout: float) -> float:
    """Seconds a forward_backward to a closed port took to give up."""
    started = time.monotonic()
    async with TrainingClient(
        closed_url(), retry=retry, reconcile_timeout=reconcile_timeout
    ) as trainer:
        with pytest.raises(TrainingError, match=r"unreachable; .* was not applied"):
            await trainer.forward_backward(random_batch(0, (6, 8), prompt=3))
    return time.monotonic() - started


async def test_the_training_client_stops_at_its_attempts_or_its_deadline():
    # Two attempts end it long before the 60 s deadline.
    assert (
        await unreachable_after(RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.01), 60) < 10
    )
    # Without a number of attempts, the deadline ends it, after trying for that long.
    took = await unreachable_after(
        RetryPolicy(attempts=None, initial_wait=0.01, max_wait=0.05), 1.0
    )
    assert 1.0 <= took < 10


def test_a_retry_policy_needs_a_bound_where_it_is_used():
    with pytest.raises(ConfigError, match="attempts must be >= 1 or None"):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError, match="needs a deadline"):
        RetryPolicy(attempts=None).retrying(ConnectionError)
    with pytest.raises(ConfigError, match="needs a number of attempts"):
        VLLMClient(closed_url(), "tiny", retry=RetryPolicy(attempts=None))
