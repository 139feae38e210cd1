"""The `plies` command. This module only registers commands; each body lives with its subject.

Imports happen inside commands so that `plies --help` stays fast and one command's heavy
dependencies never slow another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, NoReturn

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
    from .testing._models import build_qwen3_tokenizer

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
    from .testing._models import build_tiny_model

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
    batch_invariant: Annotated[
        bool,
        typer.Option(help="Decode each request alone: logprobs reproducible bit for bit."),
    ] = False,
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
    token: Annotated[
        str | None,
        typer.Option(
            envvar="PLIES_TOKEN",
            help="Secret every request must carry (Authorization: Bearer); needed beyond "
            "loopback. Prefer the environment variable: options show in `ps`.",
        ),
    ] = None,
    allow_path: Annotated[
        list[Path] | None,
        typer.Option(help="A directory besides --state-dir whose policies clients may load."),
    ] = None,
    test_faults: Annotated[
        bool,
        typer.Option(hidden=True, help="Test only: routes that hold the trainer; loopback only."),
    ] = False,
) -> None:
    """Run the reference policy server; print one JSON line with its url when ready."""
    from .server._serve import serve as run_server

    raise typer.Exit(
        run_server(
            threads=threads,
            test_faults=test_faults,
            model_dir=model_dir,
            state_dir=state_dir,
            host=host,
            port=port,
            max_batch_size=max_batch_size,
            batch_invariant=batch_invariant,
            max_queued=max_queued,
            max_model_len=max_model_len,
            device=device,
            model_name=model_name,
            tinker={"max_models": max_models},
            token=token or None,
            allow_paths=tuple(allow_path or ()),
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
    token: Annotated[
        str | None,
        typer.Option(
            envvar="PLIES_GATEWAY_TOKEN",
            help="Admin token (random if omitted); needed beyond loopback.",
        ),
    ] = None,
    sampler_token: Annotated[
        str | None,
        typer.Option(envvar="PLIES_TOKEN", help="The policy server's token, if it has one."),
    ] = None,
) -> None:
    """Run the capture gateway; prints {"url", "admin_token"} as one JSON line when ready."""
    from .gateway._standalone import serve as run_gateway

    raise typer.Exit(
        run_gateway(
            sampler=sampler,
            tokenizer=tokenizer,
            host=host,
            port=port,
            model=model,
            max_tokens=max_tokens,
            token=token or None,
            sampler_token=sampler_token or None,
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
    from .runtime import builtin_reapers, reap_report
    from .runtime._reap import ReapOutcome

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
    from .tokens._doctor import run_doctor

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
    trainer: Annotated[
        Literal["native", "tinker"],
        typer.Option(
            help="native (plies' wire) or tinker (the Tinker API: TINKER_BASE_URL and "
            "TINKER_API_KEY, else the embedded server's)."
        ),
    ] = "native",
    tinker_url: Annotated[
        str | None,
        typer.Option(help="The Tinker service for --trainer tinker (default: TINKER_BASE_URL)."),
    ] = None,
    sampler: Annotated[
        Literal["batched", "batch-invariant"],
        typer.Option(
            help="batched (the fast one) or batch-invariant (each request decoded alone, so "
            "plies replay reproduces every logprob bit for bit; evaluations take 2.6x as long)."
        ),
    ] = "batched",
    keep_policies: Annotated[
        str,
        typer.Option(
            help="Newest GRPO policies kept on disk (each ~56 MB), besides the warm start's "
            "and the base model; 'all' keeps every one."
        ),
    ] = "3",
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="FIELD=VALUE: change one number of the budget, for a research run "
            "(repeatable, e.g. --set lr=3e-3 --set grpo_steps=60); run.json records them.",
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            help="0 to 99: which training deals and warm-start transcripts the run draws "
            "(runs with different seeds measure a budget's spread; the held-out deals are "
            "the same)."
        ),
    ] = 0,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Remove the run already in --out and start over.")
    ] = False,
) -> None:
    """Warm-start the tiny model, then train it at Blackjack with GRPO (Ctrl-C, then resume)."""
    from ._exceptions import PliesError
    from .recipes.blackjack import main

    try:
        keep = None if keep_policies == "all" else int(keep_policies)
    except ValueError:
        typer.echo(f"plies demo: --keep-policies {keep_policies!r}: a number or 'all'", err=True)
        raise typer.Exit(2) from None
    try:
        code = main(
            out, budget=budget, env=env, sandbox=sandbox, trainer=trainer, tinker_url=tinker_url,
            sampler=sampler, keep_policies=keep, settings=settings or (), seed=seed, fresh=fresh,
        )  # fmt: skip
    except PliesError as err:
        _demo_stopped(err)
    except BaseExceptionGroup as group:  # found once the job runs (a Tinker URL that is wrong)
        ours, rest = group.split(PliesError)
        if ours is None or rest is not None:
            raise
        while isinstance(ours, BaseExceptionGroup):
            ours = ours.exceptions[0]
        _demo_stopped(ours)
    raise typer.Exit(code)


def _demo_stopped(err: BaseException) -> NoReturn:
    """One line for a run that plies stopped: exit 2 for options or input that are wrong, 1
    for a failure met while running (its directory keeps what was recorded)."""
    from ._exceptions import ConfigError

    if isinstance(err, ConfigError):
        typer.echo(f"plies demo: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"plies demo: stopped: {err} (the run directory keeps what was recorded)",
        err=True,
    )
    raise typer.Exit(1) from None


@app.command("view")
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (plies demo blackjack --out).")],
    out: Annotated[
        Path | None, typer.Option(help="HTML file to write (default: RUN_DIR/view.html).")
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Tokenizer directory (default: the one the run's policies carry)."),
    ] = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="Serve on 127.0.0.1, refreshed as the run writes.")
    ] = False,
    port: Annotated[int, typer.Option(help="Port for --serve; 0 picks a free one.")] = 0,
) -> None:
    """One offline HTML page of a run: curve, steps, groups, every turn's tokens."""
    from .view import write_page
    from .view._serve import serve_live

    if not run_dir.is_dir():
        typer.echo(f"plies view: {run_dir} is not a directory", err=True)
        raise typer.Exit(2)
    if tokenizer is not None and not tokenizer.is_dir():
        typer.echo(f"plies view: --tokenizer {tokenizer} is not a directory", err=True)
        raise typer.Exit(2)
    try:
        if serve:
            raise typer.Exit(serve_live(run_dir, tokenizer=tokenizer, port=port))
        page = write_page(run_dir, out or run_dir / "view.html", tokenizer=tokenizer)
    except OSError as err:  # the page cannot be written, or the port is taken
        typer.echo(f"plies view: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(page))


@app.command("replay")
def replay(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (plies demo blackjack --out).")],
    group: Annotated[
        str | None, typer.Option(help="The id of a group in RUN_DIR/groups.jsonl.")
    ] = None,
    member: Annotated[
        int | None, typer.Option(help="One member (0-based); default: every member.")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Per-turn token cap, when run.json does not record it.")
    ] = None,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature, with --max-tokens.")
    ] = 1.0,
    train_only: Annotated[
        bool,
        typer.Option(
            "--train-only", help="Re-feed training step --step to a trainer restored at it."
        ),
    ] = False,
    step: Annotated[
        int | None, typer.Option(help="With --train-only: the step in RUN_DIR/metrics.jsonl.")
    ] = None,
) -> None:
    """Re-sample a recorded episode on the reference server, or re-feed a training step;
    compare with the record."""
    import anyio

    from ._exceptions import ConfigError, PliesError
    from .policy import SamplingParams
    from .view._replay import replay_group
    from .view._train_replay import replay_step

    if train_only and (step is None or group is not None or member is not None):
        typer.echo("plies replay: --train-only takes --step N, and no --group/--member", err=True)
        raise typer.Exit(2)
    if not train_only and (group is None or step is not None):
        typer.echo("plies replay: give --group G (or --train-only --step N)", err=True)
        raise typer.Exit(2)
    params = None
    if max_tokens is not None:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    try:
        if train_only:
            assert step is not None
            from .recipes.blackjack.grpo import retrain  # the only recipe with steps so far

            replayed = anyio.run(lambda: replay_step(run_dir, step, train=retrain))
        else:
            members = anyio.run(lambda: replay_group(run_dir, group, member=member, params=params))
    except (ConfigError, PliesError) as err:
        typer.echo(f"plies replay: {err}", err=True)
        raise typer.Exit(2) from None
    if train_only:
        for line in replayed.lines():
            typer.echo(line)
        raise typer.Exit(0 if replayed.exact else 1)
    unequal = 0
    for m in members:
        for t in m.turns:
            if m.reproduced(t):
                same = "exact" if t.exact else "tokens equal"
            else:
                same = "DIFFERENT" if not t.tokens_equal else "LOGPROBS NOT EXACT"
            where = "" if t.tokens_equal else f", first difference at token {t.first_difference}"
            delta = "-" if t.max_logprob_difference is None else f"{t.max_logprob_difference:.3g}"
            typer.echo(
                f"member {m.member} turn {t.turn} policy v{t.version}: {t.replayed}/{t.recorded} "
                f"tokens, max |logprob difference| {delta}: {same}{where}"
            )
            unequal += not m.reproduced(t)
    turns = sum(len(m.turns) for m in members)
    exactly = " exactly" if members and members[0].exact_expected else ""
    typer.echo(f"{turns - unequal} of {turns} turns reproduced{exactly}")
    raise typer.Exit(1 if unequal else 0)
