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
    │   └── TrainingQuarantined              the session's state is unknown; no further steps
    ├── EnvError                             an environment or sandbox operation failed
    │   ├── EnvCapacityError                 a remote env server refused a session
    │   └── SandboxError                     a sandbox backend failed
    ├── LeaseError                           a pooled resource could not be created or torn down
    └── GatewayError                         the capture gateway rejected or failed a request

Misuse of an object's lifetime (reopening a closed client, using a settled trajectory) is a
`UsageError`, a `RuntimeError` kept apart from failures of remote parts.

Errors carry context as attributes and stay picklable, so records of failed episodes can
cross process boundaries.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "EnvCapacityError",
    "EnvError",
    "GatewayError",
    "LeaseError",
    "PliesError",
    "PolicyError",
    "PolicyOutcomeUnknown",
    "PolicyResponseError",
    "PolicyUnavailable",
    "SandboxError",
    "TokenizationError",
    "TrainingError",
    "TrainingQuarantined",
    "TrajectoryError",
    "UsageError",
]


class PliesError(Exception):
    """Root of every error plies raises on purpose."""


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

    def __reduce__(self):  # keep keyword context through pickling
        return (_rebuild, (type(self), self.args, self.__dict__))


class PolicyError(PliesError):
    """Sampling from a policy failed.

    Attributes:
        url: the engine URL involved, when known.
    """

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, self.__dict__))


class PolicyUnavailable(PolicyError):
    """The request provably never reached an engine (refused, overloaded): retrying is safe."""


class PolicyOutcomeUnknown(PolicyError):
    """The request may have been processed (timeout or drop mid-flight).

    plies never repeats such a request on its own: the episode decides whether to retry
    the turn or fail.
    """


class PolicyResponseError(PolicyError):
    """The engine answered, but with something plies cannot record exactly."""


class TrainingError(PliesError):
    """A training request failed."""


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

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, self.__dict__))


class LeaseError(PliesError):
    """A pooled resource could not be created or torn down."""


class GatewayError(PliesError):
    """The capture gateway rejected or failed a request."""


class UsageError(PliesError, RuntimeError):
    """An object was used outside its lifetime (closed, settled, not yet opened)."""


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err
