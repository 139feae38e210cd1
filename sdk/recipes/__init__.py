"""Recipes above the core: whole jobs built only on plies' public API.

`plies.recipes.blackjack` is the main job (`plies demo blackjack`): a warm start, then GRPO
on Blackjack with the tiny Qwen3 model, on a laptop CPU. Recipes import the core and never
the other way round; the CLI imports them to offer them as commands.
"""
