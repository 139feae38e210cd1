"""The training losses of both wires: one per-token core, two reductions over it.

Both the native wire (`/v1/training/`, `batch_loss`) and the Tinker API (`tinker_loss`)
compute their losses here, from the same three pieces:

- `token_logprobs`: each row's logprob of its target under the head, taken as the sampler
  took it (`processed_logprobs` with temperature, top-k and top-p; Tinker's convention is
  temperature 1 with neither cut, which is exactly `log_softmax`), skipping the
  vocabulary-wide passes of rows that are certain under a top-p cut;
- `LossTerms.per_token`: the per-token terms (importance sampling, ppo, cispo, dro, cross
  entropy), with the ratio's clip range as ratio bounds;
- `micro_batches`: the split that bounds both wires' head rows and padded tokens alike.

The wires differ only in what they ask of that core, so each is a thin driver: the native
one evaluates the head only at masked (sampled) tokens, divides the summed terms by their
count, clamps the log-ratio at `MAX_LOG_RATIO`, takes ppo's clip as epsilons (bounds
`1 - clip_low`, `1 + clip_high`) and reports ratio metrics and entropy; Tinker's sums the
terms, takes ratio thresholds (per call or per token), does not clamp the log-ratio (as the
service it stands for), and returns the target logprob at every position. One core rather
than two copies, because a fix to a term or to the sampler convention must reach both wires,
and the native driver stays separate rather than routed through Tinker's because asking for
every position would run the 151,936-wide head on the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .._exceptions import ConfigError
from ..wire.training import LossName, TrainingBatch
from ._sampling import CHUNK_ROWS, certain_tokens, processed_logprobs

__all__ = [
    "MAX_LOG_RATIO",
    "LossResult",
    "LossTerms",
    "TokenDatum",
    "batch_loss",
    "micro_batches",
    "tinker_loss",
    "token_logprobs",
]

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-20 before `exp` on the native wire: a ratio of e^20 already
says the token is far off-policy, and a larger one overflows float32 into an infinite loss and
NaN gradients. Clamped tokens get no gradient through the ratio, which is what such a token
deserves."""

CERTAIN_ROWS = 64
"""Rows the trainer looks for certain tokens among at once: enough that the head's weight
(151,936 x hidden) is read a few times per batch, few enough that the logits stay small."""

NO_GRAD_ROWS = 256
"""Head rows evaluated together where no gradient is needed (about 150 MB of logits)."""

TINKER_CLIP = (0.8, 1.2)
"""Tinker's default ratio bounds for ppo and cispo."""


@dataclass(frozen=True)
class LossTerms:
    """One loss, resolved once from a request, in one convention: ratio bounds, not epsilons.

    `max_log_ratio` clamps `lp - q` before `exp` (None: no clamp). `low` and `high` are the
    ratio bounds of ppo and cispo, used where `per_token` is given no per-token bounds.
    """

    name: str
    low: float = TINKER_CLIP[0]
    high: float = TINKER_CLIP[1]
    beta: float = 0.0
    max_log_ratio: float | None = None

    def ratio(self, log_ratio: torch.Tensor) -> torch.Tensor:
        if self.max_log_ratio is None:
            return torch.exp(log_ratio)
        return torch.exp(torch.clamp(log_ratio, -self.max_log_ratio, self.max_log_ratio))

    def clipped(
        self,
        ratio: torch.Tensor,
        low: torch.Tensor | None = None,
        high: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`ratio` within the bounds: the per-token ones where given, else this loss's."""
        if low is None and high is None:
            return torch.clamp(ratio, self.low, self.high)
        low = low if low is not None else torch.full_like(ratio, self.low)
        high = high if high is not None else torch.full_like(ratio, self.high)
        return torch.minimum(torch.maximum(ratio, low), high)

    def per_token(
        self,
        lp: torch.Tensor,
        q: torch.Tensor | None = None,
        a: torch.Tensor | None = None,
        *,
        weights: torch.Tensor | None = None,
        low: torch.Tensor | None = None,
        high: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each token's loss from its logprob `lp`, sampler logprob `q` and advantage `a`
        (cross entropy takes `weights` instead, default 1).

        Raises:
            ConfigError: the loss is not one of the five.
        """
        if self.name == "cross_entropy":
            return -lp if weights is None else -lp * weights
        if q is None or a is None:
            raise ConfigError(f"the {self.name} loss needs sampler logprobs and advantages")
        ratio = self.ratio(lp - q)
        if self.name == "importance_sampling":
            return -ratio * a
        if self.name == "dro":
            return -(lp * a - 0.5 * self.beta * (lp - q) ** 2)
        if self.name not in ("ppo", "cispo"):
            raise ConfigError(f"unknown loss {self.name!r}")
        clipped = self.clipped(ratio, low, high)
        if self.name == "cispo":
            return -clipped.detach() * lp * a
        return -torch.minimum(ratio * a, clipped * a)


def micro_batches(sizes: list[tuple[int, int]], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Split items, given as (head rows, tokens) each, into consecutive micro-batches.

    A micro-batch holds at most `max_rows` head rows (logits are computed only there) and at
    most `max_tokens` padded tokens; an item larger than either still gets a batch of its own.
    Both wires' losses batch this way, so their memory bounds are the same.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    rows = longest = 0
    for k, (n_rows, n_tok) in enumerate(sizes):
        new_longest = max(longest, n_tok)
        if cur and (rows + n_rows > max_rows or new_longest * (len(cur) + 1) > max_tokens):
            out.append(cur)
            cur, rows, new_longest = [], 0, n_tok
        cur.append(k)
        rows += n_rows
        longest = new_longest
    if cur:
        out.append(cur)
    return out


def _hidden(
    model: torch.nn.Module, seqs: Sequence[Sequence[int] | np.ndarray], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states over `seqs`, right-padded into one batch, and the
    padded token ids (on `device`)."""
    length = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    att = torch.zeros((len(seqs), length), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s)
        att[b, : len(s)] = 1
    ids, att = ids.to(device), att.to(device)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=att).last_hidden_state
    return hidden, ids


def _gather(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if targets.dim() == 1:
        return logp.gather(1, targets[:, None])[:, 0]
    return logp.gather(1, targets)


def token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's logprob of its target ([n], or [n, K] for K targets a row) with gradient,
    and with `entropy` each row's entropy (without; else None).

    Under a top-p cut, a row whose most likely token alone holds `top_p` is certain
    (`certain_tokens`): its logprob is 0 for that token and -inf for any other, its entropy
    0, its gradient exactly 0. Such rows are found with one pass over the head under
    `no_grad`, a few rows at a time, and only the others take the vocabulary-wide passes
    that autograd keeps and runs backward: on the recipe's GRPO batches, nearly every format
    token is certain.
    """
    t, k, p = temperature, top_k, top_p
    if p >= 1.0 or t <= 0:
        logp = processed_logprobs(head(hidden), t, k, p)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = _entropy(logp)
        return _gather(logp, targets), ent
    with torch.no_grad():
        certain = torch.cat(
            [certain_tokens(head(h), t, k, p) for h in hidden.detach().split(CERTAIN_ROWS)]
        )
    busy = torch.nonzero(certain < 0)[:, 0]
    fixed = torch.where(targets == certain, 0.0, float("-inf"))
    ent = torch.zeros_like(fixed) if entropy else None
    if busy.numel() == 0:
        return fixed, ent
    logp = processed_logprobs(head(hidden[busy]), t, k, p)
    if ent is not None:
        with torch.no_grad():
            ent[busy] = _entropy(logp)
    return fixed.index_put((busy,), _gather(logp, targets[busy])), ent


def batch_loss(
    model: torch.nn.Module,
    batch: TrainingBatch,
    loss: LossName = "importance_sampling",
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    max_head_rows: int = 512,
    max_micro_tokens: int = 16384,
) -> dict[str, float]:
    """The native wire's loss: forward and backward over `batch`, adding its gradients to
    `model`'s `.grad`; the head runs only at masked tokens.

    The loss is the sum of per-token losses over masked tokens divided by their count, so a
    batch split into micro-batches gives the same gradient as one pass. Per token, with
    `r = exp(clamp(logprob - sampler_logprob, -MAX_LOG_RATIO, MAX_LOG_RATIO))` and
    advantage `A`:

    - importance_sampling: `-r * A`
    - ppo: `-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`
    - cross_entropy: `-logprob` (advantages and sampler logprobs are ignored)

    Returns:
        Metrics: `loss`, `tokens`, `sequences`, and for the policy-gradient losses the ratio
        mean / min / max, `kl` (the k3 estimate of KL(sampler || trainer)),
        `logprob_diff_max`, and `clip_fraction` (ppo); `entropy` always.
    """
    normalizer = float(batch.loss_tokens)
    spec = LossTerms(loss, 1.0 - clip_low, 1.0 + clip_high, max_log_ratio=MAX_LOG_RATIO)
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    total = 0.0
    lp_all: list[torch.Tensor] = []
    q_all: list[torch.Tensor] = []
    adv_all: list[torch.Tensor] = []
    ent_all: list[torch.Tensor] = []
    sizes = [(d.loss_tokens, len(d.tokens)) for d in batch.data]
    for ks in micro_batches(sizes, max_head_rows, max_micro_tokens):
        mb = [batch.data[k] for k in ks]
        rows: list[int] = []
        cols: list[int] = []
        q: list[float] = []
        adv: list[float] = []
        for b, d in enumerate(mb):
            for i, m in enumerate(d.mask):
                if m:
                    rows.append(b)
                    cols.append(i)
                    q.append(d.logprobs[i])
                    adv.append(d.advantages[i])
        hidden, ids = _hidden(model, [d.tokens for d in mb], device)
        rows_t = torch.tensor(rows, device=device)
        cols_t = torch.tensor(cols, device=device)
        # The logit predicting token i sits at position i - 1; only those rows hit the head.
        lp, entropy = token_logprobs(
            head,
            hidden[rows_t, cols_t - 1],
            ids[rows_t, cols_t],
            batch.temperature,
            batch.top_k,
            batch.top_p,
            entropy=True,
        )
        assert entropy is not None
        q_t = torch.tensor(q, device=device, dtype=lp.dtype)
        a_t = torch.tensor(adv, device=device, dtype=lp.dtype)
        mb_loss = spec.per_token(lp, q_t, a_t).sum() / normalizer
        if mb_loss.requires_grad:  # else every row was certain: its gradient is exactly 0
            mb_loss.backward()
        total += float(mb_loss.detach())
        ent_all.append(entropy)
        lp_all.append(lp.detach())
        q_all.append(q_t)
        adv_all.append(a_t)
    lp_c, q_c, a_c = torch.cat(lp_all), torch.cat(q_all), torch.cat(adv_all)
    metrics = {
        "loss": total,
        "tokens": normalizer,
        "sequences": float(len(batch.data)),
        "entropy": float(torch.cat(ent_all).mean()),
    }
    if loss != "cross_entropy":
        metrics.update(_ratio_metrics(spec, lp_c, q_c, a_c))
    return metrics


def _ratio_metrics(
    spec: LossTerms, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor
) -> dict[str, float]:
    diff = lp - q
    ratio = spec.ratio(diff)
    finite = torch.isfinite(diff)
    k3 = (ratio - 1.0 - diff)[finite]
    out = {
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "kl": float(k3.mean()) if k3.numel() else float("nan"),
        "logprob_diff_max": float(diff[finite].abs().max()) if finite.any() else float("nan"),
    }
    if spec.name == "ppo":
        clipped = spec.clipped(ratio)
        out["clip_fraction"] = float((clipped * a < ratio * a).float().mean())
    return out


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """Each row's entropy, `CHUNK_ROWS` rows at a time so that the vocabulary-wide
    temporaries stay in cache, and from `logp` itself rather than the log of its exp, as one
    dot product per row rather than a product then a sum: on the warm start's batches the
    metric was one of the trainer's largest costs. A token masked out by top-k or top-p
    (logp -inf) adds 0."""
    least = torch.finfo(logp.dtype).min
    return torch.cat(
        [-torch.linalg.vecdot(rows.exp(), rows.clamp(min=least)) for rows in logp.split(CHUNK_ROWS)]
    )


class TokenDatum(Protocol):
    """One Tinker sequence as the loss reads it (`_tinker._proto.TinkerDatum`): input tokens
    [T] and its loss inputs by name, each of leading dimension T."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass
class LossResult:
    """Tinker's answer: the target logprobs of every position per datum, and the summed loss."""

    logprobs: list[np.ndarray]  # per datum, [T] or [T, K]
    loss: float


def _active(d: TokenDatum, spec: LossTerms) -> np.ndarray:
    """Positions whose loss term can be non-zero (so the head needs gradients there)."""
    if spec.name == "cross_entropy":
        w = d.inputs.get("weights")
        if w is None:
            return np.ones(len(d.tokens), dtype=bool)
        return w != 0 if w.ndim == 1 else np.any(w != 0, axis=1)
    if spec.name == "dro" and spec.beta != 0:  # the penalty has a gradient everywhere
        return np.ones(len(d.tokens), dtype=bool)
    return d.inputs["advantages"] != 0


def _tinker_terms(
    spec: LossTerms, lp: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    return spec.per_token(
        lp,
        inputs.get("logprobs"),
        inputs.get("advantages"),
        weights=inputs.get("weights"),
        low=inputs.get("clip_low_threshold"),
        high=inputs.get("clip_high_threshold"),
    )


def tinker_loss(
    model: torch.nn.Module,
    data: Sequence[TokenDatum],
    loss_fn: str,
    config: dict[str, float],
    *,
    backward: bool,
    max_head_rows: int = 512,
    max_micro_tokens: int = 16384,
) -> LossResult:
    """Tinker's loss over `data`: per-token terms summed, target logprobs at every position;
    with `backward`, its gradients are added to the trainable `.grad`s.

    `model` is a transformers causal LM (LoRA layers injected in place, or plain). `config`
    holds `clip_low_threshold` / `clip_high_threshold` (ratio bounds, default 0.8 / 1.2) and
    `beta` (dro). The head runs with gradients only at positions whose term can be non-zero;
    the others (needed for the logprobs returned) run without, `NO_GRAD_ROWS` at a time.
    """
    spec = LossTerms(
        loss_fn,
        config.get("clip_low_threshold", TINKER_CLIP[0]),
        config.get("clip_high_threshold", TINKER_CLIP[1]),
        config.get("beta", 0.0),
    )
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    actives = [_active(d, spec) for d in data]
    outputs: list[np.ndarray | None] = [None] * len(data)
    total = 0.0
    sizes = [(int(a.sum()), len(d.tokens)) for a, d in zip(actives, data, strict=True)]
    for mb in micro_batches(sizes, max_head_rows, max_micro_tokens):
        with torch.set_grad_enabled(backward):
            hidden, _ = _hidden(model, [data[k].tokens for k in mb], device)
        mb_loss: torch.Tensor | None = None
        for b, k in enumerate(mb):
            d = data[k]
            target = torch.from_numpy(d.inputs["target_tokens"]).to(device)
            lp_all = torch.empty(target.shape, dtype=torch.float32, device=device)
            grad_rows = np.flatnonzero(actives[k]) if backward else np.zeros(0, dtype=np.int64)
            rest = np.setdiff1d(np.arange(len(d.tokens)), grad_rows)
            with torch.no_grad():
                for s in range(0, len(rest), NO_GRAD_ROWS):
                    r = torch.from_numpy(rest[s : s + NO_GRAD_ROWS]).to(device)
                    lp_all[r] = token_logprobs(head, hidden[b, r].detach(), target[r])[0]
            if len(grad_rows):
                r = torch.from_numpy(grad_rows).to(device)
                lp = token_logprobs(head, hidden[b, r], target[r])[0]
                inputs = {
                    name: torch.from_numpy(v[grad_rows]).to(device, torch.float32)
                    for name, v in d.inputs.items()
                    if name != "target_tokens"
                }
                term = _tinker_terms(spec, lp, inputs).sum()
                mb_loss = term if mb_loss is None else mb_loss + term
                lp_all[r] = lp.detach()
            else:
                with torch.no_grad():
                    inputs = {
                        name: torch.from_numpy(v).to(device, torch.float32)
                        for name, v in d.inputs.items()
                        if name != "target_tokens"
                    }
                    total += float(_tinker_terms(spec, lp_all, inputs).sum())
            outputs[k] = lp_all.cpu().numpy()
        if mb_loss is not None:
            total += float(mb_loss.detach())
            mb_loss.backward()
    return LossResult([o for o in outputs if o is not None], total)
