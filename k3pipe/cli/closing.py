"""What a k3pipe process that is gone left open, closed by the next command that opens the store.

A process killed before its teardown (SIGKILL, the OOM killer, a closed laptop lid on a remote
shell) leaves its engines running, its MLflow runs RUNNING and its Prefect flow runs Running, for
good: nobody else will end them. Every command that opens the store (run, study, retest, rerun,
runs, report, sync) first calls :func:`close_gone`, which ends, for each process that is gone:

- the process groups it started (engines, a temporary Prefect server):
  :class:`~k3pipe.core.procs.GroupRegistry`;
- its MLflow runs, KILLED at their last record's time, from the spool session it leaves
  (:mod:`k3pipe.records.sync`);
- its Prefect flow runs, Crashed, from its owner record (:mod:`k3pipe.core.owners`), through the API each
  was created on; one created on the process's temporary server is closed through a server started
  on the same database (this command's own, or one started for the purpose and stopped after).

Each line says what was done, and only that: a flow run Prefect cannot be reached for is left, said
so, and tried again by the next command.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

from k3pipe.core.owners import FlowRunNote, OwnerRecord, Owners, local_prefect
from k3pipe.core.procs import GroupRegistry
from k3pipe.core.settings import Settings

__all__ = ["close_gone"]

Say = Callable[[str], None]


def _say(line: str) -> None:
    typer.secho(line, fg=typer.colors.YELLOW, err=True)


def close_gone(settings: Settings, *, sync: bool = True, say: Say = _say) -> None:
    """Close what every k3pipe process of this home that is gone left open (see the module);
    ``sync``: also push the spool (ending the MLflow runs of dead processes) when MLflow answers
    (``k3pipe sync`` does that itself)."""
    home = settings.home_dir
    GroupRegistry(home).reap_orphans(progress=say)
    if sync:
        _sync(settings, say)
    gone = Owners(home).gone()
    if gone:
        _close_flow_runs(home, gone, say)


def _sync(settings: Settings, say: Say) -> None:
    from k3pipe.records.push import probe_tracking
    from k3pipe.records.spool import list_sessions

    if not list_sessions(settings.spool_dir()):
        return
    if probe_tracking(settings.tracking_uri(), settings.mlflow_probe_timeout_s) is not None:
        return  # the command says so itself (or records into the spool); its sessions stay
    from k3pipe.records.sync import sync_spool

    report = sync_spool(settings.spool_dir(), probe_timeout_s=settings.mlflow_probe_timeout_s)
    if report.records or report.abandoned or not report.done:
        for line in report.lines():
            say(f"spool: {line}")


def _why(owner: OwnerRecord) -> str:
    return (
        f"{owner.describe()} ended without ending this flow run (killed: SIGKILL, the OOM killer, a lost "
        "machine); a later k3pipe command set it Crashed"
    )


def _close_flow_runs(home: Path, gone: list[OwnerRecord], say: Say) -> None:
    """Set Crashed each flow run of a gone process that Prefect still has unfinished; forget the
    process's record once each of its flow runs is final."""
    # the API each note lives on: its own, or (a dead temporary server) a server on its database
    by_api: dict[tuple[str, str | None], list[tuple[OwnerRecord, FlowRunNote]]] = {}
    for owner in gone:
        for note in owner.flow_runs:
            key = (note.api_url, None) if note.prefect_home is None else ("", note.prefect_home)
            by_api.setdefault(key, []).append((owner, note))
    unfinished: set[int] = set()
    for (api_url, prefect_home), notes in by_api.items():
        try:
            with _prefect_api(home, api_url, prefect_home, say) as url:
                for owner, note in notes:
                    if not _crash(url, note, _why(owner), owner, say):
                        unfinished.add(owner.pid)
        except Exception as exc:  # no Prefect to reach: said, and tried again by the next command
            where = f"the Prefect database in {prefect_home}" if prefect_home else f"Prefect at {api_url}"
            names = ", ".join(f"'{n.name}'" for _, n in notes)
            say(
                f"could not close the flow run(s) {names} of k3pipe process(es) that are gone: {where} "
                f"cannot be reached ({type(exc).__name__}: {str(exc)[:200]}); the next k3pipe command "
                "tries again"
            )
            unfinished.update(owner.pid for owner, _ in notes)
    owners = Owners(home)
    for owner in gone:
        if owner.pid not in unfinished:
            owners.forget(owner)


@contextlib.contextmanager
def _prefect_api(home: Path, api_url: str, prefect_home: str | None, say: Say) -> Iterator[str]:
    """The API URL to reach ``api_url``'s flow runs, or (``prefect_home``: a dead temporary server's)
    a server on that database: this command's own, else one started now and stopped after."""
    if prefect_home is None:
        yield api_url
        return
    mine = local_prefect()
    if mine is not None and os.path.realpath(mine[1]) == os.path.realpath(prefect_home):
        yield mine[0]
        return
    from k3pipe.cli.local_prefect import LocalPrefect

    say(f"starting a Prefect server on {prefect_home} to close flow runs left Running there")
    server = LocalPrefect(home, Path(prefect_home))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def _crash(api_url: str, note: FlowRunNote, why: str, owner: OwnerRecord, say: Say) -> bool:
    """Set the flow run Crashed if Prefect has it unfinished; whether it is final now (or unknown
    to that Prefect: nothing to close there)."""
    from uuid import UUID

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            state = client.read_flow_run(UUID(note.id)).state
        except ObjectNotFound:
            return True
        if state is not None and state.is_final():
            return True
        was = state.name if state is not None else "no state"
        client.set_flow_run_state(UUID(note.id), Crashed(message=why), force=True)
    say(f"Prefect flow run '{note.name}' ({note.id}) of {owner.describe()}, which is gone: {was} -> Crashed")
    return True
