"""A fast in-process stand-in for the Blackjack recipe's learning, for research on the recipe.

A real `plies demo blackjack` run takes 10-20 minutes; the questions docs/research.md asks
(does the decision read the cards, does GRPO sharpen or collapse) need many runs. This
script keeps what decides them and drops the rest: the same tokenizer, template, renderer,
system prompt, env, seeds and model architecture as the recipe, but the model lives in this
process, and only the hit/stand token is sampled and trained (the tool call's fixed tokens
are taken as written). A step costs well under a second.

    python bench/blackjack_standin.py --players thresholds --warm-lr 3e-3 --warm-steps 600 \
        --steps 60 --lr 1e-3

Prints the held-out return (temperature 1), the policy's value (the exact expected return of
its mean hit chance in each state it met: far less noisy than the return) and the hit share
at hard totals <= 11 / 12-16 / >= 17 after the warm start, every `--eval-every` GRPO steps,
and greedily at the end.
`--players optimal` clones the optimal chart: a probe of how many labelled decisions the
model needs to read the state, not a recipe. `--full` trains the warm start on every token of
the call, as the recipe does, and prints the chance that a sampled call is well-formed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from plies.environments import BlackjackEnv, Task
from plies.environments.blackjack_exact import expected_return, optimal_hits, played_policy
from plies.recipes.blackjack.config import (
    EVAL_SEEDS,
    SYSTEM_PROMPT,
    TEMPLATE_KWARGS,
    TRAIN_SEEDS,
    WARM_SEEDS,
)
from plies.recipes.blackjack.warm_start import tool_call_ids
from plies.testing import qwen3_tokenizer_dir
from plies.testing._models import VOCAB_SIZE
from plies.tokens import ChatRenderer

Decision = tuple[list[int], bool, dict[str, Any]]
"""(the prompt up to the decision token, hit, the env's info at the decision)."""


class Lab:
    """The model, the tokens that matter and the rendering, for one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        random.seed(args.seed)  # the sampled calls
        self.tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        self.renderer = ChatRenderer(self.tok, template_kwargs=dict(TEMPLATE_KWARGS))
        config = Qwen3Config(  # the recipe's model by default (plies.testing.build_tiny_model)
            vocab_size=VOCAB_SIZE,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=1,
            head_dim=args.head_dim,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            eos_token_id=self.tok.eos_token_id,
            pad_token_id=self.tok.pad_token_id,
        )
        self.model = Qwen3ForCausalLM(config)
        self.calls = {name: tool_call_ids(self.tok, name) for name in ("hit", "stand")}
        hit, stand = self.calls["hit"], self.calls["stand"]
        k = next(i for i, (x, y) in enumerate(zip(hit, stand, strict=False)) if x != y)
        self.prefix, self.hit, self.stand = hit[:k], hit[k], stand[k]

    def _hidden(self, seqs: list[list[int]], grad: bool) -> torch.Tensor:
        ids = torch.full((len(seqs), max(map(len, seqs))), self.tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        with torch.set_grad_enabled(grad):
            return self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state

    def decision_logprobs(
        self, prompts: list[list[int]], grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(hit), log p(stand) at the end of each prompt, over the whole vocabulary."""
        h = self._hidden(prompts, grad)
        last = h[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]
        with torch.set_grad_enabled(grad):
            lp = torch.log_softmax(self.model.lm_head(last).float(), -1)
        return lp[:, self.hit], lp[:, self.stand]

    def call_logprobs(self, decisions: list[tuple[list[int], bool]], grad: bool) -> torch.Tensor:
        """Per decision, log p of each token of its whole call (rows: decisions)."""
        seqs, starts = [], []
        for prompt, hit in decisions:
            base = prompt[: len(prompt) - len(self.prefix)]
            seqs.append(base + self.calls["hit" if hit else "stand"])
            starts.append(len(base))
        h = self._hidden(seqs, grad)
        n = len(self.calls["hit"])
        rows = torch.stack([h[i, s - 1 : s - 1 + n] for i, s in enumerate(starts)])
        targets = torch.tensor([seq[s : s + n] for seq, s in zip(seqs, starts, strict=True)])
        with torch.set_grad_enabled(grad):
            lp = torch.log_softmax(self.model.lm_head(rows).float(), -1)
            return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Hand:
    """One hand, rendered as the harness renders it, played one call at a time."""

    def __init__(self, lab: Lab, seed: int) -> None:
        self.lab, self.seed = lab, seed
        self.decisions: list[Decision] = []
        self.hit_chances: list[float] = []
        self.reward = 0.0

    async def start(self) -> None:
        self.env = BlackjackEnv()
        await self.env.__aenter__()
        obs = await self.env.reset(Task(id=f"hand-{self.seed}", seed=self.seed))
        opening = [{"role": "system", "content": SYSTEM_PROMPT}, *obs.messages]
        self.conv = self.lab.renderer.start(opening, tools=obs.tools)
        self.info, self.done = obs.info, False

    def prompt(self) -> list[int]:
        self.conv.render()
        return [*self.conv.prompt_ids, *self.lab.prefix]

    async def act(self, hit: bool) -> None:
        name = "hit" if hit else "stand"
        self.decisions.append((self.prompt(), hit, self.info))
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        self.conv.add_completion(self.lab.calls[name], "stop", message=message)
        result = await self.env.call_tool(name, {})
        self.conv.add_messages([{"role": "tool", "name": name, "content": result.content}])
        self.info, self.done = result.info, result.done
        if result.done:
            self.reward = float(result.reward or 0.0)
            await self.env.__aexit__(None, None, None)


async def play(lab: Lab, seeds: list[int], *, greedy: bool = False) -> list[Hand]:
    """Hands of `seeds`, every open hand's next call sampled in one batch."""
    hands = [Hand(lab, seed) for seed in seeds]
    for hand in hands:
        await hand.start()
    while open_hands := [h for h in hands if not h.done]:
        hit, stand = lab.decision_logprobs([h.prompt() for h in open_hands], grad=False)
        for hand, p in zip(open_hands, torch.sigmoid(hit - stand).tolist(), strict=True):
            hand.hit_chances.append(float(p > 0.5) if greedy else p)
            await hand.act(p > 0.5 if greedy else random.random() < p)
    return hands


def shares(hands: list[Hand]) -> str:
    counts = {"<=11": [0, 0], "12-16": [0, 0], ">=17": [0, 0]}
    for hand in hands:
        for _, hit, info in hand.decisions:
            if info["usable_ace"]:
                continue
            t = info["player_total"]
            band = counts["<=11" if t <= 11 else "12-16" if t <= 16 else ">=17"]
            band[0] += hit
            band[1] += 1
    return " / ".join(f"{h / max(n, 1):.2f}" for h, n in counts.values())


def value(hands: list[Hand]) -> float:
    """The exact expected return of the policy's mean hit chance in each state it met.

    Far less noisy than the sampled return: only which states were met is sampled. A state
    never met (a rare one) is taken as a coin flip.
    """
    return expected_return(
        played_policy(
            (info["player_total"], info["dealer_up"], info["usable_ace"], p)
            for hand in hands
            for (_, _, info), p in zip(hand.decisions, hand.hit_chances, strict=True)
        )
    )


async def evaluate(lab: Lab, hands: int, *, greedy: bool = False) -> str:
    played = await play(lab, [EVAL_SEEDS + i for i in range(hands)], greedy=greedy)
    mean = sum(h.reward for h in played) / hands
    return f"return {mean:+.3f}, value {value(played):+.4f}, hit share {shares(played)}"


async def warm_data(lab: Lab, args: argparse.Namespace) -> list[Hand]:
    rng = random.Random(0)
    data = []
    for i in range(args.warm_hands):
        hand = Hand(lab, WARM_SEEDS + i)
        await hand.start()
        threshold = rng.randint(12, 21)
        while not hand.done:
            info = hand.info
            if args.players == "thresholds":
                hit = info["player_total"] < threshold
            elif args.players == "optimal":
                hit = optimal_hits(info["player_total"], info["dealer_up"], info["usable_ace"])
            else:
                hit = rng.random() < 0.5
            await hand.act(hit)
        data.append(hand)
    return data


async def main(args: argparse.Namespace) -> None:
    lab = Lab(args)
    started = time.monotonic()
    optimizer = torch.optim.AdamW(lab.model.parameters(), lr=args.warm_lr, weight_decay=0.0)

    def step(loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lab.model.parameters(), 1.0)  # as the trainer does
        optimizer.step()

    data = await warm_data(lab, args)
    for k in range(args.warm_steps):
        first = k * args.warm_batch % len(data)
        hands = [data[(first + j) % len(data)] for j in range(args.warm_batch)]
        decisions = [(p, hit) for h in hands for p, hit, _ in h.decisions]
        if args.full:
            step(-lab.call_logprobs(decisions, grad=True).mean())
        else:
            hit, stand = lab.decision_logprobs([p for p, _ in decisions], grad=True)
            labels = torch.tensor([h for _, h in decisions])
            step(-torch.where(labels, hit, stand).mean())
    seconds = time.monotonic() - started
    print(f"warm start ({seconds:.0f} s): {await evaluate(lab, args.eval_hands)}", flush=True)
    if args.full:
        sample = await play(lab, [EVAL_SEEDS + i for i in range(200)])
        calls = lab.call_logprobs([(p, h) for x in sample for p, h, _ in x.decisions], False)
        k = len(lab.prefix)  # the decision: either name is well-formed
        hit, stand = lab.decision_logprobs([p for x in sample for p, _, _ in x.decisions], False)
        fixed = calls.sum(-1) - calls[:, k] + torch.logaddexp(hit, stand)
        print(f"  chance a sampled call is well-formed: {fixed.exp().mean():.4f}", flush=True)
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    deal = TRAIN_SEEDS
    for k in range(1, args.steps + 1):
        batch: list[tuple[Hand, float]] = []
        for _ in range(40 * args.groups):  # dynamic sampling: tied groups are set aside
            if len(batch) >= args.groups * args.group_size:
                break
            group = await play(lab, [deal] * args.group_size)
            deal += 1
            rewards = [h.reward for h in group]
            mean = sum(rewards) / len(rewards)
            if any(r != mean for r in rewards):
                batch += [(h, h.reward - mean) for h in group]
        if not batch:
            print(f"step {k}: every group tied; stopped", flush=True)
            break
        rows = [(p, hit, adv) for h, adv in batch for p, hit, _ in h.decisions]
        hit, stand = lab.decision_logprobs([p for p, _, _ in rows], grad=True)
        labels = torch.tensor([h for _, h, _ in rows])
        advantages = torch.tensor([a for _, _, a in rows])
        if args.contrast_share:  # as plies.recipes.blackjack.contrast.state_contrast
            away = labels.float() - torch.sigmoid(hit - stand).detach()
            shared = (advantages * away).sum() / (away * away).sum().clamp_min(1e-12)
            advantages = advantages - args.contrast_share * shared * away
        step(-(torch.where(labels, hit, stand) * advantages).mean())
        if k % args.eval_every == 0 or k == args.steps:
            seconds = time.monotonic() - started
            print(f"step {k} ({seconds:.0f} s): {await evaluate(lab, args.eval_hands)}", flush=True)
    if args.steps:
        print(f"greedy at the end: {await evaluate(lab, args.eval_hands, greedy=True)}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--hidden", type=int, default=32)
    add("--layers", type=int, default=2)
    add("--heads", type=int, default=2)
    add("--head-dim", type=int, default=32)
    add("--players", choices=("random", "thresholds", "optimal"), default="thresholds")
    add("--warm-hands", type=int, default=1024)
    add("--warm-steps", type=int, default=600)
    add("--warm-batch", type=int, default=16)
    add("--warm-lr", type=float, default=3e-3)
    add("--full", action="store_true", help="train the warm start on the whole call")
    add("--steps", type=int, default=60, help="GRPO steps")
    add("--groups", type=int, default=4)
    add("--group-size", type=int, default=16)
    add("--lr", type=float, default=1e-3)
    add("--contrast-share", type=float, default=0.0)
    add("--eval-hands", type=int, default=1000)
    add("--eval-every", type=int, default=10)
    add("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(arguments()))
