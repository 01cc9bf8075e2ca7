"""The k3pipe command line: render, preflight, run, study, retest, report, rerun, runs, detached,
history, compare, bundle."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from typer.core import TyperCommand

from k3pipe.cli.prefect_env import mark_cancelled, prepare_prefect_env
from k3pipe.cli.stack import stack_app
from k3pipe.cli.terminal import Interrupts, configure_logging, hide_tracebacks, log_error, log_path
from k3pipe.cli.trace import trace_app
from k3pipe.core.errors import K3pipeError
from k3pipe.core.layout import KIND_TAG, RunTags
from k3pipe.core.settings import Settings

app = typer.Typer(
    help="Repeatable, tracked inference-engine benchmarks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # main() prints one message; the traceback goes to the log
)
app.add_typer(stack_app, name="stack")
app.add_typer(trace_app, name="trace")


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks on the terminal (they always go to the log).")
    ] = False,
) -> None:
    """Repeatable, tracked inference-engine benchmarks. Errors print one message; the traceback goes
    to K3PIPE_HOME/logs/k3pipe.log (and here with --debug or K3PIPE_DEBUG=1)."""


def _fail(exc: BaseException) -> None:
    log_error(exc)
    from k3pipe.core.secrets import scrub

    message = scrub(str(exc)) or type(exc).__name__
    hint = ""
    if not isinstance(exc, K3pipeError | ValidationError):  # not one of k3pipe's own clear errors
        message = f"{type(exc).__name__}: {message}"
        where = log_path()
        hint = f"\n(the traceback is in {where}; --debug shows it here)" if where else ""
    typer.secho(f"error: {message}{hint}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def render(
    experiment: Annotated[Path, typer.Argument(help="Experiment YAML file.")],
    arm: Annotated[str | None, typer.Option(help="Only this arm.")] = None,
) -> None:
    """Print the study (arms in order, workloads), then per arm the engine's environment and exact
    command line."""
    from k3pipe.experiment.load import load_experiment
    from k3pipe.experiment.variants import changes, resolve
    from k3pipe.launchers import equivalent_command
    from k3pipe.planning.plan import plan_arm
    from k3pipe.records.design import design_lines
    from k3pipe.schema.schedule import describe_study

    try:
        spec = load_experiment(experiment)
        home = Settings().home_dir
        if not arm:
            print("\n".join(f"# {line}" for line in describe_study(spec)))
            # the design alone: a study says its cost and what it can see from the node's records
            print("\n".join(f"# {line}" for line in design_lines(spec)), end="\n\n")
        targets = [(spec, a, "") for a in spec.arms]
        for variant in spec.variants:
            varied = resolve(spec, variant.name)
            targets += [(varied, a, variant.name) for a in varied.arms]
        shown_variant = None
        for exp, a, variant_name in targets:
            if arm and a.name != arm:
                continue
            if variant_name and variant_name != shown_variant:
                shown_variant = variant_name
                chosen = next(x for x in spec.variants if x.name == variant_name)
                print(f"# ===== variant {chosen.name}: {chosen.description or '(no description)'}")
                for line in changes(spec, chosen.name):
                    print(f"#   {line}")
                print()
            plan = plan_arm(exp, a, home)
            print(
                f"# arm {a.name}{f' (variant {variant_name})' if variant_name else ''}: "
                f"engine {plan.engine}, launcher {plan.launcher}"
                + (f", image {plan.image}" if plan.image else "")
            )
            if a.launcher.port == "auto":
                print(
                    f"# launcher.port auto: {plan.launch.port} is free here now; each launch draws its own "
                    "where it is planned"
                )
            print("# environment")
            for k, v in plan.command.redacted_env().items():
                print(f"{k}={v}")
            cache = plan.compile_cache
            if cache is not None and cache.settings(plan.command.env):
                print(f"# set by k3pipe: the compile cache of this configuration (key {cache.key})")
                for k, v in cache.settings(plan.command.env).items():
                    print(f"{k}={v}")
            print(f"# {plan.launch.command_heading}")
            print(" \\\n    ".join(_groups(plan.command.redacted_argv())))
            equivalent = equivalent_command(plan)
            if equivalent:
                print("# the same, as one command line (an image is launched by its pinned digest)")
                print(equivalent)
            print(
                f"# endpoint: {plan.base_url}  model: {plan.model}  key from: ${plan.api_key_env or '(none)'}"
            )
            if plan.gateway is not None:
                gateway = plan.gateway
                print(
                    f"# requests through the gateway: {gateway.base_url}  model: {gateway.model}  "
                    f"key from: ${gateway.api_key_env or '(none)'}"
                )
            print()
    except K3pipeError as exc:
        _fail(exc)


def _groups(argv: list[str]) -> list[str]:
    """One flag (with its values) per line, shell-quoted."""
    import shlex

    lines: list[list[str]] = [[]]
    for token in argv:
        if token.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(token)
    return [shlex.join(group) for group in lines if group]


# The overrides of `run` and `study`: laid over every workload of the experiment (k3pipe.experiment.params).
RepeatsOpt = Annotated[
    int | None, typer.Option(min=1, help="Repeats of every workload (default: as in the file).")
]
RequestsOpt = Annotated[
    int | None, typer.Option(min=1, help="Measured requests of every workload (num_requests).")
]
ConcurrencyOpt = Annotated[
    int | None, typer.Option(min=1, help="Requests in flight at once in every workload.")
]
InputTokensOpt = Annotated[int | None, typer.Option(min=1, help="Prompt length in tokens of every workload.")]
OutputTokensOpt = Annotated[
    int | None, typer.Option(min=1, help="Tokens every request generates, in every workload.")
]
SpoolOpt = Annotated[
    bool,
    typer.Option(
        "--spool",
        help="Start even though MLflow does not answer: record into the spool (K3PIPE_HOME/spool) and "
        "push later with `k3pipe sync` (also K3PIPE_ALLOW_SPOOL=1).",
    ),
]


# The options `run`, `study` and `retest` take after the experiment and its arms (or variants),
# spelled once: each override (its option's name, and the field of
# k3pipe.experiment.params.Overrides it sets),
# then --spool. @run_options adds them to a command.
_OVERRIDE_OPTIONS: list[tuple[str, str, Any]] = [
    ("repeats", "repeats", RepeatsOpt),
    ("requests", "num_requests", RequestsOpt),
    ("concurrency", "concurrency", ConcurrencyOpt),
    ("input_tokens", "input_tokens", InputTokensOpt),
    ("output_tokens", "output_tokens", OutputTokensOpt),
]


def run_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command(..., *, overrides, spool)`` as a typer command that takes the override options and
    --spool after its own: ``overrides`` arrives as the fields of
    k3pipe.experiment.params.Overrides (None: not
    given), ``spool`` as the flag."""
    import functools
    import inspect

    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name not in ("overrides", "spool")]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [
        inspect.Parameter(name, keyword, default=None, annotation=opt) for name, _, opt in _OVERRIDE_OPTIONS
    ]
    added.append(inspect.Parameter("spool", keyword, default=False, annotation=SpoolOpt))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        overrides = {field: kwargs.pop(name) for name, field, _ in _OVERRIDE_OPTIONS}
        spool = kwargs.pop("spool")
        command(**kwargs, overrides=overrides, spool=spool)

    parameters = [*own, *added]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


def _request(experiment: Path, arms: list[str] | None, overrides: dict[str, int | None]) -> Any:
    """The run request of `run` and `study`, its experiment loaded with the overrides and its arms
    checked here, so that a bad file, override or arm name fails before Prefect starts."""
    from pydantic import ValidationError

    from k3pipe.experiment.params import Overrides, RunRequest

    try:
        request = RunRequest(experiment=str(experiment), arms=arms or None, overrides=Overrides(**overrides))
        request.arm_names(request.load())
    except (K3pipeError, ValidationError) as exc:
        _fail(exc)
    return request


@app.command()
@run_options
def run(
    experiment: Annotated[Path, typer.Argument(help="Experiment YAML file.")],
    arm: Annotated[list[str] | None, typer.Option(help="Only these arms (repeatable).")] = None,
    *,
    overrides: dict[str, int | None],
    spool: bool,
) -> None:
    """Run the experiment through the Prefect benchmark flow and record it in MLflow; the options
    after --arm override that field in every workload (recorded as override.* params)."""
    settings = Settings()
    request = _request(experiment, arm, overrides)
    _tracking_ready(settings, spool)
    prepare_prefect_env(settings, "k3pipe.flows.benchmark")
    from k3pipe.flows.benchmark import benchmark

    _print_outcomes(
        _run_flow(lambda: benchmark(request.experiment, arms=request.arms, overrides=request.overrides))
    )


@app.command()
@run_options
def study(
    experiment: Annotated[
        Path | None, typer.Argument(help="Experiment YAML file (with --resume: optional, checked).")
    ] = None,
    arm: Annotated[list[str] | None, typer.Option(help="Only these arms (repeatable).")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="STUDY_RUN_ID",
            help="Resume this study (its MLflow run id or a unique prefix): keep the launches that "
            "finished and the workloads an unfinished launch finished cleanly, run the rest, with its "
            "own experiment, arms and overrides.",
        ),
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Run in the background, surviving this command and its terminal: prints where its "
            "log is; `k3pipe detached` shows how it goes.",
        ),
    ] = False,
    *,
    overrides: dict[str, int | None],
    spool: bool,
) -> None:
    """Run every arm on every workload as one study (one parent MLflow run), then print its report's
    table and where the HTML report is. Exit 1 when an arm failed (the report covers the others).
    The options after --arm override that field in every workload (recorded as override.* params).
    With --resume, a study that did not finish (interrupted, killed, or with failed launches) goes
    on under its own run: finished launches (and workloads) are kept, the rest run, the report
    covers them all."""
    settings = Settings()
    if detach:
        from k3pipe.cli.detached import start_detached

        argv = [a for a in sys.argv[1:] if a != "--detach"]
        start_detached(settings.home_dir, argv, label=resume or (experiment.stem if experiment else "study"))
        return
    resumed = None
    if resume is not None:
        resumed = _resume_check(settings, resume, experiment, arm, overrides, spool)
    elif experiment is None:
        _fail(K3pipeError("no experiment: give an experiment file, or --resume STUDY_RUN_ID"))
    else:
        request = _request(experiment, arm, overrides)
    _tracking_ready(settings, spool)
    prepare_prefect_env(settings, "k3pipe.flows.study")
    from k3pipe.flows.study import study as study_flow
    from k3pipe.jobs.study import ArmsFailed

    def call() -> Any:
        if resumed is not None:
            return study_flow(resume=resumed)
        return study_flow(request.experiment, arms=request.arms, overrides=request.overrides)

    failed = None
    try:
        result = _run_flow(call, keep=ArmsFailed)
    except ArmsFailed as exc:
        failed, result = exc, exc.result
    _print_study(result)
    if failed is not None:
        typer.secho(f"error: {failed}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _resume_check(
    settings: Settings,
    resume: str,
    experiment: Path | None,
    arm: list[str] | None,
    overrides: dict[str, int | None],
    spool: bool,
) -> str:
    """The study run id to resume, once its record says it can be (before Prefect starts): a file
    given must be its experiment (with the overrides given, as it was started); arms and the spool
    cannot be chosen anew."""
    from k3pipe.jobs.resume import check_experiment, resume_point
    from k3pipe.records.tracking import Tracker

    if arm:
        _fail(K3pipeError("--arm cannot be given with --resume: the study runs its own arms"))
    if spool:
        _fail(K3pipeError("--spool cannot be given with --resume: resuming reads the study from MLflow"))
    if experiment is None and any(v is not None for v in overrides.values()):
        _fail(
            K3pipeError(
                "overrides with --resume need the experiment file: give both as the study was started, "
                "or neither (the study's own are used)"
            )
        )
    _tracking_ready(settings, False)
    _close_gone(settings)  # the killed command's runs ended KILLED before the study's state is read
    try:
        tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
        point = resume_point(tracker, resume)
        if experiment is not None:
            request = _request(experiment, None, overrides)
            check_experiment(point, request.load(), str(experiment))
    except K3pipeError as exc:
        _fail(exc)
    typer.echo(f"resuming {point.summary()}")
    return point.run_id


# `k3pipe retest accept RUN_ID`: a subcommand of a command that takes an experiment file (a typer group
# would take the file for a subcommand's name); an experiment file named "accept" is ./accept.
accept_app = typer.Typer(add_completion=False)


@accept_app.command()
def accept(
    run_id: Annotated[
        str,
        typer.Argument(metavar="RETEST_RUN_ID", help="The retest's MLflow run id (a unique prefix will do)."),
    ],
) -> None:
    """Accept a retest as the new baseline (a version bump or a node change that is the new normal):
    every later retest of its experiment, with its overrides, is judged against the series that
    starts at this retest, and the alerts raised since it are cleared."""
    from k3pipe.jobs.alerts import accept as accept_retest

    settings = Settings()
    try:
        done = accept_retest(_tracker(settings), run_id)
    except K3pipeError as exc:
        _fail(exc)
        return
    overrides = ", ".join(f"{k.removeprefix('override.')}={v}" for k, v in done.overrides.items()) or "none"
    print(
        f"retest {done.run_id} accepted at {done.at} as the new baseline of {done.experiment} "
        f"(overrides: {overrides}): later retests are judged against the series that starts there "
        f"({done.later} retest(s) of it so far)"
    )
    if done.newer_accepted:
        typer.secho(
            f"note: retest {done.newer_accepted}, later, is accepted too: the series starts there, not here",
            fg=typer.colors.YELLOW,
            err=True,
        )


class _RetestCommand(TyperCommand):
    """`retest EXPERIMENT ...` runs a retest; `retest accept RETEST_RUN_ID` is :func:`accept`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args[:1] == ["accept"]:
            code = typer.main.get_command(accept_app).main(
                args[1:], prog_name=f"{ctx.command_path} accept", standalone_mode=False
            )
            ctx.exit(code if isinstance(code, int) else 0)
        return super().parse_args(ctx, args)


@app.command(cls=_RetestCommand)
@run_options
def retest(
    experiment: Annotated[Path, typer.Argument(help="Experiment YAML file with `variants:`.")],
    variant: Annotated[
        list[str] | None, typer.Option(help="Only these variants (repeatable; default: all of them).")
    ] = None,
    *,
    overrides: dict[str, int | None],
    spool: bool,
) -> None:
    """Run the baseline and each variant as studies under one MLflow run, then judge every variant
    against the baseline (better, worse, equivalent or inconclusive, with the interval of the change),
    and the baseline against the series of earlier retests (a regression alert). Exit 1 when a study
    failed (the report judges the others). The options after --variant override that field in every
    workload, the baseline's and the variants' (recorded as override.* params).

    `k3pipe retest accept RETEST_RUN_ID` accepts a retest as the new baseline of the alerts."""
    from pydantic import ValidationError

    from k3pipe.experiment.params import Overrides, RunRequest
    from k3pipe.jobs.retest_run import retest_targets

    settings = Settings()
    try:
        request = RunRequest(
            experiment=str(experiment), variants=variant or None, overrides=Overrides(**overrides)
        )
        spec = request.load()
        retest_targets(spec, request.variant_names(spec))  # a bad file, override or name fails here
    except (K3pipeError, ValidationError) as exc:
        _fail(exc)
    _tracking_ready(settings, spool)
    prepare_prefect_env(settings, "k3pipe.flows.retest")
    from k3pipe.flows.retest import retest as retest_flow
    from k3pipe.jobs.retest import VariantsFailed

    failed = None
    try:
        result = _run_flow(
            lambda: retest_flow(str(experiment), variants=request.variants, overrides=request.overrides),
            keep=VariantsFailed,
        )
    except VariantsFailed as exc:
        failed, result = exc, exc.result
    _print_report_text(result["report"])
    for label, s in result["studies"].items():
        print(f"{label}: study run id {s['study_run_id']}")
    print(f"retest: MLflow run id {result['retest_run_id']}")
    print(f"report: {result['report']['html']} (Markdown: {result['report']['markdown']})")
    if failed is not None:
        typer.secho(f"error: {failed}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _tracker(settings: Settings, artifact_root: Path | None = None) -> Any:
    """The tracker of K3PIPE_HOME's (or MLFLOW_TRACKING_URI's) store; ``artifact_root``: read the
    runs' artifacts from there (a store moved from another machine, ``--artifact-root``)."""
    from k3pipe.records.tracking import Tracker

    return Tracker(
        settings.tracking_uri(),
        settings.mlflow_experiment,
        settings.artifact_root(),
        read_artifacts_from=artifact_root,
        allow_spool=False,  # a command that reads (or accepts a baseline) has no use for the spool
    )


ARTIFACT_ROOT_HELP = (
    "Read the runs' artifacts from this directory instead of where the MLflow store records them (a "
    "store brought from another machine, e.g. a GPU node's record): a run recorded at "
    "<recorded root>/<run_id>/artifacts is read from DIR/<run_id>/artifacts (DIR: the copy of the "
    "recorded root, the record's mlflow/artifacts)."
)


def _print_report_text(paths: dict[str, Any]) -> None:
    """The report's terminal text, as the flow wrote it (report.txt): the report is built once."""
    print(Path(paths["text"]).read_text(), end="")


def _print_study(result: dict[str, Any]) -> None:
    _print_report_text(result["report"])
    launches = Counter(o["arm"] for o in result["arms"])
    for o in result["arms"]:
        launch = f" launch {o.get('launch', 1)}" if launches[o["arm"]] > 1 else ""
        print(f"arm {o['arm']}{launch}: {o['status']}, MLflow run id {o['mlflow_run_id']}")
    print(f"study: MLflow run id {result['study_run_id']}")
    print(f"report: {result['report']['html']} (Markdown: {result['report']['markdown']})")


@app.command()
def report(
    study_run: Annotated[
        str, typer.Argument(help="A study's or a retest's MLflow run id (a unique prefix will do).")
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Directory for report.md, report.html and plots/ (default: under K3PIPE_HOME/reports)."
        ),
    ] = None,
    attach: Annotated[
        bool, typer.Option(help="Also attach the regenerated report to the study's run.")
    ] = False,
    artifact_root: Annotated[
        Path | None, typer.Option("--artifact-root", metavar="DIR", help=ARTIFACT_ROOT_HELP)
    ] = None,
) -> None:
    """Regenerate a study's (or a retest's) report from MLflow alone: print its table, write
    Markdown and HTML. A study whose artifacts (each workload's repeats, each run's requests) cannot
    be read is an error, never a report of single repeats."""
    from k3pipe.core.layout import RETEST_KIND
    from k3pipe.records.compare import find_run
    from k3pipe.report import build_report, publish, report_dir

    if attach and artifact_root is not None:
        # MLflow writes a run's artifacts where its record says: the other machine's path, not DIR
        _fail(
            K3pipeError(
                f"--attach cannot be used with --artifact-root {artifact_root}: MLflow would write the "
                "report to the artifact location the store records for the study's run (the other "
                "machine's path), not into the moved copy; leave out --attach (the report is written "
                "under --out), or attach it where the store's recorded paths exist"
            )
        )
    settings = Settings()
    _close_gone(settings)
    try:
        tracker = _tracker(settings, artifact_root)
        run = find_run(tracker, study_run)
        tracker.check_artifact_root(run.info.run_id)
        if RunTags.of(run).kind == RETEST_KIND:
            _retest_report(settings, tracker, study_run, out, attach)
            return
        rep = build_report(tracker, study_run)
        target = out or report_dir(settings.home_dir, rep.data.name, rep.data.run_id)
        paths = publish(tracker, rep, target) if attach else rep.write(target)
    except K3pipeError as exc:
        _fail(exc)
        return
    print(rep.text())
    flagged = [b for b in rep.analysis.bounds if b.exceeds] + [
        c for c in rep.analysis.claims if not c.follows
    ]
    if flagged:
        typer.secho(f"{len(flagged)} figure(s) flagged: see the report's checks", fg=typer.colors.YELLOW)
    print(f"report: {paths['html']} (Markdown: {paths['markdown']})")


def _retest_report(settings: Settings, tracker: Any, ref: str, out: Path | None, attach: bool) -> None:
    from k3pipe.report import retest_dir
    from k3pipe.report.retest_verdicts import build_retest_report, publish_retest

    rep = build_retest_report(tracker, ref)
    target = out or retest_dir(settings.home_dir, rep.data.name, rep.data.run_id)
    paths = publish_retest(tracker, rep, target) if attach else rep.write(target)
    print(rep.text())
    print(f"report: {paths['html']} (Markdown: {paths['markdown']})")


def _run_flow(call: Callable[[], Any], keep: type[BaseException] | None = None) -> Any:
    """A flow's outcomes. Ctrl-C exits 130 and SIGTERM 143, once the flow has stopped the engine and
    recorded what was measured (its flow runs are marked Cancelled); an error exits 2, said in one
    message (the traceback in the log)."""
    from k3pipe.core.procs import GroupRegistry, stop_group

    home = Settings().home_dir

    def end_mine() -> None:
        for record in GroupRegistry(home).mine():
            stop_group(record.pgid, record.proc_start, ((signal.SIGTERM, 2.0),), kill_wait_s=2.0)

    hide_tracebacks()
    interrupts = Interrupts(on_deadline=end_mine)

    try:
        with interrupts.installed():
            return call()
    except KeyboardInterrupt:
        sig = interrupts.received or signal.SIGINT
        mark_cancelled(home, f"interrupted by {sig.name}")
        typer.secho(
            f"interrupted ({sig.name}): the engine was stopped; what was measured is recorded (MLflow "
            "runs ended KILLED)",
            fg=typer.colors.YELLOW,
            err=True,
        )
        raise typer.Exit(interrupts.exit_code) from None
    except Exception as exc:
        if keep is not None and isinstance(exc, keep):
            raise
        _fail(exc)
        raise  # not reached: _fail exits


@app.command()
def rerun(
    run_id: Annotated[
        str, typer.Argument(help="An arm's MLflow run id (or a workload run's), or a study's; prefix ok.")
    ],
    allow_drift: Annotated[
        bool,
        typer.Option(help="Rerun although a model file differs from the record (recorded as drift)."),
    ] = False,
) -> None:
    """Run an arm, or a whole study, again from its MLflow record alone, then compare the new run
    with the original (a study: each launch against the same launch of the original)."""
    settings = Settings()
    kind = _run_kind(settings, run_id)
    if kind == "study":
        _rerun_study(settings, run_id, allow_drift)
        return
    if kind == "retest":
        _rerun_retest(settings, run_id, allow_drift)
        return
    prepare_prefect_env(settings, "k3pipe.flows.benchmark")
    from k3pipe.bench.repeats import Comparison
    from k3pipe.flows.benchmark import rerun as rerun_flow

    outcomes = _run_flow(lambda: rerun_flow(run_id, allow_drift=allow_drift))
    _print_outcomes(outcomes)
    for o in outcomes:
        for v in o.get("verdicts", []):
            print(f"\n{o['arm']} / {v['workload']}: {v['verdict']}  (rerun of {o['rerun_of'][:12]})")
            print(f"  {'metric':<28}{'original':>12}{'rerun':>12}  {'change [interval]':<28}verdict")
            for raw in v["metrics"]:
                c = Comparison.model_validate(raw)
                change = c.change_text()
                print(f"  {c.metric:<28}{c.mean_a:>12.3f}{c.mean_b:>12.3f}  {change:<28}{c.verdict()}")


def _run_kind(settings: Settings, run_ref: str) -> str | None:
    """The ``k3pipe.kind`` tag of the run ``run_ref`` names (None: an arm's, or a run not found here:
    the arm rerun then says so)."""
    from k3pipe.records.compare import find_run

    try:
        kind: str | None = find_run(_tracker(settings), run_ref).data.tags.get(KIND_TAG)
        return kind
    except K3pipeError:
        return None


def _rerun_study(settings: Settings, run_id: str, allow_drift: bool) -> None:
    """A study run again from its records, then its verdicts per arm and workload (over all launches)."""
    prepare_prefect_env(settings, "k3pipe.flows.study")
    from k3pipe.bench.repeats import Comparison
    from k3pipe.flows.study import study as study_flow
    from k3pipe.jobs.study import ArmsFailed

    failed = None
    try:
        result = _run_flow(lambda: study_flow(rerun=run_id, allow_drift=allow_drift), keep=ArmsFailed)
    except ArmsFailed as exc:
        failed, result = exc, exc.result
    _print_study(result)
    for v in result.get("verdicts", []):
        print(
            f"\n{v['arm']} / {v['workload']} (launches {v.get('launches', '?')}): {v['verdict']}  "
            f"(rerun of study {run_id[:12]})"
        )
        print(f"  {'metric':<28}{'original':>12}{'rerun':>12}  {'change [interval]':<28}verdict")
        for raw in v["metrics"]:
            c = Comparison.model_validate(raw)
            print(f"  {c.metric:<28}{c.mean_a:>12.3f}{c.mean_b:>12.3f}  {c.change_text():<28}{c.verdict()}")
    if failed is not None:
        typer.secho(f"error: {failed}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _rerun_retest(settings: Settings, run_id: str, allow_drift: bool) -> None:
    """A retest run again from its records: each study's verdicts against its original, then the
    retest's report (the variants against the baseline again)."""
    prepare_prefect_env(settings, "k3pipe.flows.retest")
    from k3pipe.flows.retest import retest as retest_flow
    from k3pipe.jobs.retest import VariantsFailed

    failed = None
    try:
        result = _run_flow(lambda: retest_flow(rerun=run_id, allow_drift=allow_drift), keep=VariantsFailed)
    except VariantsFailed as exc:
        failed, result = exc, exc.result
    _print_report_text(result["report"])
    for label, s in result["studies"].items():
        print(f"{label}: study run id {s['study_run_id']} (rerun of {s.get('rerun_of', '?')[:12]})")
        for v in s.get("verdicts", []):
            print(f"  {v['arm']} / {v['workload']}: {v['verdict']}")
    print(f"retest: MLflow run id {result['retest_run_id']} (rerun of {run_id[:12]})")
    if failed is not None:
        typer.secho(f"error: {failed}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def _print_outcomes(outcomes: list[dict[str, Any]]) -> None:
    import pandas as pd

    from k3pipe.records.derive import summary_table

    rows = [row for o in outcomes for row in o.get("workloads", [])]
    if rows:
        print(pd.DataFrame(summary_table(rows)).to_string(index=False))
    for o in outcomes:
        print(f"arm {o['arm']}: {o['status']}, MLflow run id {o['mlflow_run_id']}")


@app.command()
def preflight(
    experiment: Annotated[Path, typer.Argument(help="Experiment YAML file.")],
    model_config: Annotated[
        Path | None,
        typer.Option(
            "--model-config",
            help="The model's config.json, or its directory (default: the downloaded model's, if present).",
        ),
    ] = None,
    weights_gib: Annotated[
        float | None,
        typer.Option(help="Total size of the weights, GiB (default: the model directory's *.safetensors)."),
    ] = None,
) -> None:
    """Check an experiment before launching it; exit 1 if any finding is an error."""
    import textwrap

    from k3pipe.experiment.load import load_experiment
    from k3pipe.experiment.preflight import preflight as run_preflight
    from k3pipe.experiment.preflight import read_model_config, safetensors_bytes
    from k3pipe.planning.plan import default_model_dirs

    try:
        spec = load_experiment(experiment)
        model_dir = Path(default_model_dirs(spec, Settings().home_dir)["model"])
        config_path = model_config if model_config is not None else model_dir
        config = read_model_config(config_path)
        if model_config is not None and config is None:
            _fail(ValueError(f"--model-config {model_config}: no such file, and no config.json in it"))
        if weights_gib is not None:
            weight_bytes: int | None = int(weights_gib * 2**30)
        else:
            weight_bytes = safetensors_bytes(config_path if config_path.is_dir() else model_dir)
        configs = {"model": config} if config is not None else None
        # this machine too (ports, GPUs): a run checks it after reaping its orphans, this command as
        # things stand now
        from k3pipe.machine.node import gpus_here

        gpus = gpus_here()
        findings = run_preflight(spec, configs, weight_bytes=weight_bytes, this_machine=True, gpus=gpus)
        from k3pipe.experiment.variants import resolve

        for v in spec.variants:
            variant = resolve(spec, v.name)
            for f in run_preflight(variant, configs, weight_bytes=weight_bytes, this_machine=True, gpus=gpus):
                if f.arm is not None:  # the experiment-wide findings are the baseline's too
                    findings.append(f.model_copy(update={"arm": f"{f.arm}@{v.name}"}))
    except K3pipeError as exc:
        _fail(exc)
        return

    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    print(
        f"preflight {spec.name}: {counts['error']} error(s), {counts['warning']} warning(s), "
        f"{counts['info']} info"
    )
    groups: list[tuple[str, str | None]] = [("experiment", None)] + [
        (f"arm {a.name} ({a.engine.kind})", a.name) for a in spec.arms
    ]
    groups += [
        (f"arm {a} of variant {v.name} ({spec.arm(a).engine.kind})", f"{a}@{v.name}")
        for v in spec.variants
        for a in v.arms
    ]
    for title, arm_name in groups:
        mine = [f for f in findings if f.arm == arm_name]
        if arm_name is None and not mine:
            continue
        print(f"\n{title}")
        if not mine:
            print("  no findings")
        for f in mine:
            print(f"  {f.severity.upper():<8} {f.rule}")
            print(
                textwrap.fill(
                    f.message,
                    width=110,
                    initial_indent=" " * 11,
                    subsequent_indent=" " * 11,
                    break_on_hyphens=False,
                )
            )
    if counts["error"]:
        raise typer.Exit(1)


@app.command()
def runs(
    limit: Annotated[int, typer.Option(help="How many runs.")] = 20,
    engine: Annotated[str | None, typer.Option(help="Only arms of this engine kind (vllm, sglang).")] = None,
    model: Annotated[str | None, typer.Option(help="Only arms that served this model id.")] = None,
    workload: Annotated[str | None, typer.Option(help="Only this workload's rows.")] = None,
    since: Annotated[
        str | None, typer.Option(help="Only runs started on or after this date (2026-12-01).")
    ] = None,
    variant: Annotated[
        str | None, typer.Option(help="Only a retest's studies of this variant (or 'baseline').")
    ] = None,
) -> None:
    """Recent runs in MLflow with their key metrics (a study with its arms beneath it, a retest with
    its studies)."""
    import pandas as pd

    from k3pipe.records.history import recent_runs

    settings = Settings()
    _close_gone(settings)
    try:
        tracker = _tracker(settings)
        frame = recent_runs(
            tracker, limit, engine=engine, model=model, workload=workload, since=since, variant=variant
        )
    except K3pipeError as exc:
        _fail(exc)
        return
    if frame.empty:
        filtered = any((engine, model, workload, since, variant))
        print(f"no {'matching ' if filtered else ''}runs in {settings.tracking_uri()}")
        return
    runs_full_id = str(frame.iloc[0]["run_id"])
    frame["run_id"] = frame["run_id"].str[:12]
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(frame.round(2).to_string(index=False))
    print(f"\nbrowse: {tracker.run_link(runs_full_id)}")


@app.command()
def detached(
    name: Annotated[
        str | None, typer.Argument(help="One detached command (its name, or a unique start of it).")
    ] = None,
    lines: Annotated[int, typer.Option(min=1, help="Log lines to show of the one named.")] = 30,
) -> None:
    """Commands started with --detach (`k3pipe study --detach`): each one's state (running, or its
    exit status), its study run and its last log line; with NAME, the end of its log."""
    from k3pipe.cli.detached import detached_jobs

    jobs = detached_jobs(Settings().home_dir)
    if name is not None:
        found = [j for j in jobs if j.name.startswith(name)]
        if len(found) != 1:
            known = ", ".join(j.name for j in jobs[-5:]) or "none"
            _fail(K3pipeError(f"{len(found) or 'no'} detached command(s) named {name!r}; latest: {known}"))
        job = found[0]
        print(f"{job.name}: {job.state()}; k3pipe {' '.join(job.argv)}")
        if job.study_run():
            print(f"study run: {job.study_run()}")
        print(f"log: {job.path / 'output.log'}")
        print("\n".join(job.log_tail(lines)))
        return
    if not jobs:
        print(f"no detached commands in {Settings().home_dir / 'detached'}")
        return
    for job in jobs:
        tail = job.log_tail(1)
        print(f"{job.name}: {job.state()}; study run {job.study_run() or '(not yet)'}")
        print(f"    k3pipe {' '.join(job.argv)}")
        if tail:
            print(f"    {tail[0][:160]}")


@app.command()
def history(
    metric: Annotated[
        str, typer.Argument(help="A workload metric, e.g. ttft_ms_p50, output_throughput_tps.")
    ],
    workload: Annotated[str, typer.Option(help="The workload whose runs to follow.")],
    arm: Annotated[str | None, typer.Option(help="Only this arm.")] = None,
    engine: Annotated[str | None, typer.Option(help="Only arms of this engine kind.")] = None,
    variant: Annotated[
        str | None, typer.Option(help="Only runs of this variant ('baseline': runs of no variant).")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Also write the trend as a PNG here.")] = None,
) -> None:
    """A metric's trend across the runs, reruns and studies that measured a workload, oldest first."""
    import pandas as pd

    from k3pipe.records.history import metric_history, plot_history

    settings = Settings()
    try:
        frame = metric_history(_tracker(settings), metric, workload, arm=arm, engine=engine, variant=variant)
    except K3pipeError as exc:
        _fail(exc)
        return
    shown = frame.assign(run_id=frame["run_id"].str[:12])
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(shown.round(2).to_string(index=False))
    if plot is not None:
        plot.write_bytes(plot_history(frame, metric, workload))
        print(f"plot: {plot}")


@app.command("compare")
def compare_cmd(
    run_a: Annotated[
        str, typer.Argument(help="Workload run id, or engine run id with --workload (prefix ok).")
    ],
    run_b: Annotated[str, typer.Argument(help="The run to compare against RUN_A.")],
    workload: Annotated[str | None, typer.Option(help="Workload name, when the ids are engine runs.")] = None,
    metric: Annotated[list[str] | None, typer.Option(help="Metric to compare (repeatable).")] = None,
    artifact_root: Annotated[
        Path | None, typer.Option("--artifact-root", metavar="DIR", help=ARTIFACT_ROOT_HELP)
    ] = None,
) -> None:
    """Is workload B different from workload A, equivalent, or can the data not tell? Per metric, over
    their repeats (docs/measurement.md, 'Verdicts'). A workload of repeats whose repeats.json cannot be
    read is an error, never one repeat."""
    from k3pipe.records.compare import DEFAULT_METRICS, compare_workloads, resolve_workload_run

    settings = Settings()
    try:
        tracker = _tracker(settings, artifact_root)
        a = resolve_workload_run(tracker, run_a, workload)
        b = resolve_workload_run(tracker, run_b, workload)
        for run in (a, b):
            tracker.check_artifact_root(run.info.run_id)
        rows = compare_workloads(tracker, a, b, metric or DEFAULT_METRICS)
    except K3pipeError as exc:
        _fail(exc)
        return
    if not rows:
        _fail(K3pipeError("the two runs share none of the metrics asked for"))
    print(f"A: {a.info.run_name} ({a.info.run_id[:12]})   B: {b.info.run_name} ({b.info.run_id[:12]})")
    print(
        f"B against A on the log ratio of geometric means; {len(rows)} comparison(s) share alpha 0.05 "
        f"({rows[0].confidence:.2%} intervals)"
    )
    print(f"{'metric':<24}{'mean A':>12}{'mean B':>12}  {'change [interval]':<28}verdict")
    for c in rows:
        print(f"{c.metric:<24}{c.mean_a:>12.3f}{c.mean_b:>12.3f}  {c.change_text():<28}{c.verdict()}")


@app.command()
def bundle(
    out: Annotated[Path, typer.Option("--out", help="Directory for the parts, manifest.json, install.sh.")],
    engine: Annotated[
        list[str] | None, typer.Option(help="Engine requirement, e.g. vllm==0.22.0 (repeatable).")
    ] = None,
    node_freeze: Annotated[
        Path | None, typer.Option(help="'python3 -m pip list --format=freeze' taken on the node.")
    ] = None,
    python_version: Annotated[
        str | None, typer.Option(help="Target CPython MAJOR.MINOR (default: this interpreter's).")
    ] = None,
    platform: Annotated[
        str | None,
        typer.Option(help="Target wheel platform, e.g. manylinux_2_35_x86_64 (default: this machine's)."),
    ] = None,
    part_size_mib: Annotated[
        float, typer.Option(help="Largest part, MiB (56: one part beside the repository fits a device call).")
    ] = 56.0,
    pipeline: Annotated[bool, typer.Option(help="Include k3pipe's wheel and its dependencies.")] = True,
    upgrade: Annotated[
        list[str] | None,
        typer.Option(help="Node package that may resolve to another version, bundled (repeatable)."),
    ] = None,
    keep_node: Annotated[
        list[str] | None,
        typer.Option(help="Node package kept at its node version though a requirement pins another."),
    ] = None,
    omit: Annotated[
        list[str] | None,
        typer.Option(help="Package declared but not needed on the node: left out (repeatable)."),
    ] = None,
    note: Annotated[
        list[str] | None, typer.Option(help="A line install.sh prints at the end (repeatable).")
    ] = None,
    index_url: Annotated[
        str | None, typer.Option(help="Package index (default: uv's and pip's own).")
    ] = None,
) -> None:
    """Bundle every wheel an air-gapped node lacks: parts, manifest.json and install.sh."""
    from k3pipe.ops.bundle import BundleRequest, Target, build_bundle

    try:
        here = Target.this_machine()
        target = Target(python_version or here.python_version, platform or here.platform)
        req = BundleRequest(
            out_dir=out,
            engine=tuple(engine or ()),
            pipeline=pipeline,
            node_freeze=node_freeze,
            target=target,
            part_size=int(part_size_mib * 2**20),
            upgrade=tuple(upgrade or ()),
            keep_node=tuple(keep_node or ()),
            omit=tuple(omit or ()),
            index_url=index_url,
            notes=tuple(note or ()),
        )
        result = build_bundle(req, Settings().home_dir, progress=lambda line: print(line, flush=True))
    except K3pipeError as exc:
        _fail(exc)
        return
    m = result.manifest
    for part in m["parts"]:
        print(f"  {part['name']}  {part['size'] / 2**20:7.2f} MiB  sha256 {part['sha256'][:16]}")
    print(
        f"{len(m['wheels'])} wheels, {len(m['parts'])} parts, {result.total_size / 2**20:.1f} MiB "
        f"in {result.out_dir}; "
        f"{len(m['left_out'])} packages left out (manifest.json says why)"
    )
    print(f"on the node: copy every file of {result.out_dir} into one directory; bash install.sh --help")


def _close_gone(settings: Settings, sync: bool = True) -> None:
    """What killed k3pipe commands left open, closed before this one reads the store (k3pipe/cli/closing.py);
    a home that cannot be used is the command's own error to say."""
    from k3pipe.cli.closing import close_gone

    try:
        close_gone(settings, sync=sync)
    except OSError as exc:
        _fail(K3pipeError(f"K3PIPE_HOME {settings.home_dir} cannot be used: {exc}"))


def _tracking_ready(settings: Settings, spool: bool) -> None:
    """Before a run starts anything: MLflow answers (else the one-sentence error, in seconds), unless
    the spool is allowed (--spool, K3PIPE_ALLOW_SPOOL). What the spool still holds from earlier runs
    is pushed once the command's Prefect is up (k3pipe.cli.closing.close_gone, from prepare_prefect_env)."""
    from k3pipe.core.errors import TrackingUnreachableError
    from k3pipe.records.push import probe_tracking, unreachable_message

    if spool:
        os.environ["K3PIPE_ALLOW_SPOOL"] = "1"  # the flow's own Settings() reads it
    uri = settings.tracking_uri()
    reason = probe_tracking(uri, settings.mlflow_probe_timeout_s)
    if reason is not None:
        if not (spool or settings.allow_spool):
            _fail(TrackingUnreachableError(unreachable_message(uri, reason)))
        return  # the flow's tracker says it once: recording into the spool


@app.command()
def sync() -> None:
    """Push what the spool holds (runs recorded while MLflow was down, K3PIPE_HOME/spool) to the
    MLflow each was recorded for. Exit 0 when all of it is in MLflow, 1 while some is still pending."""
    from k3pipe.records.sync import sync_spool

    settings = Settings()
    _close_gone(settings, sync=False)  # the engines and flow runs of killed commands; the spool below
    report = sync_spool(settings.spool_dir(), probe_timeout_s=settings.mlflow_probe_timeout_s)
    for line in report.lines():
        print(line)
    if not report.done:
        raise typer.Exit(1)


def main() -> None:
    from k3pipe.core.secrets import ScrubbedStream, install_log_filter
    from k3pipe.core.settings import load_settings

    # MLflow's per-download progress bars would interleave with the tables (rerun reads artifacts)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # whatever reaches the terminal (tables, errors, Prefect's log lines, a traceback) is scrubbed of
    # the run's secrets; before Prefect is imported, so that its console handler writes through it
    sys.stdout, sys.stderr = ScrubbedStream(sys.stdout), ScrubbedStream(sys.stderr)
    install_log_filter()
    try:
        # the log file before typer parses anything (--debug is looked for here; typer lists it in
        # --help); a bad K3PIPE_ variable is refused here, before any log file, in one clear line
        configure_logging(load_settings().home_dir, "--debug" in sys.argv[1:] or _env_debug())
        app()  # exits: usage errors 2, typer.Exit(code) its code
    except KeyboardInterrupt:
        typer.secho("interrupted", fg=typer.colors.YELLOW, err=True)
        sys.exit(130)
    except Exception as exc:  # one message; the traceback in the log (and here with --debug)
        try:
            _fail(exc)
        except typer.Exit as done:
            sys.exit(done.exit_code)


def _env_debug() -> bool:
    return os.environ.get("K3PIPE_DEBUG", "") not in ("", "0")


if __name__ == "__main__":
    main()
