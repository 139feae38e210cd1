"""Token sampling and the logprob convention shared by sampling and training.

The logprob of a sampled token is taken under the distribution it was actually drawn from:

1. logits / temperature;
2. top-k: every logit below the k-th largest becomes -inf (ties at the k-th value are kept);
3. top-p: sorted by probability, every token whose strictly-higher-ranked mass is already
   >= top_p becomes -inf (so the smallest head with mass >= top_p survives, at least one);
4. log_softmax of what is left.

This is what vLLM reports with `--logprobs-mode processed_logprobs`. At temperature 0 the
token is the argmax and its logprob is the log_softmax of the raw logits, as vLLM reports it.
A trainer computing importance ratios must use `processed_logprobs` with the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CHUNK_ROWS", "RowParams", "certain_tokens", "processed_logprobs", "sample_rows"]


class RowParams:
    """Sampling parameters of one batch row; `generator` is per request when it has a seed."""

    __slots__ = ("generator", "temperature", "top_k", "top_p")

    def __init__(
        self, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
    ):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.generator = generator


def processed_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the distribution a token is sampled from, over the last dim.

    Args:
        logits: raw logits, shape (..., vocab), any float dtype (computed in float32).
        temperature: 0 means greedy; the raw distribution is returned then.
        top_k: keep the k largest logits; -1 or 0 disables it.
        top_p: keep the smallest head of mass >= top_p; 1.0 disables it.
    """
    if temperature <= 0:
        return torch.log_softmax(logits.float(), dim=-1)
    x = _scaled(logits, temperature, top_k)
    if top_p < 1.0:
        x = _nucleus(x, top_p)
    return torch.log_softmax(x, dim=-1)


def certain_tokens(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
) -> torch.Tensor:
    """For each row of `logits` (2-D), the token it samples with certainty, or -1.

    A token is certain when it alone holds `top_p` (the rule `_nucleus` cuts by):
    `processed_logprobs` then gives it logprob exactly 0 and every other token -inf, and no
    gradient flows through the row. Most tokens of a well-learnt format are such rows, so
    the sampler and the trainer look for them first and skip their vocabulary-wide passes:
    on a GRPO batch of the recipe those passes were most of the trainer's time.
    """
    none = torch.full((logits.shape[0],), -1, dtype=torch.long, device=logits.device)
    if temperature <= 0 or top_p >= 1.0:
        return none
    _, best, alone = _alone(_scaled(logits, temperature, top_k), top_p)
    return torch.where(alone, best[:, 0], none)


def _scaled(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Steps 1 and 2 of the convention, in float32."""
    x = logits.float()
    if temperature != 1.0:  # x / 1.0 is x, bit for bit: the pass (and its backward) is waste
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


TOP_P_HEAD = 64
"""Tokens a top-p cut looks among when the most likely token alone does not hold `top_p`.
A nucleus almost always ends within the 64 most likely tokens, and finding those costs a
few hundred microseconds where sorting 151,936 logits costs tens of milliseconds; a row
whose nucleus is wider is sorted whole."""


def _alone(rows: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's largest logit, its index, and whether that token alone holds `top_p`."""
    top, best = rows.max(dim=-1, keepdim=True)
    alone = torch.exp(top - torch.logsumexp(rows, dim=-1, keepdim=True))[:, 0] >= top_p
    return top, best, alone


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """`x` with every logit outside the smallest head of probability mass >= `top_p` set to
    -inf: in order of decreasing probability, a token is dropped once the mass before it
    reaches `top_p` (the most likely token is always kept).

    Three costs for one cut: where the most likely token alone holds `top_p` (nearly every
    token of a well-learnt format) a max and a log-sum-exp settle it; else the cut is looked
    for among the `TOP_P_HEAD` most likely tokens; only a wider nucleus sorts the row.
    """
    rows = x.reshape(-1, x.shape[-1])
    top, best, alone = _alone(rows, top_p)
    out = torch.full_like(rows, float("-inf")).scatter_(-1, best, top)
    if not bool(alone.all()):
        rest = ~alone
        out[rest] = _head_nucleus(rows[rest], top_p)
    return out.reshape(x.shape)


def _head_nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_nucleus` of rows (2-D) by their `TOP_P_HEAD` most likely tokens, else by sorting."""
    head = min(TOP_P_HEAD, x.shape[-1])
    values, order = torch.topk(x, head, dim=-1)
    probs = torch.softmax(x, dim=-1).gather(-1, order)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    drop[..., 0] = False
    out = torch.full_like(x, float("-inf"))
    out.scatter_(-1, order, values.masked_fill(drop, float("-inf")))
    wide = ~drop[..., -1]  # the head's last token is kept: the nucleus may reach past the head
    if head < x.shape[-1] and bool(wide.any()):
        out[wide] = _sorted_nucleus(x[wide], top_p)
    return out


def _sorted_nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_nucleus` by sorting every logit of each row: for rows whose nucleus is wide."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    drop[..., 0] = False
    return torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))


CHUNK_ROWS = 8
"""Rows sampled together: 8 rows of vocabulary-wide float32 temporaries (about 5 MB each)
stay in cache, where a whole batch of 32 would not."""


def sample_rows(
    logits: torch.Tensor, rows: Sequence[RowParams], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` (B, vocab) and return ids and their logprobs.

    Rows with a seed draw from their own generator, so a seeded request gives the same tokens
    whatever else shares its batch; the others share `generator`, which the engine owns.
    Sampling is by inverse CDF with one uniform draw per row (`torch.multinomial` over
    151,936 entries costs ten times more on CPU).
    """
    ids: list[int] = []
    lps: list[float] = []
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        i, lp = _sample_chunk(logits[start : start + len(chunk)].float(), chunk, generator)
        ids += i
        lps += lp
    return ids, lps


def _sample_chunk(
    x: torch.Tensor, rows: Sequence[RowParams], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    # Every row draws its uniform, certain or not, so a seeded stream does not depend on
    # which of its tokens were certain.
    draws = torch.stack([torch.rand((), generator=r.generator or generator) for r in rows])
    settings = {_settings(r) for r in rows}
    if len(settings) == 1:  # the usual chunk: one request's settings, or a run's
        ids = certain_tokens(x, *settings.pop()).tolist()
    else:
        ids = [int(certain_tokens(x[i : i + 1], *_settings(r))[0]) for i, r in enumerate(rows)]
    lps = [0.0] * len(rows)  # a certain token is drawn with logprob exactly 0
    open_rows = [i for i, token in enumerate(ids) if token < 0]
    if len(open_rows) == len(rows):
        return _draw(x, rows, draws)
    if open_rows:
        drawn, logps = _draw(x[open_rows], [rows[i] for i in open_rows], draws[open_rows])
        for i, token, lp in zip(open_rows, drawn, logps, strict=True):
            ids[i], lps[i] = token, lp
    return ids, lps


def _settings(row: RowParams) -> tuple[float, int, float]:
    return row.temperature, row.top_k, row.top_p


def _draw(
    x: torch.Tensor, rows: Sequence[RowParams], draws: torch.Tensor
) -> tuple[list[int], list[float]]:
    """Rows with more than one possible token: inverse CDF on their processed logprobs."""
    logp = torch.empty_like(x)
    for i, row in enumerate(rows):
        if row.temperature > 0 and (0 < row.top_k < x.shape[-1] or row.top_p < 1.0):
            logp[i] = processed_logprobs(x[i], row.temperature, row.top_k, row.top_p)
        else:
            # Greedy rows take the raw logits; x / 1.0 is x, bit for bit.
            scaled = x[i] if row.temperature in (0.0, 1.0) else x[i] / row.temperature
            torch.log_softmax(scaled, -1, out=logp[i])
    cdf = torch.exp(logp).cumsum_(dim=-1)
    targets = (draws.to(x.device) * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp(max=x.shape[-1] - 1)
    greedy = torch.tensor([r.temperature <= 0 for r in rows], device=x.device)
    ids = torch.where(greedy, torch.argmax(logp, dim=-1), sampled)
    return ids.tolist(), logp.gather(-1, ids[:, None])[:, 0].tolist()
