"""What a Blackjack run is: its budgets, its seeds and its prompt."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

from plies import ConfigError
from plies.rl import GRPOConfig
from plies.training import LossName

SYSTEM_PROMPT = "You play Blackjack. Reply with exactly one tool call: hit or stand."
"""Terse on purpose: every token of the prompt is paid for at each turn."""

TEMPLATE_KWARGS = MappingProxyType({"enable_thinking": False})
"""Qwen3 without thinking: a completion is just `<tool_call>...</tool_call><|im_end|>`."""

WarmPlayers = Literal["random", "thresholds"]

TRAIN_SEEDS = 0
EVAL_SEEDS = 1_000_000_000
WARM_SEEDS = 2_000_000_000
"""Disjoint seed ranges: training deals, held-out evaluation deals, warm-start transcripts."""

RUN_SEEDS = 100
SEED_STRIDE = 10_000_000
"""A run's `--seed` S (0 to `RUN_SEEDS` - 1) shifts its training and warm-start deals by
S * `SEED_STRIDE` within their ranges (and so the sampling seeds of their episodes, which
their ids name); the held-out deals are the same for every seed, so runs compare on them."""

MAX_STALENESS = 2
"""How many policy versions a trained group may lag behind the newest one.

The one source of the bound: the driver admits at most this many steps' worth of groups
ahead of training (pacing), `training_groups` checks it, and versions older than this are
no longer served because no group in flight can still sample from them.
"""

MAX_IDLE_BATCHES = 5
"""Batches' worth of episodes in a row (`Budget.max_idle_episodes`) that may train nothing
before GRPO stops early. A group trains nothing when it is refused by the checks, tied (its
members all scored alike, so every advantage is 0) or certain (one member played, every token
drawn with certainty); it is set aside and another is sampled. Counted in episodes, so a
certain group, one episode, weighs what it cost: that much sampling in a row without a
signal means the policy has stopped exploring, and more would not change that."""

DEFAULT_KEEP_POLICIES = MAX_STALENESS + 1
"""Published GRPO policies a run keeps on disk by default: the newest, which a resume and the
final evaluation load, and those the last step's groups were sampled by (`plies replay`).
The warm start's policy and version 0 (the server's copy of the base model) are kept too."""


@dataclass(frozen=True, slots=True)
class Budget:
    """How much work a run does. `BUDGETS` names the presets the command line offers."""

    warm_hands: int
    """Transcripts generated for the warm start (reused across its steps)."""
    warm_steps: int
    warm_batch: int
    """Hands per warm-start step."""
    warm_lr: float
    grpo_steps: int
    groups_per_step: int
    """Groups with a signal per step: a group that tied or was refused is set aside as it
    arrives and another is sampled (dynamic sampling), so every step trains on this many."""
    group_size: int
    """Episodes of one deal per group; 16 members tie less often than 8 once the policy
    mostly stands, at the same episodes per step (see docs/research.md)."""
    lr: float
    eval_hands: int
    """Held-out hands evaluated before and after GRPO (the headline comparison)."""
    curve_every: int
    """Evaluate on `curve_hands` every this many steps, for the learning curve (0: never)."""
    curve_hands: int
    eval_concurrency: int = 64
    max_turns: int = 10
    max_new_tokens: int = 32
    warm_players: WarmPlayers = "random"
    """Who plays the warm start's transcripts (`transcripts`): coin flips, which teach the
    call's format and nothing else (fast, for the short budgets), or threshold players whose
    labels depend on the total."""
    top_p: float = 1.0
    """Nucleus sampling, for every episode the run plays (GRPO's and the evaluations'): each
    token is drawn from the most likely tokens holding this share of the probability, and the
    trainer takes logprobs from that same distribution. 1 samples the whole vocabulary."""
    loss: LossName = "ppo"
    """GRPO's loss. `ppo` clips the ratio of the trainer's to the sampler's probability at
    1 +- 0.2, so a group sampled a version or two back cannot push a token that has already
    moved (see docs/research.md for what unclipped `importance_sampling` did)."""

    def __post_init__(self) -> None:
        for name, least in _LEAST.items():
            value = getattr(self, name)
            if isinstance(value, float):
                if not (math.isfinite(value) and value > least):
                    raise ConfigError(
                        f"budget field {name} is {value}: a finite number > {least:g}"
                    )
            elif value < least:
                raise ConfigError(f"budget field {name} is {value}: at least {least}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"budget field top_p is {self.top_p}: a share above 0, at most 1")
        for name, kind in (("warm_players", WarmPlayers), ("loss", LossName)):
            value, known = getattr(self, name), get_args(kind)
            if value not in known:
                raise ConfigError(f"budget field {name} is {value!r}; known: {', '.join(known)}")

    @property
    def grpo(self) -> GRPOConfig:
        """The GRPO phase's settings, for `plies.rl.grpo`."""
        return GRPOConfig(
            steps=self.grpo_steps, group_size=self.group_size,
            groups_per_step=self.groups_per_step, lr=self.lr, loss=self.loss, top_p=self.top_p,
            max_staleness=MAX_STALENESS, max_idle_batches=MAX_IDLE_BATCHES,
        )  # fmt: skip

    @property
    def max_idle_episodes(self) -> int:
        """Episodes in a row that may train nothing before GRPO stops (`MAX_IDLE_BATCHES`)."""
        return self.grpo.max_idle_episodes

    @property
    def groups_in_flight(self) -> int:
        """The driver's bound on groups admitted ahead of training (staleness by pacing)."""
        return self.grpo.groups_in_flight


_LEAST: dict[str, float] = {
    "warm_hands": 1, "warm_steps": 1, "warm_batch": 1, "warm_lr": 0.0,
    "grpo_steps": 1, "groups_per_step": 1, "group_size": 2, "lr": 0.0,
    "eval_hands": 1, "curve_every": 0, "curve_hands": 1, "eval_concurrency": 1, "top_p": 0.0,
    "max_turns": 1, "max_new_tokens": 1,
}  # fmt: skip
"""The least value of each numeric field (a learning rate: above it). A group needs two
members for a group baseline to say anything; `curve_every` 0 draws no curve."""


_REMOVED: dict[str, tuple[Any, str]] = {
    "warm_tail_steps": (0, "the warm start's second stage"),
    "warm_tail_lr": (3e-2, "the warm start's second stage"),
    "advantages": ("state_contrast", "GRPO's advantages"),
    "contrast_share": (1.0, "the share of the update state_contrast removes"),
}
"""Budget fields plies no longer has (docs/research.md has what each measured): the value
every run of this version plays, and what the field chose. Each was a research setting;
the default budget's value stays."""


def recorded_budget(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A `run.json`'s budget with every field it predates at its default, and every field
    removed since dropped.

    A run recorded before a field existed ran with that field's default behaviour (a new
    field's default is always the old behaviour), so resuming it must not be refused over
    the field's absence. A field without a default stays missing, and so differs. A removed
    field at the value this version plays is dropped; at another value the run did what
    this version cannot, so it is refused.

    Raises:
        ConfigError: the record holds a removed field at other than the value played now.
    """
    for name, (now, what) in _REMOVED.items():
        if name in saved and saved[name] != now:
            raise ConfigError(
                f"the run was made with budget field {name}={saved[name]}, which this version "
                f"of plies no longer has ({what}): resume it with the version that made it, "
                "or start over with --fresh"
            )
    defaults = {f.name: f.default for f in fields(Budget) if f.default is not MISSING}
    return {**defaults, **{k: v for k, v in saved.items() if k not in _REMOVED}}


def recorded_config(record: Mapping[str, Any]) -> dict[str, Any]:
    """A `run.json`'s options (`DemoConfig.key`), with `sampler` read from what it sampled by.

    A run recorded before `--sampler` existed was decoded batch-invariantly when its
    `sampler` record says so (the demo's old default), so that is what resuming it needs;
    one recorded before `--seed` drew the deals of seed 0.
    """
    config = {"seed": 0, **record["config"]}
    if "sampler" not in config:
        invariant = (record.get("sampler") or {}).get("batch_invariant") is True
        config["sampler"] = "batch-invariant" if invariant else "batched"
    return config


def budget_with(name: str, settings: Sequence[str]) -> Budget:
    """`BUDGETS[name]` with each `FIELD=VALUE` of `--set` applied, for research runs.

    Raises:
        ConfigError: an unknown budget or field, a value of the wrong type, or out of range.
    """
    if name not in BUDGETS:
        raise ConfigError(f"unknown budget {name!r}; known: {', '.join(BUDGETS)}")
    preset = BUDGETS[name]
    known = [f.name for f in fields(Budget)]
    changes: dict[str, Any] = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key or not text:
            raise ConfigError(f"--set {setting!r}: write FIELD=VALUE, e.g. --set lr=3e-3")
        if key not in known:
            raise ConfigError(f"--set {key}: not a budget field; known: {', '.join(known)}")
        kind = type(getattr(preset, key))  # int, float, or str (the loss's name)
        try:
            value: Any = int(text) if kind is int else float(text) if kind is float else text
        except ValueError:
            raise ConfigError(f"--set {key}={text}: {key} takes {kind.__name__} values") from None
        changes[key] = value
    return replace(preset, **changes)


BUDGETS: MappingProxyType[str, Budget] = MappingProxyType(
    {
        "default": Budget(
            warm_hands=1024, warm_steps=500, warm_batch=16, warm_lr=3e-3,
            grpo_steps=45, groups_per_step=8, group_size=16, lr=1e-3,
            eval_hands=2000, curve_every=10, curve_hands=200,
            warm_players="thresholds", top_p=0.8,
        ),
        "quick": Budget(
            warm_hands=512, warm_steps=120, warm_batch=8, warm_lr=3e-2,
            grpo_steps=10, groups_per_step=4, group_size=16, lr=1e-2,
            eval_hands=500, curve_every=5, curve_hands=200,
        ),
        "smoke": Budget(
            warm_hands=256, warm_steps=60, warm_batch=4, warm_lr=3e-2,
            grpo_steps=3, groups_per_step=2, group_size=4, lr=1e-2,
            eval_hands=32, curve_every=2, curve_hands=16, eval_concurrency=16,
        ),
    }
)  # fmt: skip
"""The presets. Every budget trains GRPO with the shared share of the update removed
(`contrast`), so it does not collapse to always-stand. `default` is the flagship, each choice
measured in docs/research.md: a slow warm start on threshold players, so the decision reads
the total; GRPO at a slow rate on 8 groups of 16 a step, so that the noise of a small batch
does not walk the policy off course; and nucleus sampling at 0.8, so the call's format cannot
leak into the vocabulary's tail and a state the policy is sure of is played the same way
every time. `quick` and `smoke` keep the fast warm start of random play, which teaches the
format only: a look at the loop and a test of it, not a strategy (their few steps on
threshold players' longer hands do not settle the format, and then every group ties)."""


EnvName = Literal["local", "openenv"]
SandboxName = Literal["none", "local", "e2b"]
TrainerName = Literal["native", "tinker"]
"""`native`: plies' training wire and vLLM-style sampling on the embedded `plies serve`;
`tinker`: the Tinker API (its training and sampling clients) on that server or any service."""
SamplerName = Literal["batched", "batch-invariant"]
"""How the embedded server decodes. `batched`: requests of one policy share each forward
pass, as vLLM batches them; `plies replay` gets every token back, and logprobs to float32
rounding. `batch-invariant` (`plies serve --batch-invariant`): each request is decoded alone,
so replay reproduces every logprob bit for bit, and an evaluation of the default run takes
2.6x as long (docs/research.md)."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """One run: where it lives, its budget, and which Blackjack it plays.

    Every option is checked here, before any work, so a misspelt one is one line of error
    rather than a run that trains something else.
    """

    out: Path
    budget: str = "default"
    env: EnvName = "local"
    sandbox: SandboxName = "none"
    trainer: TrainerName = "native"
    tinker_url: str | None = None
    """The Tinker service (`--tinker-url`); None: the embedded `plies serve`'s Tinker API."""
    sampler: SamplerName = "batched"
    keep_policies: int | None = DEFAULT_KEEP_POLICIES
    """Newest GRPO policies kept on disk (`--keep-policies`); None keeps every one. Not part
    of `key()`: it changes what stays on disk, not what the run computes."""
    settings: tuple[str, ...] = ()
    """`--set FIELD=VALUE`s changing the budget's numbers (a research run); the numbers the
    run uses are `plan`, which run.json records and a resume must match."""
    seed: int = 0
    """Which training deals, warm-start transcripts and sampling seeds the run draws
    (`RUN_SEEDS`): runs of one budget with different seeds measure its spread."""
    plan: Budget = field(init=False)
    """The budget with `settings` applied: what the run does. With `--trainer tinker`, top_p
    is 1 unless `--set` says otherwise (which is refused): the Tinker API's losses take each
    token's logprob over the whole vocabulary, so its episodes must be sampled from all of it."""

    def __post_init__(self) -> None:
        plan = budget_with(self.budget, self.settings)
        set_top_p = any(s.partition("=")[0].strip() == "top_p" for s in self.settings)
        if self.trainer == "tinker" and not set_top_p:
            plan = replace(plan, top_p=1.0)  # its losses take logprobs over the whole vocabulary
        object.__setattr__(self, "plan", plan)
        for option, value, known in (
            ("env", self.env, get_args(EnvName)),
            ("sandbox", self.sandbox, get_args(SandboxName)),
            ("trainer", self.trainer, get_args(TrainerName)),
            ("sampler", self.sampler, get_args(SamplerName)),
        ):
            if value not in known:
                raise ConfigError(f"unknown --{option} {value!r}; known: {', '.join(known)}")
        if self.tinker_url is not None and self.trainer != "tinker":
            raise ConfigError("--tinker-url is the service of --trainer tinker; add that")
        if self.trainer == "tinker" and self.sampler == "batch-invariant":
            raise ConfigError(
                "--sampler batch-invariant is for --trainer native: the Tinker API's turns are "
                "sampled by its service, which plies replay cannot reproduce bit for bit"
            )
        if self.trainer == "tinker" and self.plan.top_p != 1.0:
            raise ConfigError(
                f"--trainer tinker samples the whole vocabulary (the Tinker API's losses take "
                f"each token's logprob over all of it), and --set asks for top_p "
                f"{self.plan.top_p}: leave top_p out (or set 1)"
            )
        if self.env == "openenv" and self.sandbox != "none":
            raise ConfigError("--env openenv and --sandbox are alternatives; pick one")
        if self.keep_policies is not None and self.keep_policies < 1:
            raise ConfigError(
                f"--keep-policies {self.keep_policies}: keep at least 1 (the newest, which a "
                "resume needs), or 'all'"
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < RUN_SEEDS:
            raise ConfigError(f"--seed {self.seed!r}: a whole number from 0 to {RUN_SEEDS - 1}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file; name a run directory")

    def key(self) -> dict[str, Any]:
        """What must match for a run directory to be resumed."""
        return {
            "budget": self.budget,
            "env": self.env,
            "sandbox": self.sandbox,
            "trainer": self.trainer,
            "sampler": self.sampler,
            "seed": self.seed,
        }
