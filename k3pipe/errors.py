"""The one error tree of k3pipe.

Every error says what failed, with its context (file, field, URL, engine, log tail), and what to do
next. Library code raises these, always ``from`` the underlying exception.

    K3pipeError
    ├── SpecError             an experiment file or field is invalid
    │   └── PreflightError          the experiment would fail or mislead (preflight errors)
    ├── ModelSourceError      weights could not be fetched or verified
    ├── ImageError            a container image could not be pulled or resolved to a digest
    ├── LaunchError           the engine could not be started or died before it was healthy
    ├── HealthError           the endpoint does not answer correctly
    │   ├── EndpointAuthError       401/403: key, base URL path or one of the three settings
    │   └── ModelNotServedError     the model id is not listed by /v1/models
    ├── BenchmarkError        a workload could not run at all (single requests fail as records)
    ├── TrackingError         MLflow could not record the run
    │   └── TrackingUnreachableError  the tracking server does not answer at the start of a run
    └── StackError            the team stack (PostgreSQL, MLflow, Prefect, worker) could not start or stop
"""

from __future__ import annotations

__all__ = [
    "BenchmarkError",
    "EndpointAuthError",
    "HealthError",
    "ImageError",
    "K3pipeError",
    "LaunchError",
    "ModelNotServedError",
    "ModelSourceError",
    "PreflightError",
    "RerunError",
    "SpecError",
    "StackError",
    "TrackingError",
    "TrackingUnreachableError",
]


class K3pipeError(Exception):
    """Base class of every error k3pipe raises on purpose."""


class SpecError(K3pipeError):
    """An experiment spec is invalid: the message names the file, field path, value and choices."""


class PreflightError(SpecError):
    """Preflight found errors: the launch would fail (after a long cold start) or mislead."""


class ModelSourceError(K3pipeError):
    """Model weights could not be downloaded, found or verified."""


class ImageError(K3pipeError):
    """A container image could not be pulled or pinned (the message names the image and registry)."""


class LaunchError(K3pipeError):
    """The engine did not start, or exited before it became healthy (the message holds the log tail)."""


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


class TrackingUnreachableError(TrackingError):
    """The MLflow tracking server did not answer when a run started (the message says how to go on)."""


class RerunError(K3pipeError):
    """A run cannot be repeated exactly: an input of its record cannot be had (or verified) again."""


class StackError(K3pipeError):
    """The team stack could not start or stop a service (the message names it, its log and the log's end)."""
