"""The `plies` command. This module only registers commands; each body lives with its subject.

Imports happen inside commands so that `plies --help` stays fast and one command's heavy
dependencies never slow another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="plies: agentic RL rollouts.")
models_app = typer.Typer(no_args_is_help=True, help="Build the offline model kit.")
app.add_typer(models_app, name="models")


@models_app.command("tokenizer")
def models_tokenizer(
    family: Annotated[str, typer.Argument(help="Tokenizer family; only 'qwen3' for now.")],
    out: Annotated[Path, typer.Argument(help="Directory to write.")],
) -> None:
    """Build a tokenizer with its chat template from installed packages."""
    from . import models

    if family != "qwen3":
        raise typer.BadParameter(f"unknown tokenizer family {family!r}; known: qwen3")
    models.build_qwen3_tokenizer(out)
    typer.echo(str(out))


@models_app.command("tiny")
def models_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write.")],
    seed: Annotated[int, typer.Option(help="Initialisation seed.")] = 0,
) -> None:
    """Build the tiny random Qwen3 model, tokenizer included."""
    from . import models

    models.build_tiny_model(out, seed=seed)
    typer.echo(str(out))
