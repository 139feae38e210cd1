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


@app.command("doctor")
def doctor(
    tokenizer_dir: Annotated[Path, typer.Argument(help="A local tokenizer or model directory.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON, not tables.")] = False,
    kwarg: Annotated[
        list[str] | None,
        typer.Option(help="Template variable NAME=VALUE (JSON value): enable_thinking=false."),
    ] = None,
) -> None:
    """Is this chat template safe for incremental prompts? Probe verdicts and fallbacks."""
    from ._exceptions import ConfigError
    from .tokens._doctor import run_doctor

    try:
        run_doctor(tokenizer_dir, json_output, kwarg or [])
    except ConfigError as err:
        typer.echo(f"plies doctor: {err}", err=True)
        raise typer.Exit(2) from err
