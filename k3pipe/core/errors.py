"""The one error tree of k3pipe.

Every error says what failed, with its context (file, field, URL, engine, log tail), and what to do
next. Library code raises these, always ``from`` the underlying exception. A message is scrubbed of
secrets when the error is made (:func:`k3pipe.core.secrets.scrub`): an endpoint that echoes the key in its
error body, or an engine log tail that holds one, never carries it into a log, a Prefect state or
MLflow.

    K3pipeError
    ├── SpecError             an experiment file or field is invalid
    │   └── PreflightError          the experiment would fail or mislead (preflight errors)
    ├── ModelSourceError      weights could not be fetched or verified
    ├── ImageError            a container image could not be pulled or resolved to a digest
    ├── LaunchError           the engine could not be started or died before it was healthy
    │   └── EngineLostError         the engine died or froze during a workload
    ├── HealthError           the endpoint does not answer correctly
    │   ├── EndpointAuthError       401/403: key, base URL path or one of the three settings
    │   └── ModelNotServedError     the model id is not listed by /v1/models
    ├── BenchmarkError        a workload could not run at all (single requests fail as records)
    ├── TrackingError         MLflow could not record the run (or read it back)
    │   ├── TrackingUnreachableError  the tracking server does not answer at the start of a run
    │   └── ArtifactMissingError      a run lacks an artifact that must be read (repeats.json ...)
    │       └── ArtifactStoreError          the run's artifact store cannot be read at all (moved?)
    ├── RunFailedError        an arm (or a study of a retest) did not finish; each is recorded
    └── StackError            the team stack (PostgreSQL, MLflow, Prefect, worker) could not start or stop
"""

from __future__ import annotations

from typing import Any

from k3pipe.core.secrets import scrub

__all__ = [
    "ArtifactMissingError",
    "ArtifactStoreError",
    "BenchmarkError",
    "EndpointAuthError",
    "EngineLostError",
    "HealthError",
    "ImageError",
    "K3pipeError",
    "LaunchError",
    "ModelNotServedError",
    "ModelSourceError",
    "PreflightError",
    "RerunError",
    "RunFailedError",
    "SpecError",
    "StackError",
    "TrackingError",
    "TrackingUnreachableError",
]


class K3pipeError(Exception):
    """Base class of every error k3pipe raises on purpose; its message is scrubbed of secrets."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(scrub(a) if isinstance(a, str) else a for a in args))


class SpecError(K3pipeError):
    """An experiment spec is invalid: the message names the file, field path, value and choices."""


class PreflightError(SpecError):
    """Preflight found errors: the launch would fail (after a long cold start) or mislead."""


class ModelSourceError(K3pipeError):
    """Model weights could not be downloaded, found or verified. ``retryable``: whether trying again
    can help (a hub that did not answer may; a local directory that is not there will not appear)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.retryable)


class ImageError(K3pipeError):
    """A container image could not be pulled or pinned (the message names the image and registry)."""


class LaunchError(K3pipeError):
    """The engine did not start, or exited before it became healthy (the message holds the log tail)."""


class EngineLostError(LaunchError):
    """The engine died or stopped answering during a workload (the message holds why and the log tail);
    what was measured until then is recorded."""


class HealthError(K3pipeError):
    """The endpoint is unreachable or answers wrongly. ``status``: the HTTP status it answered, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EndpointAuthError(HealthError):
    """The endpoint refused the key (401/403)."""


class ModelNotServedError(HealthError):
    """The model id is not among the ids the endpoint lists."""


class BenchmarkError(K3pipeError):
    """A workload could not run at all."""


class TrackingError(K3pipeError):
    """The run could not be recorded."""


class RunFailedError(K3pipeError, RuntimeError):
    """An arm, or a study of a retest, did not finish cleanly: why (each arm's error, first line),
    and where its record is. Raised after everything that could run has run and been recorded."""


class PartlyFailedError(RunFailedError):
    """Part of a job did not finish (an arm of a study, a study of a retest); raised after the report,
    which ``result`` (the job's result, report paths included) points to."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def first_line(exc: BaseException | str) -> str:
    """An error's first line (its log tail and details stay in the record)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return text.strip().splitlines()[0] if text.strip() else text


class TrackingUnreachableError(TrackingError):
    """The MLflow tracking server did not answer when a run started (the message says how to go on)."""


class ArtifactMissingError(TrackingError):
    """An artifact that must be read is not there: the run's artifacts are listed and it is not among
    them. ``run_id``, ``artifact`` (its path in the run), ``root`` (the artifact root it was looked
    for under) and ``location`` (the run's artifact directory or URI) say where it was looked for."""

    def __init__(self, message: str, *, run_id: str, artifact: str, root: str, location: str) -> None:
        super().__init__(message)
        self.run_id, self.artifact, self.root, self.location = run_id, artifact, root, location

    def _fields(self) -> dict[str, str]:
        keys = ("run_id", "artifact", "root", "location")
        return {key: getattr(self, key) for key in keys}

    def context(self, what: str) -> ArtifactMissingError:
        """The same error, its message led by what needed the artifact (a workload, its requests)."""
        return type(self)(f"{what}: {self}", **self._fields())

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), str(self), self._fields())


class ArtifactStoreError(ArtifactMissingError):
    """The run's artifacts cannot be read at all: the artifact root its MLflow record names does not
    exist here (a store brought from another machine: read it with ``--artifact-root``) or cannot be
    listed. Not the same as a run that has no such artifact."""


def _rebuild(cls: type[ArtifactMissingError], message: str, fields: dict[str, str]) -> ArtifactMissingError:
    return cls(message, **fields)


class RerunError(K3pipeError):
    """A run cannot be repeated exactly: an input of its record cannot be had (or verified) again."""


class StackError(K3pipeError):
    """The team stack could not start or stop a service (the message names it, its log and the log's end)."""
