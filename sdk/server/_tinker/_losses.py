"""Tinker's losses: per-token losses SUMMED (never averaged), target logprobs at every position.

Per datum of T input tokens, position t predicts `target_tokens[t]` and its logprob is
`lp[t] = log_softmax(logits[t])[target_tokens[t]]` (temperature 1: the model's own
distribution). With `q` the sampler's logprobs and `A` the advantages:

- cross_entropy: `sum(-lp * weights)`; weights are signed floats and default to 1, and
  `target_tokens` may be [T, K] (with [T, K] weights) for top-k distillation.
- importance_sampling: `sum(-exp(lp - q) * A)`.
- ppo: `sum(-min(r * A, clamp(r, clip_low_threshold, clip_high_threshold) * A))` with
  `r = exp(lp - q)`; the thresholds are ratio bounds (default 0.8 and 1.2), from
  `loss_fn_config` or per token from `loss_fn_inputs`.
- cispo: `sum(-sg(clamp(r, clip_low_threshold, clip_high_threshold)) * lp * A)`: the clipped
  ratio weights the logprob and carries no gradient (same bounds and defaults as ppo).
- dro: `sum(-(lp * A - beta / 2 * (lp - q) ** 2))`, `beta` from `loss_fn_config` (required:
  Tinker documents no default).

The native wire (`plies.server._losses`) divides by the token count and takes clip epsilons,
so its code is not reused here; the logprob convention is the same. The 151,936-wide head
runs with gradients only at positions whose loss term can be non-zero; the others (needed
for `loss_fn_outputs`) run without, in bounded chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._losses import micro_batches
from ._proto import TinkerDatum

__all__ = ["LossResult", "tinker_loss"]

_NO_GRAD_ROWS = 256
"""Head rows evaluated together where no gradient is needed (about 150 MB of logits)."""

PPO_CLIP = (0.8, 1.2)


@dataclass
class LossResult:
    logprobs: list[np.ndarray]  # per datum, [T] or [T, K]
    loss: float


def _active(d: TinkerDatum, loss_fn: str, config: dict[str, float]) -> np.ndarray:
    """Positions whose loss term can be non-zero (so the head needs gradients there)."""
    if loss_fn == "cross_entropy":
        w = d.inputs.get("weights")
        if w is None:
            return np.ones(len(d.tokens), dtype=bool)
        return w != 0 if w.ndim == 1 else np.any(w != 0, axis=1)
    if loss_fn == "dro" and config["beta"] != 0:  # the penalty has a gradient everywhere
        return np.ones(len(d.tokens), dtype=bool)
    return d.inputs["advantages"] != 0


def _target_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logprobs of `targets` ([n] or [n, K]) under the head applied to `hidden` ([n, H])."""
    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    if targets.dim() == 1:
        return logp.gather(1, targets[:, None])[:, 0]
    return logp.gather(1, targets)


def _loss_terms(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        w = inputs.get("weights")
        return -lp if w is None else -lp * w
    ratio = torch.exp(lp - inputs["logprobs"])
    a = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -ratio * a
    if loss_fn == "dro":
        return -(lp * a - 0.5 * config["beta"] * (lp - inputs["logprobs"]) ** 2)
    low = inputs.get("clip_low_threshold")
    high = inputs.get("clip_high_threshold")
    low = (
        low
        if low is not None
        else torch.full_like(ratio, config.get("clip_low_threshold", PPO_CLIP[0]))
    )
    high = (
        high
        if high is not None
        else torch.full_like(ratio, config.get("clip_high_threshold", PPO_CLIP[1]))
    )
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    if loss_fn == "cispo":
        return -clipped.detach() * lp * a
    return -torch.minimum(ratio * a, clipped * a)


def tinker_loss(
    model: torch.nn.Module,
    data: list[TinkerDatum],
    loss_fn: str,
    config: dict[str, float],
    *,
    backward: bool,
    max_head_rows: int = 512,
    max_micro_tokens: int = 16384,
) -> LossResult:
    """Run the loss over `data`; with `backward`, add its gradients to the trainable `.grad`s.

    `model` is a transformers causal LM (LoRA layers injected in place, or plain).
    """
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    actives = [_active(d, loss_fn, config) for d in data]
    outputs: list[np.ndarray | None] = [None] * len(data)
    total = 0.0
    sizes = [(int(a.sum()), len(d.tokens)) for a, d in zip(actives, data, strict=True)]
    for mb in micro_batches(sizes, max_head_rows, max_micro_tokens):
        length = max(len(data[k].tokens) for k in mb)
        ids = torch.zeros((len(mb), length), dtype=torch.long)
        att = torch.zeros((len(mb), length), dtype=torch.long)
        for b, k in enumerate(mb):
            ids[b, : len(data[k].tokens)] = torch.from_numpy(data[k].tokens)
            att[b, : len(data[k].tokens)] = 1
        with torch.set_grad_enabled(backward):
            hidden = decoder(input_ids=ids.to(device), attention_mask=att.to(device))
            hidden = hidden.last_hidden_state
        mb_loss: torch.Tensor | None = None
        for b, k in enumerate(mb):
            d = data[k]
            target = torch.from_numpy(d.inputs["target_tokens"]).to(device)
            lp_all = torch.empty(target.shape, dtype=torch.float32, device=device)
            grad_rows = np.flatnonzero(actives[k]) if backward else np.zeros(0, dtype=np.int64)
            rest = np.setdiff1d(np.arange(len(d.tokens)), grad_rows)
            with torch.no_grad():
                for s in range(0, len(rest), _NO_GRAD_ROWS):
                    r = torch.from_numpy(rest[s : s + _NO_GRAD_ROWS]).to(device)
                    lp_all[r] = _target_logprobs(head, hidden[b, r].detach(), target[r])
            if len(grad_rows):
                r = torch.from_numpy(grad_rows).to(device)
                lp = _target_logprobs(head, hidden[b, r], target[r])
                inputs = {
                    name: torch.from_numpy(v[grad_rows]).to(device, torch.float32)
                    for name, v in d.inputs.items()
                    if name != "target_tokens"
                }
                term = _loss_terms(loss_fn, lp, inputs, config).sum()
                mb_loss = term if mb_loss is None else mb_loss + term
                lp_all[r] = lp.detach()
            else:
                with torch.no_grad():
                    inputs = {
                        name: torch.from_numpy(v).to(device, torch.float32)
                        for name, v in d.inputs.items()
                        if name != "target_tokens"
                    }
                    total += float(_loss_terms(loss_fn, lp_all, inputs, config).sum())
            outputs[k] = lp_all.cpu().numpy()
        if mb_loss is not None:
            total += float(mb_loss.detach())
            mb_loss.backward()
    return LossResult([o for o in outputs if o is not None], total)
