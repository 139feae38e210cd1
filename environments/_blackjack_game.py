"""Blackjack rules: the one implementation every Blackjack variant in plies runs.

The rules are those of gymnasium's `Blackjack-v1` with `natural=False, sab=False`: an infinite
deck (each card 1-10 with faces counting 10, so a ten-valued card is four times as likely as
any other), an ace counts 11 when that does not bust the hand ("usable"), the dealer draws to
17 and stands on every 17, a player bust loses at once, and the reward is +1, 0 or -1.

Cards are a pure function of the seed and their position in the deal (dealer, dealer,
player, player, then every later card in order, as gymnasium draws them), so a game can be
saved as a small JSON state and resumed in another process.

This file imports only the standard library on purpose: it is also the trusted game script
that the sandboxed variant copies into a sandbox and runs as

    python3 game.py STATE_FILE new SEED | hit | stand

which updates STATE_FILE and prints the step as one JSON line (exit status 2 and a JSON
error on stderr for an illegal move).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

DECK = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10)
RULES = (
    "Blackjack rules: aces count 1 or 11, face cards count 10. Get closer to 21 than the "
    "dealer without going over. The dealer draws until reaching 17 or more. Call `hit` to "
    "take a card or `stand` to end your turn. Win +1, draw 0, lose -1."
)


def draw(seed: int, index: int) -> int:
    """The card at position `index` of the deal for `seed` (the same in every process).

    A keyed hash rather than a seeded generator, so that any card can be computed on its own
    (a saved game needs no generator state) and cheaply (about a microsecond).
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8, person=b"plies-bj").digest()
    return DECK[int.from_bytes(digest, "big") % len(DECK)]


def usable_ace(hand: list[int]) -> bool:
    return 1 in hand and sum(hand) + 10 <= 21


def total(hand: list[int]) -> int:
    return sum(hand) + 10 if usable_ace(hand) else sum(hand)


def _card(c: int) -> str:
    return "A" if c == 1 else str(c)


def _cards(hand: list[int]) -> str:
    return ", ".join(_card(c) for c in hand)


class IllegalMove(Exception):
    """A move the rules do not allow now (the hand is over)."""


@dataclass
class BlackjackGame:
    """One hand of Blackjack. Plain synchronous code: fast enough to play 20,000 hands a second."""

    seed: int
    drawn: int = 0
    dealer: list[int] = field(default_factory=list)
    player: list[int] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0

    @classmethod
    def deal(cls, seed: int) -> BlackjackGame:
        game = cls(seed=seed)
        game.dealer = [game._next(), game._next()]
        game.player = [game._next(), game._next()]
        return game

    def _next(self) -> int:
        card = draw(self.seed, self.drawn)
        self.drawn += 1
        return card

    def hit(self) -> str:
        """Take a card; a bust ends the hand with -1. Returns the text for the player."""
        self._check_open("hit")
        card = self._next()
        self.player.append(card)
        text = f"You drew {_card(card)}. {self._hand_text()}"
        if total(self.player) > 21:
            self.done, self.reward = True, -1.0
            return f"{text} Bust: you lose. Reward: -1."
        return f"{text} The dealer shows {_card(self.dealer[0])}."

    def stand(self) -> str:
        """End the player's turn: the dealer draws to 17, then the hand is scored."""
        self._check_open("stand")
        while total(self.dealer) < 17:
            self.dealer.append(self._next())
        player, dealer = total(self.player), total(self.dealer)
        dealer_score = 0 if dealer > 21 else dealer
        self.reward = float((player > dealer_score) - (player < dealer_score))
        self.done = True
        outcome = {1.0: "You win", 0.0: "Draw", -1.0: "You lose"}[self.reward]
        bust = " (bust)" if dealer > 21 else ""
        return (
            f"You stand on {player}. The dealer has {_cards(self.dealer)}: {dealer}{bust}. "
            f"{outcome}. Reward: {self.reward:+.0f}."
        )

    def opening(self) -> str:
        return f"{RULES}\n\n{self._hand_text()} The dealer shows {_card(self.dealer[0])}."

    def info(self) -> dict[str, Any]:
        """Facts for logs and tests: the player's hand and total, the dealer's up card."""
        out: dict[str, Any] = {
            "seed": self.seed,
            "player_cards": list(self.player),
            "player_total": total(self.player),
            "usable_ace": usable_ace(self.player),
            "dealer_up": self.dealer[0],
        }
        if self.done:
            out["dealer_cards"] = list(self.dealer)
            out["dealer_total"] = total(self.dealer)
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BlackjackGame:
        return cls(**json.loads(text))

    def _hand_text(self) -> str:
        soft = " with a usable ace counting 11" if usable_ace(self.player) else ""
        return f"Your cards: {_cards(self.player)} (total {total(self.player)}{soft})."

    def _check_open(self, move: str) -> None:
        if self.done:
            raise IllegalMove(f"cannot {move}: the hand is over")


def main(argv: list[str]) -> int:
    """Play one move against a state file; see the module docstring."""
    if (
        len(argv) < 2
        or argv[1] not in ("new", "hit", "stand")
        or (argv[1] == "new") != (len(argv) == 3)
    ):
        print(json.dumps({"error": "usage: game.py STATE new SEED | hit | stand"}), file=sys.stderr)
        return 2
    path, move = argv[0], argv[1]
    try:
        if move == "new":
            game = BlackjackGame.deal(int(argv[2]))
            text = game.opening()
        else:
            with open(path, encoding="utf-8") as f:
                game = BlackjackGame.from_json(f.read())
            text = game.hit() if move == "hit" else game.stand()
    except (IllegalMove, ValueError, OSError) as err:
        print(json.dumps({"error": str(err)}), file=sys.stderr)
        return 2
    with open(path, "w", encoding="utf-8") as f:
        f.write(game.to_json())
    step = {"text": text, "reward": game.reward, "done": game.done, "info": game.info()}
    print(json.dumps(step))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
