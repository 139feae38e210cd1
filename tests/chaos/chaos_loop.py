"""The small real loop the chaos suite injects faults into: sample, play, write, train, publish.

    python chaos_loop.py RUN_DIR CONFIG_JSON

A `RolloutDriver` plays Blackjack hands in local sandboxes (`SandboxedBlackjackEnv` on a
`LocalProcessBackend`: every move runs the game script in the episode's own sandbox), sampling
from a `plies serve` through `VLLMClient`. Complete groups are fsynced to `groups.jsonl`; every
`GROUPS_PER_STEP` groups make one GRPO step on the same server's trainer (`TrainingClient`),
whose new policy is saved and published before later groups are admitted under it. Each step
is announced in `log.jsonl` before its first op is sent and its op ids derive from the run id
and the step, so a run cut off anywhere resumes (the same command) and replays the cut-off
step exactly once. The loop runs under `plies.runtime.run`: Ctrl-C and SIGTERM drain, cancel
or abort as in production.

The random tiny model never writes a well-formed tool call, so the episode maps sampled ids to
moves itself (the parity of a turn's first sampled id: hit or stand) and the prompts are a few
ids that encode the cards; the sampler, its logprobs, the sandbox, the rewards and the training
are the real ones. `CONFIG_JSON` may also arm two faults that live inside this process: the
sink's disk filling up (`enospc`: after `writes` whole writes to `groups.jsonl`, the next one
is cut short at `fraction` of its bytes and every later one fails with ENOSPC, as `write(2)`
behaves on a full disk) and a hung env teardown (`hang_teardown`: the teardown of the `nth`
env never returns, on every retry when `forever`).

Events go to stdout as JSON lines: ready, step_begin, step, group (after the sink
wrote it) and stats, in `finally`.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import os
import random
import signal
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # event_script

import anyio
from event_script import emit, lease_counts
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from plies import (
    AdmissionClosed,
    Group,
    PliesError,
    PolicyOutcomeUnknown,
    PolicyRef,
    PolicyResponseError,
    PolicyUnavailable,
    RetryPolicy,
    TrainingGradientsLost,
    Trajectory,
    Turn,
)
from plies.environments import LocalProcessBackend, SandboxedBlackjackEnv, Task
from plies.policy import (
    SamplingParams,
    Timeout,
    VLLMClient,
    publish,
)
from plies.policy._vllm import unload_lora_adapter
from plies.runtime import (
    EnvPool,
    EpisodeContext,
    GroupSpec,
    Interrupts,
    JsonlSink,
    RolloutDriver,
    RolloutResources,
    read_jsonl,
    run,
)
from plies.testing._models import VOCAB_SIZE
from plies.training import (
    AdamParams,
    TrainingClient,
    grpo_advantages,
    training_batch,
    training_groups,
)

GROUP_SIZE = 4
GROUPS_PER_STEP = 2
MAX_STALENESS = 2
"""Policy versions a trained group may lag; the driver admits that many steps ahead."""
MAX_TURNS = 4
"""The last allowed turn stands, so every hand ends."""
SAMPLING = SamplingParams(max_tokens=2, temperature=1.0)
LR = 1e-3
PUBLISH_WITHIN_S = 90.0
"""How long a publish keeps trying while the server restarts (a kill -9 fault)."""
# Prompt ids: a card fact is an offset into an id range; all well inside the vocabulary.
PLAYER, DEALER, ACE, TURN_MARK = 1000, 1100, 1200, 1300


def facts(info: dict[str, Any]) -> list[int]:
    """The prompt ids of a game state: the player's total, the dealer's up card, a usable ace."""
    return [PLAYER + info["player_total"], DEALER + info["dealer_up"], ACE + info["usable_ace"]]


class Prompt:
    """A prompt delta in the shape `Turn.from_completion` reads."""

    def __init__(self, ids: list[int], extends: bool):
        self.ids = ids
        self.extends = extends


# -- the faults that live in this process ------------------------------------------------------


def fill_disk_at(path: Path, writes: int, fraction: float) -> None:
    """Make `write(2)` to `path` behave as on a disk that fills up after `writes` writes.

    `os.write` is wrapped for that one file (found by the path its descriptor names); the
    sink's own code runs unchanged and meets a short write, then ENOSPC, as on a full disk.
    """
    real_write = os.write
    target = str(path.resolve())
    seen = itertools.count()
    full = False

    def write(fd: int, data: Any) -> int:
        nonlocal full
        try:
            ours = os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            ours = False
        if not ours:
            return real_write(fd, data)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if next(seen) < writes:
            return real_write(fd, data)
        full = True
        cut = int(len(data) * fraction)
        if cut == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, memoryview(data)[:cut])

    os.write = write


def teardown_with_hang(nth: int, forever: bool) -> Callable[[SandboxedBlackjackEnv], Any]:
    """The pool's teardown: `env.close()`, except for the `nth` env, whose teardown hangs
    (a remote call that never answers) once, or on every retry when `forever`."""
    numbers: weakref.WeakKeyDictionary[SandboxedBlackjackEnv, int] = weakref.WeakKeyDictionary()
    attempts: dict[int, int] = {}
    order = itertools.count(1)

    async def teardown(env: SandboxedBlackjackEnv) -> None:
        if env not in numbers:
            numbers[env] = next(order)
        number = numbers[env]
        attempts[number] = attempts.get(number, 0) + 1
        if number == nth and (forever or attempts[number] == 1):
            emit("teardown_hangs", sandbox=env.sandbox_id, attempt=attempts[number])
            await anyio.sleep_forever()
        await env.close()

    return teardown


def dump_tasks() -> None:
    """Print every task's chain of awaits (innermost last) on stderr."""
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()}:", file=sys.stderr)
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                print(
                    f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}",
                    file=sys.stderr,
                )
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    sys.stderr.flush()


# -- the loop -------------------------------------------------------------------------------------


class Loop:
    """One run (or resumed run) of the loop in `run_dir`."""

    def __init__(self, run_dir: Path, config: dict[str, Any], interrupts: Interrupts):
        self.dir = run_dir
        self.config = config
        self.interrupts = interrupts
        self.run_id = run_dir.name
        self.rng = random.Random(config["seed"])
        self.log_path = run_dir / "log.jsonl"
        log = read_jsonl(self.log_path)
        if log.malformed:
            raise PliesError(f"{self.log_path} is damaged: {log.malformed}")
        self.log = log.records
        self.policy = PolicyRef.model_validate(config["base"])
        for record in self.log:
            if record["kind"] == "step":
                self.policy = PolicyRef.model_validate(record["policy"])

    def record(self, sink: JsonlSink, kind: str, **fields: Any) -> None:
        record = {"kind": kind, **fields}
        sink.write(record, sync=True)
        self.log.append(record)
        emit(kind, **fields)

    async def main(self) -> None:
        # A run that hangs is killed by the suite, which first asks it where its tasks are.
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
        config = self.config
        groups_path = self.dir / "groups.jsonl"
        on_disk = read_jsonl(groups_path, Group)
        if on_disk.malformed:
            raise PliesError(f"{groups_path} holds malformed lines: {on_disk.malformed}")
        trained = {g for r in self.log if r["kind"] == "step" for g in r["groups"]}
        waiting = [g for g in on_disk.records if g.id not in trained]
        steps_done = sum(r["kind"] == "step" for r in self.log)
        begun = [r for r in self.log if r["kind"] == "step_begin" and r["step"] == steps_done]
        if begun:  # a step was cut off: replay it on the same groups, with the same op ids
            chosen = begun[-1]["groups"]
            waiting = [g for g in waiting if g.id in chosen] + [
                g for g in waiting if g.id not in chosen
            ]
        indices = [int(g.task_id.removeprefix("hand-")) for g in on_disk.records]
        first_index = max(indices, default=-1) + 1
        if config.get("enospc"):
            fill_disk_at(groups_path, **config["enospc"])
        hang = config.get("hang_teardown")
        teardown = teardown_with_hang(**hang) if hang else None

        backend = LocalProcessBackend(Path(config["sandboxes"]))

        async def make_env() -> SandboxedBlackjackEnv:
            return SandboxedBlackjackEnv(
                backend, run_id=self.run_id, python=config["python"], command_timeout_s=10
            )

        pool = EnvPool(
            make_env,
            teardown=teardown,
            limit=GROUP_SIZE * GROUPS_PER_STEP * MAX_STALENESS * 2,
            settle_timeout=1.0,
            teardown_timeout=1.0,
            teardown_retries=2,
            retry_backoff=0.2,
        )
        sampler = VLLMClient(
            config["sampler"],
            config["model"],
            timeout=Timeout(connect=2.0, read=config.get("sample_timeout_s", 20.0)),
            retry=RetryPolicy(attempts=8, initial_wait=0.2, max_wait=2.0, down_for=0.5),
        )
        report = self.dir / f"quarantine-{config['attempt']}.json"
        resources = RolloutResources(
            sampler=sampler, pools=[pool], report_path=report, run_id=self.run_id, exit_grace=2
        )
        driver: RolloutDriver | None = None
        written = 0
        try:
            async with (
                sampler,
                TrainingClient(config["trainer"], timeout=60, reconcile_timeout=90) as trainer,
                resources,
            ):
                with JsonlSink(self.log_path) as log_sink, JsonlSink(groups_path) as sink:
                    driver = RolloutDriver(
                        resources,
                        self.episode,
                        policy=self.policy,
                        max_groups_in_flight=GROUPS_PER_STEP * MAX_STALENESS,
                        sink=sink,
                    )
                    async with driver:
                        self.interrupts.attach(driver)
                        emit(
                            "ready",
                            policy=self.policy.model_dump(),
                            steps_done=steps_done,
                            waiting=[g.id for g in waiting],
                            first_index=first_index,
                        )
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self.admit, driver, first_index)
                            step = steps_done
                            async for group in driver.groups():
                                written += 1
                                emit("group", id=group.id, task_id=group.task_id)
                                if self.interrupts.count or step >= config["steps"]:
                                    continue  # drained groups are on disk; a resume trains them
                                waiting.append(group)
                                while len(waiting) >= GROUPS_PER_STEP and step < config["steps"]:
                                    if self.interrupts.count:
                                        break
                                    batch = waiting[:GROUPS_PER_STEP]
                                    waiting = waiting[GROUPS_PER_STEP:]
                                    await self.step(log_sink, trainer, sampler, driver, step, batch)
                                    step += 1
                                if step >= config["steps"]:
                                    driver.close_admission()
        finally:
            stats: dict[str, Any] = {"written": written}
            if driver is not None:
                poll = driver.statistics()
                stats.update(
                    groups_complete=poll.groups_complete,
                    admitted=poll.admitted,
                    settled={k.value: v for k, v in poll.settled.items()},
                    **lease_counts(poll.leases),
                )
            emit("stats", **stats)

    async def admit(self, driver: RolloutDriver, first: int) -> None:
        for index in itertools.count(first):
            task_id = f"hand-{index}"
            seed = self.config["seed"] * 1000 + index
            spec = GroupSpec(task_id, size=GROUP_SIZE, task=Task(id=task_id, seed=seed), id=task_id)
            try:
                await driver.admit(spec)
            except AdmissionClosed:
                return

    async def episode(self, ctx: EpisodeContext) -> Trajectory:
        traj = ctx.trajectory
        reward = 0.0
        async with ctx.borrow("env") as lease:
            env: SandboxedBlackjackEnv = lease.resource
            async with lease.operation("reset"):
                obs = await env.reset(ctx.task)
            prompt = Prompt(facts(obs.info), extends=False)
            context: list[int] = []
            for turn in range(MAX_TURNS):
                async with lease.operation("sample"):
                    completion = await ctx.sampler.sample(
                        [*context, *prompt.ids],
                        SAMPLING,
                        policy=ctx.policy,
                        session=traj.id,
                    )
                ctx.add_turn(Turn.from_completion(prompt, completion))
                context += [*prompt.ids, *completion.ids]
                move = "hit" if completion.ids[0] % 2 == 0 and turn < MAX_TURNS - 1 else "stand"
                async with lease.operation(f"tool:{move}"):
                    result = await env.call_tool(move, {})
                reward += result.reward
                if result.done:
                    break
                prompt = Prompt([TURN_MARK + turn, *facts(result.info)], extends=True)
        traj.reward = reward
        return traj

    async def step(
        self,
        log: JsonlSink,
        trainer: TrainingClient,
        sampler: VLLMClient,
        driver: RolloutDriver,
        step: int,
        groups: list[Group],
    ) -> None:
        """One GRPO step on `groups`, its op ids named by the run and the step."""
        self.record(log, "step_begin", step=step, groups=[g.id for g in groups])
        selection = training_groups(
            groups, policy=self.policy, max_staleness=MAX_STALENESS, vocab_size=VOCAB_SIZE
        )
        trainable = selection.trainable
        advantages = [grpo_advantages([t.reward for t in g.trajectories]) for g in trainable]
        refused = [f"{r.group_id}: {r.reason.value}" for r in selection.refused]

        def record_step(trained: bool, policy: PolicyRef) -> None:
            """The step's one record, whether it trained or not (and the policy it left)."""
            self.record(
                log,
                "step",
                step=step,
                groups=[g.id for g in groups],
                trained=trained,
                refused=refused,
                policy=policy.model_dump(),
            )

        if not any(a for adv in advantages for a in adv):
            record_step(False, self.policy)
            return
        batch = training_batch(trainable, advantages, temperature=1.0, skip_zero=True)
        prefix = f"{self.run_id}-s{step}"
        for attempt in range(3):
            fb_id = f"{prefix}-fb" if attempt == 0 else f"{prefix}-fb-redo{attempt}"
            try:
                await trainer.forward_backward(batch, op_id=fb_id)
                await trainer.optim_step(AdamParams(lr=LR, grad_clip=1.0), op_id=f"{prefix}-opt")
            except TrainingGradientsLost:
                continue
            break
        else:
            raise PliesError(f"step {step}: the trainer lost its gradients three times")
        policy = await trainer.save_policy(op_id=f"{prefix}-save")
        await self.publish(sampler, policy)
        # One record for the step and the policy it published: a resume that found only half
        # of it would select the step's groups against another policy than the original did.
        record_step(True, policy)
        self.policy = policy
        driver.set_policy(policy)

    async def publish(self, sampler: VLLMClient, policy: PolicyRef) -> None:
        """Serve `policy`, retrying while the server restarts; then unload the versions no
        group in flight can still sample (a shared server's memory stays flat)."""
        retrying = AsyncRetrying(
            stop=stop_after_delay(PUBLISH_WITHIN_S),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception_type((PolicyUnavailable, PolicyOutcomeUnknown)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await publish(policy, [sampler])
        served = await sampler.refresh()
        for name, ref in served.items():
            if ref.version < policy.version - MAX_STALENESS:
                try:
                    await unload_lora_adapter(sampler, name)
                except PolicyResponseError as exc:
                    if exc.status != 404:  # 404: a restarted server no longer serves it
                        raise
                sampler.forget(name)


if __name__ == "__main__":
    run_dir, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    raise SystemExit(run(lambda interrupts: Loop(run_dir, config, interrupts).main()))
