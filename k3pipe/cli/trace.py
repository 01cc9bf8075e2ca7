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
    capture = "capture"
    openai_log = "openai-log"


@trace_app.command("convert")
def convert(
    src: Annotated[Path, typer.Argument(help="The file to convert.")],
    dest: Annotated[Path, typer.Argument(help="Where to write the k3pipe trace (JSON lines).")],
    source: Annotated[
        Source,
        typer.Option(
            "--from",
            help="The file's format: mooncake, otel (OpenTelemetry GenAI spans), capture (the gateway's "
            "capture log) or openai-log (JSON lines of timestamp, session_id, request body and usage).",
        ),
    ],
    block_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens per block of its hash ids (Mooncake: 512; OpenTelemetry and openai-log: 64).", min=1
        ),
    ] = None,
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="openai-log: the target model's directory; its tokenizer and chat template count and "
            "hash the prompts (no text enters the trace)."
        ),
    ] = None,
) -> None:
    """Convert a Mooncake trace, OpenTelemetry GenAI spans, a gateway capture or an OpenAI request log
    into a k3pipe trace, and print its shape."""
    from k3pipe.schema.traces import from_capture, from_mooncake, from_otel, write_trace

    if source is Source.mooncake:
        trace = from_mooncake(src, block_tokens=block_tokens or 512)
    elif source is Source.otel:
        trace = from_otel(src, block_tokens=block_tokens or 64)
    elif source is Source.capture:
        trace = from_capture(_capture_rows(src), src.name)
    else:
        if model_dir is None:
            raise typer.BadParameter(
                "--from openai-log needs --model-dir: the target model's directory, whose tokenizer and "
                "chat template count the prompts as its engine will",
                param_hint="--model-dir",
            )
        from k3pipe.prompts.capture import request_log_lines

        trace = from_capture(request_log_lines(src, model_dir, block_tokens or 64), src.name)
    write_trace(trace, dest)
    _print_shape(dest, trace.digest, trace.shape().lines())


def _capture_rows(path: Path) -> list[dict[str, object]]:
    import json

    from k3pipe.core.errors import SpecError

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecError(f"capture {path}: cannot be read ({exc})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SpecError(f"capture {path}: line {n} is not JSON ({exc.msg})") from None
    return rows


@trace_app.command("gateway")
def gateway(
    config_dir: Annotated[
        Path, typer.Argument(help="The LiteLLM proxy's config directory (it loads callbacks from there).")
    ],
    out: Annotated[Path, typer.Option(help="The capture log the gateway appends to (JSON lines, no text).")],
    model_dir: Annotated[
        Path, typer.Option(help="The target model's directory: its tokenizer and template hash the prompts.")
    ],
    block_tokens: Annotated[int, typer.Option(help="Tokens per hashed block.", min=1)] = 64,
) -> None:
    """Write the LiteLLM callback that captures the gateway's traffic as a trace (no text, no key), and
    print the lines its config needs."""
    from k3pipe.prompts.capture import CALLBACK_INSTANCE, CALLBACK_MODULE, write_gateway_callback

    path = write_gateway_callback(config_dir, out=out, model_dir=model_dir, block_tokens=block_tokens)
    typer.echo(f"wrote {path} (and the modules it imports under {config_dir / 'k3pipe-capture-lib'})")
    typer.echo("add to the proxy's config, beside model_list:")
    typer.echo(f"  litellm_settings:\n    callbacks: [{CALLBACK_MODULE}.{CALLBACK_INSTANCE}]")
    typer.echo(
        "a client names its session with the body field litellm_session_id; "
        f"then: k3pipe trace convert {out} TRACE.jsonl --from capture"
    )


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
