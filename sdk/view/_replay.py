"""`plies replay`: re-sample a recorded episode's turns and compare them with the record.

Each turn is sent again exactly as it was: its full prompt rebuilt from the stored deltas
(`Trajectory.prompt_ids`), the run's sampling parameters, the seed `SeededPolicy` derived for
it (`turn_seed(episode id, prompt length)`), and the very policy version that sampled it,
loaded from the run directory into a fresh reference server on CPU, one request at a time.

What comes back equal depends on how the run sampled, which `run.json` records
(`sampler.batch_invariant`):

- batch-invariant (`plies serve --batch-invariant`; `plies demo --sampler batch-invariant`): every
  request was decoded alone, as replay decodes it, so tokens and logprobs are equal bit for
  bit, and a logprob that is not is a failure;
- batched (the default of the server and of `plies demo`): the run decoded each request in
  a batch with others (left padding, other rows), and a float32 matmul or attention sum over
  another batch rounds differently, so the tokens come back equal but the logprobs only to
  float32 rounding. The report says, per turn, how far they are.

docs/viewer.md gives what a smoke run's replay measured in each mode.

`--train-only` re-feeds a recorded training step instead (`_train_replay.py`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from anyio.abc import Process
from pydantic import ValidationError

from plies import ConfigError, Group, PliesError, PolicyRef, Trajectory, Turn
from plies.policy import SamplingParams, VLLMClient, publish
from plies.policy._paths import policy_path
from plies.policy._seeded import turn_seed
from plies.rl import REPEATS
from plies.testing import ServerProcess, plies_command, serve_process

from ._files import JSON_CAP, JSONL_CAP, first_error, iter_lines, read_regular

__all__ = [
    "MemberReplay",
    "TurnReplay",
    "local_policy",
    "read_run_groups",
    "replay_group",
    "replay_server",
    "run_record",
    "sampled_batch_invariant",
    "sampling_of",
]


@dataclass(frozen=True, slots=True)
class TurnReplay:
    """One turn sampled again, against its record."""

    turn: int
    version: int
    recorded: int
    """Completion tokens in the record."""
    replayed: int
    first_difference: int | None
    """Index of the first completion token that differs (None: the tokens are equal)."""
    max_logprob_difference: float | None
    """Largest |recorded - replayed| logprob over the equal prefix (None: no common token)."""

    @property
    def tokens_equal(self) -> bool:
        return self.first_difference is None

    @property
    def exact(self) -> bool:
        """Tokens equal and every logprob bit-for-bit the recorded one."""
        return self.tokens_equal and self.max_logprob_difference in (0.0, None)


@dataclass(frozen=True, slots=True)
class MemberReplay:
    group: str
    member: int
    trajectory: str
    turns: list[TurnReplay]
    exact_expected: bool = False
    """The run was sampled batch-invariantly: every logprob must come back bit for bit."""

    @property
    def tokens_equal(self) -> bool:
        return all(t.tokens_equal for t in self.turns)

    def reproduced(self, turn: TurnReplay) -> bool:
        """`turn` came back as the run promises: exact, or (batched runs) equal tokens."""
        return turn.exact if self.exact_expected else turn.tokens_equal


def run_record(run_dir: Path, hint: str) -> dict:
    """`RUN_DIR/run.json` as a dict.

    Raises:
        ConfigError: it is missing or not a JSON object; the message ends with `hint`.
    """
    path = Path(run_dir) / "run.json"
    try:
        run = json.loads(read_regular(path, JSON_CAP))
    except ConfigError as exc:  # not a regular file, or over the cap
        raise ConfigError(f"{exc}{hint}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path} does not read ({exc}){hint}") from None
    if not isinstance(run, dict):
        raise ConfigError(f"{path} is not a run record (a JSON object){hint}")
    return run


def sampled_batch_invariant(run_dir: Path) -> bool:
    """Whether `run.json` records that the run's turns were sampled batch-invariantly."""
    try:
        sampler = run_record(run_dir, "").get("sampler")
    except ConfigError:
        return False
    return isinstance(sampler, dict) and sampler.get("batch_invariant") is True


def sampling_of(run_dir: Path) -> SamplingParams:
    """The run's sampling parameters: `run.json`'s `sampling`, else its budget's token cap.

    Raises:
        ConfigError: `run.json` is missing or records neither.
    """
    run = run_record(run_dir, "; pass --max-tokens")
    path = run_dir / "run.json"
    try:
        if isinstance(run.get("sampling"), dict):
            return SamplingParams.model_validate(run["sampling"])
        budget = run.get("budget") if isinstance(run.get("budget"), dict) else {}
        if isinstance(budget.get("max_new_tokens"), int):  # the Blackjack recipe: temperature
            # 1 and the budget's top_p (a run recorded before the field sampled all the vocabulary)
            top_p = budget.get("top_p", 1.0)
            return SamplingParams(max_tokens=budget["max_new_tokens"], temperature=1.0, top_p=top_p)
    except ValidationError as exc:
        why = first_error(exc)
        raise ConfigError(f"{path} records sampling that is not valid: {why}") from None
    raise ConfigError(f"{run_dir / 'run.json'} records no sampling parameters; pass --max-tokens")


def read_run_groups(run_dir: Path) -> Iterator[tuple[int, Group | None]]:
    """`groups.jsonl`'s groups with their line numbers; None for a line that is no group.

    Raises:
        ConfigError: the file is missing, not a regular file, or over its caps.
    """
    path = run_dir / "groups.jsonl"
    try:
        for number, raw in iter_lines(path, JSONL_CAP):
            try:
                yield number, Group.model_validate_json(raw)
            except (ValueError, ValidationError, PliesError):  # a torn or foreign line
                yield number, None
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing") from None


def _find_group(run_dir: Path, group_id: str) -> Group:
    seen: list[str] = []
    for _, group in read_run_groups(run_dir):
        if group is not None and group.id == group_id:
            return group
        if group is not None and len(seen) < 8:
            seen.append(group.id)
    known = ", ".join(seen) or "none"
    raise ConfigError(f"no group {group_id!r} in {run_dir / 'groups.jsonl'} (first ids: {known})")


def local_policy(run_dir: Path, recorded: PolicyRef) -> PolicyRef:
    """The recorded policy where it was published, else the run directory's copy of it.

    Raises:
        ConfigError: neither exists, or the copy holds other weights than the record names.
    """
    try:
        published = policy_path(recorded)
    except ConfigError:  # not a file:// URI: only the run directory's copy can serve
        published = None
    if published is not None and (published / "policy.json").is_file():
        return recorded
    copy = run_dir / "server" / "policies" / str(recorded.version) / "policy.json"
    if not copy.is_file():
        kept = _retention_of(run_dir, recorded.version)
        if kept is not None:
            raise ConfigError(
                f"policy v{recorded.version} was not kept (the run kept --keep-policies "
                f"{kept}, see retention.json); a run made with --keep-policies all keeps "
                "every version replay may need"
            )
        raise ConfigError(
            f"policy v{recorded.version} ({recorded.uri}) is neither where it was published "
            f"nor in {copy.parent}"
        )
    try:
        found = PolicyRef.model_validate_json(read_regular(copy, JSON_CAP))
    except ValidationError as exc:
        raise ConfigError(f"{copy} is not a policy record: {first_error(exc)}") from None
    if recorded.digest and found.digest != recorded.digest:
        raise ConfigError(
            f"{copy.parent} holds weights {found.digest}, not the recorded {recorded.digest}"
        )
    return found


def _compare(k: int, turn: Turn, ids: list[int], logprobs: list[float]) -> TurnReplay:
    recorded = turn.completion_ids
    common = min(len(recorded), len(ids))
    first = next((i for i in range(common) if recorded[i] != ids[i]), None)
    if first is None and len(ids) != len(recorded):
        first = common
    same = common if first is None else first
    diffs = [abs(a - b) for a, b in zip(turn.logprobs[:same], logprobs[:same], strict=True)]
    return TurnReplay(
        k, turn.policy.version, len(recorded), len(ids), first, max(diffs, default=None)
    )


async def _replay_member(
    client: VLLMClient, traj: Trajectory, params: SamplingParams, policies: dict[int, PolicyRef]
) -> list[TurnReplay]:
    out = []
    sampled_by = traj.info.get(REPEATS, traj.id)  # a repeat's tokens are its first member's
    for k, turn in enumerate(traj.turns):
        prompt = traj.prompt_ids(k)
        seeded = params.model_copy(update={"seed": turn_seed(sampled_by, len(prompt))})
        got = await client.sample(prompt, seeded, policy=policies[turn.policy.version])
        out.append(_compare(k, turn, got.ids, got.logprobs))
    return out


async def replay_group(
    run_dir: Path,
    group_id: str,
    *,
    member: int | None = None,
    params: SamplingParams | None = None,
    log: Path | None = None,
) -> list[MemberReplay]:
    """Re-sample `group_id`'s members (or only `member`) on a fresh CPU reference server.

    Raises:
        ConfigError: no such group or member, no sampling parameters, a policy is missing.
        PliesError: the server did not start or refused a request.
    """
    run_dir = Path(run_dir)
    group = _find_group(run_dir, group_id)
    if member is not None and not 0 <= member < len(group.trajectories):
        raise ConfigError(
            f"group {group_id!r} has members 0..{len(group.trajectories) - 1}, not {member}"
        )
    members = range(len(group.trajectories)) if member is None else [member]
    params = params or sampling_of(run_dir)
    recorded = {t.policy.version: t.policy for m in members for t in group.trajectories[m].turns}
    policies = {v: local_policy(run_dir, p) for v, p in sorted(recorded.items())}
    exact = sampled_batch_invariant(run_dir)
    if not policies:
        return [MemberReplay(group.id, m, group.trajectories[m].id, [], exact) for m in members]
    base = policy_path(next(iter(policies.values())))
    roots = sorted({policy_path(p).parent for p in policies.values()})
    async with (
        replay_server(base, allow=roots, log=log) as server,
        VLLMClient(server.url, server.ready["model"]) as client,
    ):
        for policy in policies.values():
            await publish(policy, [client])
        return [
            MemberReplay(
                group.id,
                m,
                group.trajectories[m].id,
                await _replay_member(client, group.trajectories[m], params, policies),
                exact,
            )
            for m in members
        ]


@contextlib.asynccontextmanager
async def replay_server(
    model_dir: Path, *, allow: Sequence[Path] = (), log: Path | None = None
) -> AsyncIterator[ServerProcess[Process]]:
    """A fresh `plies serve MODEL_DIR` on CPU in a temporary state dir, batch-invariant.

    Replay sends one request at a time, so batch invariance changes nothing here but the
    code path, which is then the one a batch-invariant run sampled through.
    """
    with tempfile.TemporaryDirectory(prefix="plies-replay-") as tmp:
        argv = plies_command("serve", str(model_dir), "--state-dir", str(Path(tmp) / "state"))
        argv += ["--device", "cpu", "--batch-invariant"]
        for root in allow:
            argv += ["--allow-path", str(root)]
        async with serve_process(argv, log=log or Path(tmp) / "serve.log") as server:
            yield server


def _retention_of(run_dir: Path, version: int) -> object | None:
    """The run's `--keep-policies` when its `retention.json` lists `version` as removed."""
    try:
        record = json.loads(read_regular(run_dir / "retention.json", JSON_CAP))
    except (OSError, ValueError, RecursionError):  # ConfigError is a ValueError
        return None
    if not isinstance(record, dict) or version not in (record.get("removed") or []):
        return None
    return record.get("keep_policies")
