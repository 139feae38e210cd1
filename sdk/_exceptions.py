"""Every error plies raises, rooted at `PliesError`.

The tree, by where the failure comes from::

    PliesError
    ├── ConfigError (also ValueError)        the caller asked for something that cannot work
    ├── TokenizationError                    a template or tokenizer could not render or encode
    ├── TrajectoryError                      recorded data breaks an invariant (a bug)
    ├── PolicyError                          sampling failed
    │   ├── PolicyUnavailable                the request never reached an engine: safe to retry
    │   ├── PolicyOutcomeUnknown             the request may have run: never silently repeated
    │   └── PolicyResponseError              the engine answered something plies cannot use
    ├── TrainingError                        a training request failed
    │   ├── TrainingGradientsLost            accumulated gradients are gone; redo the step
    │   └── TrainingQuarantined              the session's state is unknown; no further steps
    ├── EnvError                             an environment or sandbox operation failed
    │   ├── EnvCapacityError                 a remote env server refused a session
    │   ├── SandboxError                     a sandbox backend failed
    │   └── ToolError                        a tool refused its call; the model gets the message
    ├── LeaseError                           a pooled resource could not be created or torn down
    │   ├── OperationUnsettled               a remote operation ended with its outcome unknown
    │   └── PoolExhausted                    every slot of a pool is held by quarantined resources
    └── GatewayError                         the capture gateway rejected or failed a request
        ├── GatewaySessionError              a session key is unknown, finished or dropped
        └── GatewayRequestError              a chat request the gateway cannot serve

Misuse of an object's lifetime (reopening a closed client, using a settled trajectory) is a
`UsageError`, a `RuntimeError` kept apart from failures of remote parts; its one subclass,
`AdmissionClosed`, says a rollout driver was stopped and takes no more groups.

Errors carry context as attributes and stay picklable, so records of failed episodes can
cross process boundaries.
"""

from __future__ import annotations


class PliesError(Exception):
    """Root of every error plies raises on purpose."""

    def __reduce__(self):
        """Pickle the keyword context (`url`, `turn`, ...) too, not only the message."""
        return (_rebuild, (type(self), self.args, self.__dict__))


class ConfigError(PliesError, ValueError):
    """The caller configured something that cannot work; the message says what to change."""


class TokenizationError(PliesError):
    """A chat template or tokenizer could not render or encode the given messages."""


class TrajectoryError(PliesError):
    """Recorded token data breaks an invariant (lengths, masks, prefixes).

    Attributes:
        turn: index of the offending turn, when one is to blame.
        position: token position inside that turn, when known.
    """

    def __init__(self, message: str, *, turn: int | None = None, position: int | None = None):
        super().__init__(message)
        self.turn = turn
        self.position = position


class PolicyError(PliesError):
    """Sampling from a policy failed.

    Attributes:
        url: the engine URL involved, when known.
    """

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class PolicyUnavailable(PolicyError):
    """The request provably never reached an engine (refused, overloaded): retrying is safe."""


class PolicyOutcomeUnknown(PolicyError):
    """The request may have been processed (timeout or drop mid-flight).

    plies never repeats such a request on its own: the episode decides whether to retry
    the turn or fail.
    """


class PolicyResponseError(PolicyError):
    """The engine answered, but with something plies cannot record exactly.

    Attributes:
        status: the HTTP status of the answer when it was an error status, else None.
    """

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None):
        super().__init__(message, url=url)
        self.status = status


class TrainingError(PliesError):
    """A training request failed."""


class TrainingGradientsLost(TrainingError):
    """The trainer no longer holds gradients the session accumulated for this step.

    A restart lost them, or an `optim_step` found them incomplete and discarded them all; the
    optimizer did not step on partial gradients. Redo the step's `forward_backward` calls.

    Attributes:
        op_ids: the forward_backward op ids whose gradients were discarded.
    """

    def __init__(self, message: str, *, op_ids: list[str] | None = None):
        super().__init__(message)
        self.op_ids = list(op_ids or [])


class TrainingQuarantined(TrainingError):
    """The training session's state could not be reconciled; it refuses further steps."""


class EnvError(PliesError):
    """An environment operation failed."""


class EnvCapacityError(EnvError):
    """A remote environment server refused a session because it is at capacity."""


class SandboxError(EnvError):
    """A sandbox backend failed.

    Attributes:
        sandbox_id: the remote id of the sandbox, when one exists.
    """

    def __init__(self, message: str, *, sandbox_id: str | None = None):
        super().__init__(message)
        self.sandbox_id = sandbox_id


class ToolError(EnvError):
    """A tool refused its call (unknown tool, bad arguments, an illegal move).

    `Env.call_tool` turns it into a tool message flagged as an error, so the model can
    correct itself; it never ends an episode on its own.
    """


class LeaseError(PliesError):
    """A pooled resource could not be created or torn down."""


class OperationUnsettled(LeaseError):
    """A remote operation was cut off before it settled: its effect is unknown.

    The lease that ran it is quarantined and never lent again.
    """


class PoolExhausted(LeaseError):
    """Every slot of a pool is held by a quarantined resource that may still exist remotely.

    Slots are freed only when a teardown succeeds; `plies reap` on the quarantine report, or
    a larger limit, gets the run going again.
    """


class GatewayError(PliesError):
    """The capture gateway rejected or failed a request."""


class GatewaySessionError(GatewayError):
    """A session key is unknown, or its session was finished or dropped (HTTP 401)."""


class GatewayRequestError(GatewayError, ValueError):
    """A chat request the gateway cannot serve (HTTP 400).

    Attributes:
        param: the request field to blame, in OpenAI's dotted form, when one is.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class UsageError(PliesError, RuntimeError):
    """An object was used outside its lifetime (closed, settled, not yet opened)."""


class AdmissionClosed(UsageError):
    """The rollout driver was stopped (`stop()`, `cancel()` or an interrupt): no more groups."""


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err
