"""The per-model `seq_id` queue: in order, out-of-order arrivals held, gaps fail late ops, a
seq_id far ahead refused; settled results kept within a byte budget."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from plies.server._tinker._errors import TinkerRequestError
from plies.server._tinker._futures import MAX_AHEAD, Futures, WorkQueue


@asynccontextmanager
async def running(
    *, gap_seconds: float, first_seq: int = 0
) -> AsyncIterator[tuple[Futures, WorkQueue]]:
    """A queue for model `m` whose worker runs for the block, and the futures it settles."""
    futures = Futures()
    work = WorkQueue(futures, gap_seconds=gap_seconds)
    work.open("m", first_seq=first_seq)
    async with anyio.create_task_group() as tg:
        await tg.start(work.run)
        yield futures, work
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_ops_run_in_seq_order_and_repeats_get_the_same_request_id():
    ran: list[int] = []

    def op(k: int):
        return lambda: ran.append(k) or {"k": k}

    async with running(gap_seconds=5) as (futures, work):
        rids = {k: work.submit("m", k, f"d{k}", op(k)) for k in (2, 3, 1)}
        assert work.submit("m", 2, "d2", op(2)) == rids[2]  # same body: the same future
        with pytest.raises(Exception, match="already used"):
            work.submit("m", 2, "other", op(2))
        work.submit("m", 0, "d0", None)  # refused at submit: consumes seq 0 only
        results = [await futures.wait(rids[k], 5) for k in (1, 2, 3)]
    assert ran == [1, 2, 3]
    assert results == [{"k": 1}, {"k": 2}, {"k": 3}]


@pytest.mark.anyio
async def test_a_seq_id_that_never_arrives_fails_the_ops_behind_it():
    async with running(gap_seconds=0.2, first_seq=1) as (futures, work):
        late = work.submit("m", 3, "d3", lambda: {"ok": True})
        result = await futures.wait(late, 5)
        after = work.submit("m", 4, "d4", lambda: {"ok": True})  # the queue moved on
        assert await futures.wait(after, 5) == {"ok": True}
    assert "seq_id 1 of model m never arrived" in result["error"]


@pytest.mark.anyio
async def test_a_seq_id_far_ahead_is_refused_and_never_moves_the_queue():
    async with running(gap_seconds=0.2, first_seq=1) as (futures, work):
        for stray in (2**31 - 1, 1 + MAX_AHEAD + 1):
            with pytest.raises(TinkerRequestError, match=f"seq_id {stray} of model m is more"):
                work.submit("m", stray, "stray", None)
        await anyio.sleep(0.5)  # past the gap: a queued stray would have moved the queue
        ran = work.submit("m", 1, "d1", lambda: {"ok": 1})
        assert await futures.wait(ran, 5) == {"ok": 1}
        # Ops numbered one by one may run far ahead of the worker: the window follows them.
        rids = [work.submit("m", k, f"d{k}", lambda: {"ok": 1}) for k in range(2, 2 + 3000)]
        assert await futures.wait(rids[-1], 30) == {"ok": 1}


def test_settled_results_are_kept_within_a_byte_budget():
    futures = Futures(keep_bytes=10 << 20)
    rids = [futures.create() for _ in range(4)]
    for rid in rids:
        futures.settle(rid, b"x" * (4 << 20))
    with pytest.raises(TinkerRequestError, match="unknown request_id"):
        anyio.run(futures.wait, rids[0], 0.01)
    assert anyio.run(futures.wait, rids[-1], 0.01) == b"x" * (4 << 20)
