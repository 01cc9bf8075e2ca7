"""Keeping secrets out of Prefect's database and logs: the flows are :class:`ScrubbedFlow` objects.

Prefect stores a flow run's parameters (``experiment_yaml`` is a whole experiment, and may hold a key
written in it) when it creates the run, before the flow's body runs; it stores logs, state messages
(an exception's text) and artifacts as they come. So:

- :meth:`ScrubbedFlow.serialize_parameters`, which makes the parameters Prefect stores, first
  registers the secrets of an ``experiment_yaml`` with k3pipe's scrubber (:mod:`k3pipe.secrets`),
  then scrubs every parameter: the stored experiment holds ``***`` where a key was;
- a run created elsewhere (a deployment run from the UI or the API) stored its parameters as given:
  :func:`guard`, the first line of every flow, registers them and writes them back scrubbed;
- :func:`guard` and the parameter hook put :class:`k3pipe.secrets.SecretFilter` on every logging
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

from k3pipe.experiment import register_experiment_secrets
from k3pipe.secrets import install_log_filter, scrub_data

__all__ = ["ScrubbedFlow", "guard", "scrubbed_flow"]

P = ParamSpec("P")
R = TypeVar("R")


def _register(parameters: dict[str, Any]) -> None:
    """The secrets of an experiment given as text, registered (a text that is no YAML holds none
    we can find: it fails in the flow, with its error scrubbed)."""
    text = parameters.get("experiment_yaml")
    if isinstance(text, str) and text.strip():
        with contextlib.suppress(yaml.YAMLError):
            register_experiment_secrets(yaml.safe_load(text))


class ScrubbedFlow(Flow[P, R]):
    """A Prefect flow whose stored parameters never hold a secret (see the module's docstring)."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        install_log_filter()
        _register(parameters)
        return dict(scrub_data(super().serialize_parameters(parameters)))


def scrubbed_flow(name: str) -> Callable[[Callable[P, R]], ScrubbedFlow[P, R]]:
    """``@flow(name=...)`` for k3pipe's flows: the flow as a :class:`ScrubbedFlow`."""

    def wrap(fn: Callable[P, R]) -> ScrubbedFlow[P, R]:
        return ScrubbedFlow(fn=fn, name=name)

    return wrap


def guard() -> None:
    """The first step of every flow: the log filter on every handler, and the run's stored parameters
    scrubbed (a deployment run's were stored as the UI or the API sent them)."""
    install_log_filter()
    try:
        flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    except Exception:  # not in a flow run (a flow's function called directly)
        return
    if flow_run is None:
        return
    stored = dict(flow_run.parameters or {})
    _register(stored)
    clean = scrub_data(stored)
    if clean != stored:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, parameters=clean)
