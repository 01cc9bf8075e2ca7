"""`k3pipe trace convert|make|show`: traces (docs/traces.md) from the command line."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

trace_app = typer.Typer(
    help="Traces: a team's traffic as a workload (times, sessions, token counts, shared blocks; no text).",
    no_args_is_help=True,
)


class Source(StrEnum):
    mooncake = "mooncake"
    otel = "otel"


@trace_app.command("convert")
def convert(
    src: Annotated[Path, typer.Argument(help="The file to convert.")],
    dest: Annotated[Path, typer.Argument(help="Where to write the k3pipe trace (JSON lines).")],
    source: Annotated[Source, typer.Option("--from", help="The file's format.")],
    block_tokens: Annotated[
        int | None,
        typer.Option(help="Tokens per block of its hash ids (Mooncake: 512; OpenTelemetry: 64).", min=1),
    ] = None,
) -> None:
    """Convert a Mooncake trace or OpenTelemetry GenAI spans into a k3pipe trace, and print its shape."""
    from k3pipe.schema.traces import from_mooncake, from_otel, write_trace

    if source is Source.mooncake:
        trace = from_mooncake(src, block_tokens=block_tokens or 512)
    else:
        trace = from_otel(src, block_tokens=block_tokens or 64)
    write_trace(trace, dest)
    _print_shape(dest, trace.digest, trace.shape().lines())


@trace_app.command("make")
def make(
    dest: Annotated[Path, typer.Argument(help="Where to write the trace.")],
    seed: Annotated[int, typer.Option(help="The seed: the same seed gives the same trace.")] = 1,
    sessions: Annotated[int, typer.Option(help="How many sessions.", min=1)] = 24,
    context_tokens: Annotated[
        int, typer.Option(help="The most tokens a session's prompt grows to.", min=256)
    ] = 16384,
    system_tokens: Annotated[
        int, typer.Option(help="The tokens of each shared system prompt a session opens with.", min=1)
    ] = 2048,
) -> None:
    """Write the ready agent-like multi-turn trace (docs/traces.md, "The ready trace")."""
    from k3pipe.schema.traces import agentic_trace, write_trace

    try:
        trace = agentic_trace(
            seed, sessions=sessions, context_tokens=context_tokens, system_tokens=system_tokens
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc).replace("context_tokens=", "--context-tokens ")) from None
    write_trace(trace, dest)
    _print_shape(dest, trace.digest, trace.shape().lines())


@trace_app.command("show")
def show(
    path: Annotated[Path, typer.Argument(help="A k3pipe trace.")],
    plot: Annotated[Path | None, typer.Option(help="Also draw its shape into this PNG file.")] = None,
) -> None:
    """Check a trace and print its shape (arrivals, lengths, sessions, the theoretical hit rate)."""
    from k3pipe.schema.traces import read_trace

    trace = read_trace(path)
    _print_shape(path, trace.digest, trace.shape().lines())
    if plot is not None:
        from k3pipe.report.plots import trace_shape_png

        plot.write_bytes(trace_shape_png(trace))
        typer.echo(f"  its shape drawn: {plot}")


def _print_shape(path: Path, digest: str, lines: list[str]) -> None:
    typer.echo(f"{path} (digest {digest})")
    for line in lines:
        typer.echo(f"  {line}")
