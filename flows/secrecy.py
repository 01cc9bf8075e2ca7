"""Keeping secrets out of Prefect's database and logs: the flows are :class:`ScrubbedFlow` objects.

Prefect stores a flow run's parameters (``experiment_yaml`` is a whole experiment, and may hold a key
written in it) when it creates the run, before the flow's body runs; it stores logs, state messages
(an exception's text) and artifacts as they come. So:

- :meth:`ScrubbedFlow.serialize_parameters`, which makes the parameters Prefect stores, first
  registers the secrets of an ``experiment_yaml`` with k3pipe's scrubber (:mod:`k3pipe.core.secrets`),
  then scrubs every parameter: the stored experiment holds ``'***'`` where a key was (such an
  experiment is written again as YAML, without its comments);
- a run created elsewhere (a deployment run from the UI or the API) stored its parameters as given:
  :func:`guard`, the first line of every flow, registers them and writes them back scrubbed;
- :func:`guard` and the parameter hook put :class:`k3pipe.core.secrets.SecretFilter` on every logging
  handler (Prefect's API handler, which writes the database's logs, and its console handler, the
  terminal's), so that no log line carries a registered secret;
- k3pipe's errors scrub their own messages when they are made, and the flows scrub the messages of
  the errors they raise themselves, so that a failed run's state message carries none either.

Task parameters are not stored (Prefect keeps references to upstream results only) and no task
persists its result (``cache_policy=NO_CACHE``, no ``persist_result``); tasks take the key as a
``SecretStr``, and a plan's environment holds ``{env.NAME}`` references, not their values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import yaml
from prefect import Flow, get_client
from prefect.context import get_run_context

from k3pipe.core.owners import FlowRunNote, Owners, local_prefect
from k3pipe.core.secrets import install_log_filter, redact_data, scrub_data
from k3pipe.experiment.load import register_experiment_secrets

__all__ = ["ScrubbedFlow", "guard", "scrubbed_flow"]

P = ParamSpec("P")
R = TypeVar("R")


def _experiment_data(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The experiment given as text, parsed (None: none given, or a text that is no YAML mapping;
    that fails in the flow, with its error scrubbed)."""
    text = parameters.get("experiment_yaml")
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _scrubbed(parameters: dict[str, Any]) -> dict[str, Any]:
    """The parameters as Prefect may store them: the experiment's secrets registered, every value
    scrubbed, and an experiment text written again as YAML with its secret-named values ``'***'``
    (replacing them inside the text would leave ``***``, which YAML reads as an alias)."""
    data = _experiment_data(parameters)
    if data is not None:
        register_experiment_secrets(data)
    clean = dict(scrub_data(parameters))
    if data is not None:
        redacted = scrub_data(redact_data(data))
        if redacted != data:  # else the text is kept as written, comments and all
            clean["experiment_yaml"] = yaml.safe_dump(redacted, sort_keys=False, allow_unicode=True)
    return clean


class ScrubbedFlow(Flow[P, R]):
    """A Prefect flow whose stored parameters never hold a secret (see the module's docstring)."""

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        # a refusal logs the parameters as given: their secrets registered, the filter in place first
        install_log_filter()
        data = _experiment_data(parameters)
        if data is not None:
            register_experiment_secrets(data)
        return super().validate_parameters(parameters)

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        install_log_filter()
        return _scrubbed(super().serialize_parameters(parameters))


def scrubbed_flow(name: str) -> Callable[[Callable[P, R]], ScrubbedFlow[P, R]]:
    """``@flow(name=...)`` for k3pipe's flows: the flow as a :class:`ScrubbedFlow`."""

    def wrap(fn: Callable[P, R]) -> ScrubbedFlow[P, R]:
        return ScrubbedFlow(fn=fn, name=name)

    return wrap


def _note(flow_run_id: str, name: str) -> None:
    """The flow run in this process's owner record (k3pipe.core.owners), for the command that comes after
    a kill: it sets the run Crashed when this process is gone and the run is not finished."""
    from prefect.settings import PREFECT_API_URL

    from k3pipe.core.settings import Settings

    api_url = str(PREFECT_API_URL.value() or "")
    local = local_prefect()
    prefect_home = local[1] if local is not None and local[0] == api_url else None
    with contextlib.suppress(OSError):  # an unwritable home is said where it matters, not here
        Owners(Settings().home_dir).note_flow_run(FlowRunNote(flow_run_id, name, api_url, prefect_home))


def guard() -> None:
    """The first step of every flow: the log filter on every handler, the flow run noted in this
    process's owner record (k3pipe.core.owners), and the run's stored parameters scrubbed (a deployment
    run's were stored as the UI or the API sent them)."""
    install_log_filter()
    try:
        flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    except Exception:  # not in a flow run (a flow's function called directly)
        return
    if flow_run is None:
        return
    _note(str(flow_run.id), flow_run.name)
    stored = dict(flow_run.parameters or {})
    clean = _scrubbed(stored)
    if clean != stored:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, parameters=clean)
