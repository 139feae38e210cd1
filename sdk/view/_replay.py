"""`plies replay`: re-sample a recorded episode's turns and compare them with the record.

Each turn is sent again exactly as it was: its full prompt rebuilt from the stored deltas
(`Trajectory.prompt_ids`), the run's sampling parameters, the seed `SeededPolicy` derived for
it (`turn_seed(episode id, prompt length)`), and the very policy version that sampled it,
loaded from the run directory into a fresh reference server. On CPU the server is
deterministic for a seeded request, so the tokens must come back equal. The logprobs come
back equal to float32 rounding, not always bit for bit: the run batched each request with
others (left padding, other rows), replay sends one at a time, and a float sum in another
order rounds differently (measured on a smoke run: 53 of 53 turns' tokens equal, logprobs
within 4e-6, 11 of 53 bit for bit). The report says, per turn, how far they are.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from plies import ConfigError, Group, PolicyRef, Trajectory, Turn
from plies.policy import SamplingParams, VLLMClient, policy_path, publish, turn_seed
from plies.runtime import read_groups
from plies.testing import plies_command, serve_process

__all__ = ["MemberReplay", "TurnReplay", "replay_group", "sampling_of"]


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

    @property
    def tokens_equal(self) -> bool:
        return all(t.tokens_equal for t in self.turns)


def sampling_of(run_dir: Path) -> SamplingParams:
    """The run's sampling parameters: `run.json`'s `sampling`, else its budget's token cap.

    Raises:
        ConfigError: `run.json` is missing or records neither.
    """
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{run_dir / 'run.json'} does not read ({exc}); pass --max-tokens"
        ) from None
    if isinstance(run.get("sampling"), dict):
        return SamplingParams.model_validate(run["sampling"])
    budget = run.get("budget") if isinstance(run.get("budget"), dict) else {}
    if isinstance(budget.get("max_new_tokens"), int):  # the Blackjack recipe: temperature 1
        return SamplingParams(max_tokens=budget["max_new_tokens"], temperature=1.0)
    raise ConfigError(f"{run_dir / 'run.json'} records no sampling parameters; pass --max-tokens")


def _find_group(run_dir: Path, group_id: str) -> Group:
    read = read_groups(run_dir / "groups.jsonl")
    for group in read.records:
        if group.id == group_id:
            return group
    known = ", ".join(g.id for g in read.records[:8]) or "none"
    raise ConfigError(f"no group {group_id!r} in {run_dir / 'groups.jsonl'} (first ids: {known})")


def _local_policy(run_dir: Path, recorded: PolicyRef) -> PolicyRef:
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
        raise ConfigError(
            f"policy v{recorded.version} ({recorded.uri}) is neither where it was published "
            f"nor in {copy.parent}"
        )
    found = PolicyRef.model_validate_json(copy.read_text())
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
    for k, turn in enumerate(traj.turns):
        prompt = traj.prompt_ids(k)
        seeded = params.model_copy(update={"seed": turn_seed(traj.id, len(prompt))})
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
    policies = {v: _local_policy(run_dir, p) for v, p in sorted(recorded.items())}
    if not policies:
        return [MemberReplay(group.id, m, group.trajectories[m].id, []) for m in members]
    base = policy_path(next(iter(policies.values())))
    with tempfile.TemporaryDirectory(prefix="plies-replay-") as tmp:
        roots = sorted({str(policy_path(p).parent) for p in policies.values()})
        argv = plies_command("serve", str(base), "--state-dir", str(Path(tmp) / "state"))
        argv += ["--device", "cpu"]
        for root in roots:
            argv += ["--allow-path", root]
        async with (
            serve_process(argv, log=log or Path(tmp) / "serve.log") as server,
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
                )
                for m in members
            ]
