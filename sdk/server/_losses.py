"""The training losses: forward and backward over a batch, computing logits only where needed.

The head (the 151,936-wide output layer) and log-softmax run only at the positions the loss
uses: hidden states are gathered at masked positions first. Each token's logprob is taken as
the sampler took it (`processed_logprobs` with the batch's temperature, top-k and top-p), so
ratios start at exactly 1 for on-policy data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._exceptions import ConfigError
from ..wire.training import LossName, TrainingBatch
from ._sampling import CHUNK_ROWS, certain_tokens, processed_logprobs

__all__ = ["MAX_LOG_RATIO", "batch_loss", "micro_batches"]

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-20 before `exp`: a ratio of e^20 already says the token is far
off-policy, and a larger one overflows float32 into an infinite loss and NaN gradients.
Clamped tokens get no gradient through the ratio, which is what such a token deserves."""

CERTAIN_ROWS = 64
"""Rows the trainer looks for certain tokens among at once: enough that the head's weight
(151,936 x hidden) is read a few times per batch, few enough that the logits stay small."""


@dataclass
class _Loss:
    """Per-call loss settings, resolved once from the request."""

    name: str
    clip_low: float
    clip_high: float
    normalizer: float


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
    """Run forward and backward over `batch`, adding its gradients to `model`'s `.grad`.

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
    spec = _Loss(loss, clip_low, clip_high, normalizer)
    decoder = model.get_decoder()
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
        length = max(len(d.tokens) for d in mb)
        ids = torch.zeros((len(mb), length), dtype=torch.long)
        att = torch.zeros((len(mb), length), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        q: list[float] = []
        adv: list[float] = []
        for b, d in enumerate(mb):
            ids[b, : len(d.tokens)] = torch.tensor(d.tokens)
            att[b, : len(d.tokens)] = 1
            for i, m in enumerate(d.mask):
                if m:
                    rows.append(b)
                    cols.append(i)
                    q.append(d.logprobs[i])
                    adv.append(d.advantages[i])
        ids, att = ids.to(device), att.to(device)
        rows_t = torch.tensor(rows, device=device)
        cols_t = torch.tensor(cols, device=device)
        hidden = decoder(input_ids=ids, attention_mask=att).last_hidden_state
        # The logit predicting token i sits at position i - 1; only those rows hit the head.
        lp, entropy = _token_logprobs(head, hidden[rows_t, cols_t - 1], ids[rows_t, cols_t], batch)
        q_t = torch.tensor(q, device=device, dtype=lp.dtype)
        a_t = torch.tensor(adv, device=device, dtype=lp.dtype)
        per_token = _per_token_loss(spec, lp, q_t, a_t)
        mb_loss = per_token.sum() / spec.normalizer
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


def _token_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, batch: TrainingBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logprob of its target token (with gradient) and its entropy (without).

    Under a top-p cut, a row whose most likely token alone holds `top_p` is certain
    (`certain_tokens`): its logprob is 0 for that token and -inf for any other, its entropy
    0, its gradient exactly 0. Such rows are found with one pass over the head under
    `no_grad`, a few rows at a time, and only the others take the vocabulary-wide passes
    that autograd keeps and runs backward: on the recipe's GRPO batches, nearly every format
    token is certain.
    """
    t, k, p = batch.temperature, batch.top_k, batch.top_p
    if p >= 1.0 or t <= 0:
        logp = processed_logprobs(head(hidden), t, k, p)
        with torch.no_grad():
            entropy = _entropy(logp)
        return logp.gather(1, targets[:, None])[:, 0], entropy
    with torch.no_grad():
        certain = torch.cat(
            [certain_tokens(head(h), t, k, p) for h in hidden.detach().split(CERTAIN_ROWS)]
        )
    busy = torch.nonzero(certain < 0)[:, 0]
    fixed = torch.where(targets == certain, 0.0, float("-inf"))
    entropy = torch.zeros_like(fixed)
    if busy.numel() == 0:
        return fixed, entropy
    logp = processed_logprobs(head(hidden[busy]), t, k, p)
    with torch.no_grad():
        entropy[busy] = _entropy(logp)
    return fixed.index_put((busy,), logp.gather(1, targets[busy, None])[:, 0]), entropy


def _per_token_loss(
    spec: _Loss, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor
) -> torch.Tensor:
    if spec.name == "cross_entropy":
        return -lp
    ratio = _ratio(lp - q)
    if spec.name == "importance_sampling":
        return -ratio * a
    if spec.name == "ppo":
        clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
        return -torch.minimum(ratio * a, clipped * a)
    raise ConfigError(f"unknown loss {spec.name!r}")


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _ratio_metrics(
    spec: _Loss, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor
) -> dict[str, float]:
    diff = lp - q
    ratio = _ratio(diff)
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
        clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
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
