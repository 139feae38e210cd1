"""The records that rollouts produce and training consumes. Read this module first.

- `PolicyRef`: an immutable name for one published set of weights.
- `Turn`: one ply: the prompt tokens sent, the completion tokens and logprobs that came back.
- `Trajectory`: one episode: its turns, messages, reward and how it ended.
- `Segment`: a training sequence made of consecutive turns that extend one another.
- `Group`: the trajectories that share one task and one policy, trained together.

Every number that training consumes was produced by the sampler and is never re-derived:
completion ids and logprobs are stored as they came back, and a prompt is stored as the
tokens it added after the previous turn's prompt and completion.

Why prompts are stored as deltas: a multi-turn prompt repeats the whole history, so storing
each turn's full prompt costs O(turns^2) memory and JSON. The renderer knows, by
construction, whether turn k+1's prompt is turn k's prompt + completion + new tokens
(`Turn.extends` is true, `Turn.prompt_ids` holds only the new tokens) or a fresh render
(`extends` is false and `prompt_ids` is the whole prompt). `Trajectory.prompt_ids(k)`
rebuilds any full prompt, and `Trajectory.segments()` is a single O(total tokens) pass.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, Literal, NoReturn, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._exceptions import TrajectoryError, UsageError

__all__ = [
    "FinishReason",
    "Group",
    "PolicyRef",
    "Segment",
    "Status",
    "Trajectory",
    "Turn",
]

FinishReason = Literal["stop", "length", "abort"]
"""Why sampling ended: a stop token was sampled, max tokens was reached, or it was aborted."""


class Status(StrEnum):
    """How an episode ended."""

    COMPLETED = "completed"
    """The environment said done."""
    TRUNCATED = "truncated"
    """A budget ran out (turns, tokens, wall clock) before the environment said done."""
    FAILED = "failed"
    """An error ended the episode; `Trajectory.error` says which."""
    CANCELLED = "cancelled"
    """The run was stopped and every resource of the episode settled."""
    QUARANTINED = "quarantined"
    """The episode was stopped with a remote operation whose outcome is unknown."""


class PolicyRef(BaseModel):
    """An immutable published policy: what sampled a turn, and what a trainer resumes from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str = Field(description="Immutable location, e.g. plies://run/policies/3 or file:///...")
    version: int = Field(ge=0, description="Monotonic version within its run.")
    digest: str = Field(default="", description="Content hash of the weights.")


class PromptPart(Protocol):
    """What a renderer hands a recorder per turn (`plies.tokens.PromptDelta` is one)."""

    @property
    def ids(self) -> list[int]: ...
    @property
    def extends(self) -> bool: ...


class SampledPart(Protocol):
    """What a sampler hands back (`plies.policy.Completion` is one)."""

    @property
    def ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...
    @property
    def finish_reason(self) -> FinishReason: ...
    @property
    def policy(self) -> PolicyRef: ...


class Turn(BaseModel):
    """One sampled turn, recorded exactly as the sampler produced it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_ids: list[int] = Field(
        description="Prompt tokens this turn added: after the previous turn's prompt and "
        "completion when `extends`, else the whole prompt."
    )
    extends: bool = Field(
        default=False,
        description="True when the full prompt is the parent turn's prompt + completion + "
        "`prompt_ids`.",
    )
    parent: int | None = Field(
        default=None,
        description="When `extends`: the index of the turn this prompt continues, if not the "
        "one just before it (an episode that branched: sub-agents, retries, compaction).",
    )
    branch: str = Field(
        default="", description="Which branch of the episode the turn belongs to, when named."
    )
    auxiliary: bool = Field(
        default=False,
        description="An auxiliary call (a title, a summary): kept in the record, never trained.",
    )
    completion_ids: list[int] = Field(description="Sampled ids, stop token included.")
    logprobs: list[float] = Field(description="Sampler logprob of each completion id.")
    finish_reason: FinishReason
    policy: PolicyRef
    message: dict[str, Any] | None = Field(
        default=None, description="The parsed assistant message (content, reasoning, tool calls)."
    )
    ill_formed: bool = Field(default=False, description="The completion did not parse.")
    fallback: str | None = Field(
        default=None, description="Why this prompt was fully re-rendered, when it was."
    )
    started_at: float = Field(default=0.0, description="Wall-clock time the request was sent.")
    latency_s: float = Field(default=0.0, description="Seconds until the completion came back.")

    @classmethod
    def from_completion(cls, prompt: PromptPart, completion: SampledPart, **fields: Any) -> Turn:
        """The one way a recorder builds a turn: the prompt delta sent, the completion received.

        Structural types keep this module at the bottom of the layers: it names no renderer
        and no sampler, yet every recorder (harness, gateway, recipes) builds turns the same way.
        `fields` are the remaining `Turn` fields (`message`, `ill_formed`, timings).
        """
        return cls(
            prompt_ids=prompt.ids,
            extends=prompt.extends,
            completion_ids=completion.ids,
            logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            policy=completion.policy,
            **fields,
        )

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        if len(self.completion_ids) != len(self.logprobs):
            raise TrajectoryError(
                f"turn has {len(self.completion_ids)} completion ids but "
                f"{len(self.logprobs)} logprobs"
            )
        return self


_SETTLED = (
    "this trajectory is settled, so its record is final; make a changed copy with "
    "`trajectory.model_copy(update={...})`"
)


def _refuse(self: object, *args: Any, **kwargs: Any) -> NoReturn:
    raise UsageError(_SETTLED)


class _SettledList(list):  # type: ignore[type-arg]
    """A settled trajectory's list: reads and serialises as a list, refuses every change."""

    __slots__ = ()
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle without calling append
        return (type(self), (list(self),))


class _SettledDict(dict):  # type: ignore[type-arg]
    """A settled trajectory's dict: reads and serialises as a dict, refuses every change."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse
    update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


class Trajectory(BaseModel):
    """One episode. Serialises to one JSON line (`model_dump_json`).

    Settled records are final. Once `status` is set (by `settle`, by assignment, or when a
    settled record is loaded), setting any field raises `UsageError`, and so does changing
    `turns`, `messages`, `metrics` or `info` in place (what those containers hold, such as
    one message dict, is not guarded). It is a `UsageError`, not a `TrajectoryError`: the
    data is fine, the caller used a finished record as if it were still being written. To
    change a settled record, make a new one: `traj.model_copy(update={"reward": -1.0})`
    (shallow, O(1) in the turns, and settled as well).
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    task_id: str
    group_id: str = ""
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    reward: float | None = None
    status: Status | None = Field(default=None, description="None while the episode runs.")
    error: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)

    def settle(self, status: Status, **fields: Any) -> None:
        """Finish the record in place: set `fields` (reward, info, ...), then `status`.

        Raises:
            UsageError: it is settled already.
        """
        if self.status is not None:
            raise UsageError(_SETTLED)
        for name, value in fields.items():
            setattr(self, name, value)
        self.status = status

    def __setattr__(self, name: str, value: Any) -> None:
        if self.status is not None:
            raise UsageError(_SETTLED)
        super().__setattr__(name, value)
        if name == "status" and value is not None:
            self._freeze()

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with `update` applied; a settled copy is as final as a settled original."""
        copy = super().model_copy(update=update, deep=deep)
        if copy.status is not None:
            copy._freeze()
        return copy

    @model_validator(mode="after")
    def _final_when_settled(self) -> Trajectory:
        if self.status is not None:
            self._freeze()
        return self

    def _freeze(self) -> None:
        # Once per record, O(turns): the per-turn path (appending to an open record) pays
        # nothing, since only settling swaps the containers.
        fields = self.__dict__
        for name in ("turns", "messages"):
            if type(fields[name]) is not _SettledList:
                fields[name] = _SettledList(fields[name])
        for name in ("metrics", "info"):
            if type(fields[name]) is not _SettledDict:
                fields[name] = _SettledDict(fields[name])

    def parent(self, k: int) -> int | None:
        """The turn whose prompt + completion turn `k`'s prompt continues, or None.

        Raises:
            TrajectoryError: the turn claims to extend a turn that does not precede it.
        """
        turn = self.turns[k]
        if not turn.extends:
            return None
        parent = k - 1 if turn.parent is None else turn.parent
        if not 0 <= parent < k:
            raise TrajectoryError(f"turn {k} cannot extend turn {parent}", turn=k)
        return parent

    def chain(self, k: int) -> list[int]:
        """The turns whose tokens make turn `k`'s prompt, root first, `k` last."""
        chain = [k]
        parent = self.parent(k)
        while parent is not None:
            chain.append(parent)
            parent = self.parent(parent)
        chain.reverse()
        return chain

    def prompt_ids(self, k: int) -> list[int]:
        """The full prompt that turn `k` sent, rebuilt from the stored deltas."""
        ids: list[int] = []
        for j in self.chain(k)[:-1]:
            ids += self.turns[j].prompt_ids
            ids += self.turns[j].completion_ids
        ids += self.turns[k].prompt_ids
        return ids

    def segments(self) -> list[Segment]:
        """Training sequences: one per branch tip, each its chain of turns.

        A linear episode gives one segment per run of turns that extend one another. An
        episode that branched (turns whose `parent` is not the turn before) gives one
        segment per tip; where branches share turns, their sampled tokens are trained
        (mask 1) in the first segment that holds them and are masked context in the others,
        so every sampled token is trained exactly once. Auxiliary turns are never trained:
        they are masked context where a branch extends them, and end no segment.

        Raises:
            TrajectoryError: a turn claims to extend nothing, or lengths disagree.
        """
        if self.turns and self.turns[0].extends:
            raise TrajectoryError("the first turn cannot extend a previous one", turn=0)
        extended = {self.parent(k) for k in range(len(self.turns))}
        tips = [k for k, turn in enumerate(self.turns) if k not in extended and not turn.auxiliary]
        trained: set[int] = set()
        segments: list[Segment] = []
        for tip in tips:
            tokens: list[int] = []
            mask: list[int] = []
            logprobs: list[float] = []
            versions: list[int] = []
            chain = self.chain(tip)
            for j in chain:
                turn = self.turns[j]
                v = turn.policy.version
                n = len(turn.prompt_ids)
                tokens += turn.prompt_ids
                mask += [0] * n
                logprobs += [0.0] * n
                versions += [v] * n
                m = len(turn.completion_ids)
                tokens += turn.completion_ids
                if j in trained or turn.auxiliary:
                    mask += [0] * m
                    logprobs += [0.0] * m
                else:
                    trained.add(j)
                    mask += [1] * m
                    logprobs += turn.logprobs
                versions += [v] * m
            segments.append(Segment.build(tokens, mask, logprobs, versions, (chain[0], tip + 1)))
        return segments

    @property
    def policies(self) -> set[PolicyRef]:
        """Every policy that sampled a turn of this episode."""
        return {t.policy for t in self.turns}

    @property
    def settled(self) -> bool:
        return self.status is not None


class Segment(BaseModel):
    """A training sequence. `mask` is 1 exactly on sampled tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: list[int]
    mask: list[int]
    logprobs: list[float] = Field(description="Sampler logprobs on masked positions, 0 elsewhere.")
    policy_version: list[int] = Field(description="Version of the policy behind each token.")
    turns: tuple[int, int] = Field(
        description="Half-open range of turn indices from its first turn to its last (a "
        "branch's chain may skip turns of other branches in between)."
    )

    @classmethod
    def build(
        cls,
        tokens: Sequence[int],
        mask: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        turns: tuple[int, int],
    ) -> Segment:
        return cls(
            tokens=list(tokens),
            mask=list(mask),
            logprobs=list(logprobs),
            policy_version=list(versions),
            turns=turns,
        )

    @model_validator(mode="after")
    def _aligned(self) -> Segment:
        n = len(self.tokens)
        for name in ("mask", "logprobs", "policy_version"):
            if len(getattr(self, name)) != n:
                raise TrajectoryError(
                    f"segment over turns {self.turns}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} tokens",
                    turn=self.turns[0],
                )
        for i, (m, lp) in enumerate(zip(self.mask, self.logprobs, strict=True)):
            if m not in (0, 1):
                raise TrajectoryError(f"mask value {m} at position {i}", position=i)
            if m and not math.isfinite(lp):
                raise TrajectoryError(f"non-finite logprob {lp} at position {i}", position=i)
        return self


class Group(BaseModel):
    """Trajectories that share one task, admitted together under one policy."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    task_id: str
    size: int = Field(ge=1, description="How many members were admitted.")
    policy: PolicyRef = Field(description="The policy current when the group was admitted.")
    trajectories: list[Trajectory] = Field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every admitted member is present and settled."""
        return len(self.trajectories) == self.size and all(t.settled for t in self.trajectories)
