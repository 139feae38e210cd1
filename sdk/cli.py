"""The `plies` command. This module only registers commands; each body lives with its subject.

Imports happen inside commands so that `plies --help` stays fast and one command's heavy
dependencies never slow another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

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
    from .testing import build_qwen3_tokenizer

    if family != "qwen3":
        raise typer.BadParameter(f"unknown tokenizer family {family!r}; known: qwen3")
    build_qwen3_tokenizer(out)
    typer.echo(str(out))


@models_app.command("tiny")
def models_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write.")],
    seed: Annotated[int, typer.Option(help="Initialisation seed.")] = 0,
) -> None:
    """Build the tiny random Qwen3 model, tokenizer included."""
    from .testing import build_tiny_model

    build_tiny_model(out, seed=seed)
    typer.echo(str(out))


@app.command("serve")
def serve(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (version 0).")],
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where published policies live; a temporary dir if omitted."),
    ] = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 0,
    max_batch_size: Annotated[int, typer.Option(help="Rows per forward pass.")] = 32,
    max_queued: Annotated[int, typer.Option(help="In-flight requests before 503.")] = 1024,
    max_model_len: Annotated[int, typer.Option(help="Prompt + completion tokens.")] = 4096,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads.")] = None,
    model_name: Annotated[
        str | None,
        typer.Option(help="Tinker API: the base model's name (default: the directory's)."),
    ] = None,
    max_models: Annotated[
        int, typer.Option(help="Tinker API: training tenants (create_model) held at once.")
    ] = 8,
    test_faults: Annotated[
        bool,
        typer.Option(hidden=True, help="Test only: routes that hold the trainer; loopback only."),
    ] = False,
) -> None:
    """Run the reference policy server; print one JSON line with its url when ready."""
    from .server import serve as run_server

    raise typer.Exit(
        run_server(
            threads=threads,
            test_faults=test_faults,
            model_dir=model_dir,
            state_dir=state_dir,
            host=host,
            port=port,
            max_batch_size=max_batch_size,
            max_queued=max_queued,
            max_model_len=max_model_len,
            device=device,
            model_name=model_name,
            tinker={"max_models": max_models},
        )
    )


@app.command("gateway")
def gateway(
    sampler: Annotated[str, typer.Option(help="Base URL of the policy server (vLLM API).")],
    tokenizer: Annotated[Path, typer.Option(help="Tokenizer directory with a chat template.")],
    host: Annotated[str, typer.Option(help="Bind address; loopback by default.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 0,
    model: Annotated[
        str | None, typer.Option(help="Served model name to sample from (default: the server's).")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Cap on completion tokens per turn.")
    ] = None,
) -> None:
    """Run the capture gateway; prints {"url", "admin_token"} as one JSON line when ready."""
    from .gateway import serve as run_gateway

    raise typer.Exit(
        run_gateway(
            sampler=sampler,
            tokenizer=tokenizer,
            host=host,
            port=port,
            model=model,
            max_tokens=max_tokens,
        )
    )


@app.command("reap")
def reap(
    report: Annotated[Path, typer.Argument(help="A quarantine report written by a run.")],
    dry_run: Annotated[bool, typer.Option(help="Only say what would be tried.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds per teardown.")] = 30.0,
) -> None:
    """Tear down what a quarantine report says may still exist; mark it in the report."""
    import anyio

    from ._exceptions import ConfigError
    from .environments import sandbox_reapers
    from .runtime import ReapOutcome, builtin_reapers, reap_report

    # Each layer knows its own kinds; the command is where they meet.
    reapers = {**builtin_reapers(), **sandbox_reapers()}
    try:
        results = anyio.run(lambda: reap_report(report, reapers, dry_run=dry_run, timeout=timeout))
    except ConfigError as exc:
        typer.echo(f"plies reap: {exc}", err=True)
        raise typer.Exit(2) from None
    for r in results:
        detail = f" ({r.detail})" if r.detail else ""
        typer.echo(f"{r.outcome.value:8} {r.kind} {r.remote_id} [{r.lease_id}]{detail}")
    left = [r for r in results if r.outcome in (ReapOutcome.FAILED, ReapOutcome.SKIPPED)]
    typer.echo(f"{len(results)} remote things may have existed; {len(left)} may still exist")
    raise typer.Exit(1 if left else 0)


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
    from .tokens import run_doctor

    try:
        run_doctor(tokenizer_dir, json_output, kwarg or [])
    except ConfigError as err:
        typer.echo(f"plies doctor: {err}", err=True)
        raise typer.Exit(2) from err


demo_app = typer.Typer(no_args_is_help=True, help="Worked examples that run end to end.")
app.add_typer(demo_app, name="demo")


@demo_app.command("blackjack")
def demo_blackjack(
    out: Annotated[
        Path, typer.Option(help="Run directory; an existing run there is resumed.")
    ] = Path("runs/blackjack"),
    budget: Annotated[str, typer.Option(help="default (the full run), quick or smoke.")] = (
        "default"
    ),
    env: Annotated[
        Literal["local", "openenv"], typer.Option(help="local (in process) or openenv (a server).")
    ] = "local",
    sandbox: Annotated[
        Literal["none", "local", "e2b"],
        typer.Option(help="none, local or e2b: run each hand in its own sandbox."),
    ] = "none",
) -> None:
    """Warm-start the tiny model, then train it at Blackjack with GRPO (Ctrl-C, then resume)."""
    from ._exceptions import ConfigError
    from .recipes.blackjack import main

    try:
        code = main(out, budget=budget, env=env, sandbox=sandbox)
    except ConfigError as err:
        typer.echo(f"plies demo: {err}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)
