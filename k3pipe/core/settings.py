"""Settings from the environment (prefix ``K3PIPE_``). The only module that reads ``os.environ``."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from k3pipe.core.errors import K3pipeError
from k3pipe.core.secrets import shown

__all__ = [
    "MLFLOW_CLIENT_DEFAULTS",
    "Settings",
    "SettingsError",
    "apply_mlflow_client_defaults",
    "env_value",
    "load_settings",
    "read_secret",
]

MLFLOW_CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
"""MLflow's HTTP client for k3pipe: one retry, 10 s. MLflow's own defaults (7 retries, backoff 2,
120 s) held a run 759 s on a dead tracking server; k3pipe records into its spool instead of waiting."""


_CLIENT_CREDENTIALS = (
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_KEY",
)


class Settings(BaseSettings):
    """Where k3pipe keeps its state and how it reaches its services."""

    model_config = SettingsConfigDict(env_prefix="K3PIPE_", extra="ignore", hide_input_in_errors=True)

    home: Path = Field(
        default=Path(".k3pipe"),
        description="State directory: MLflow DB and artifacts, models, engine venvs, logs.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI; MLFLOW_TRACKING_URI wins; default SQLite in the home dir.",
    )
    mlflow_experiment: str = Field(default="k3pipe", description="MLflow experiment name.")
    allow_spool: bool = Field(
        default=False,
        description=(
            "Start a run although the MLflow tracking server does not answer: record it in the spool "
            "(K3PIPE_HOME/spool) and push it later with `k3pipe sync`. Without it such a run fails at "
            "once. (A server that goes away mid-run never stops the run: its records are spooled.)"
        ),
    )
    mlflow_probe_timeout_s: float = Field(
        default=5.0, gt=0, description="How long the start-of-run check waits for the tracking server."
    )
    spool_retry_s: float = Field(
        default=30.0,
        ge=0,
        description="While MLflow is down, how often a run tries again to push what it spooled.",
    )

    # the team stack (`k3pipe stack up`): its servers bind 127.0.0.1 only, on these ports
    stack_postgres_port: int = Field(
        default=5433, ge=1, le=65535, description="The stack's PostgreSQL port (MLflow's store)."
    )
    stack_mlflow_port: int = Field(
        default=5050, ge=1, le=65535, description="The stack's MLflow tracking server port."
    )
    stack_prefect_port: int = Field(
        default=4200, ge=1, le=65535, description="The stack's Prefect server port."
    )
    stack_postgres_bin: Path | None = Field(
        default=None,
        description="PostgreSQL's bin directory (default: the newest /usr/lib/postgresql/*/bin).",
    )
    stack_postgres_user: str = Field(
        default="postgres",
        description="Unprivileged system user PostgreSQL runs as when k3pipe runs as root.",
    )
    stack_start_timeout_s: float = Field(
        default=180.0, gt=0, description="How long `stack up` waits for each service to be ready."
    )
    stack_worker: bool = Field(
        default=True, description="Whether `stack up` also starts a worker on the stack's work pool."
    )
    stack_host: str = Field(
        default="127.0.0.1",
        description=(
            "The address MLflow and Prefect bind. Beyond loopback (0.0.0.0, a LAN address) only with "
            "authentication on: GPU nodes then reach the stack without a tunnel."
        ),
    )
    stack_auth: bool | None = Field(
        default=None,
        description=(
            "Require a user and password of every client of MLflow (its basic-auth app) and Prefect "
            "(its server's auth string). Default: on when stack_host is not loopback, else off."
        ),
    )
    stack_credentials_file: Path | None = Field(
        default=None,
        description=(
            "A file holding 'USER:PASSWORD' for the stack's MLflow admin and Prefect (never a command "
            "line or a log). Default: K3PIPE_HOME/stack/credentials, made with a random password."
        ),
    )
    stack_tls: bool | None = Field(
        default=None,
        description=(
            "Serve MLflow and Prefect over HTTPS with a certificate of the stack's own CA "
            "(K3PIPE_HOME/stack/tls/ca.pem, which clients trust). Default: on when stack_host is not "
            "loopback (where it may not be off), else off."
        ),
    )
    stack_tls_names: str = Field(
        default="",
        description=(
            "Comma-separated names and addresses nodes use to reach the stack, for its certificate "
            "(loopback, the bound address and this host's names are always in it)."
        ),
    )

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    def tracking_uri(self) -> str:
        """MLFLOW_TRACKING_URI if set, else K3PIPE_MLFLOW_TRACKING_URI, else SQLite under home."""
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if env:
            return env
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{self.home_dir / 'mlflow' / 'mlflow.db'}"

    def client_credentials(self) -> list[str]:
        """The values of the credentials MLflow's and Prefect's clients read from the environment by
        their own names (a team stack's: ``k3pipe stack env``), for the scrubber: a process holding
        them never writes them (the password also on its own, as it is inside the auth string)."""
        values = []
        for name in _CLIENT_CREDENTIALS:
            value = os.environ.get(name)
            if value:
                values.append(value)
                if name == "PREFECT_API_AUTH_STRING" and ":" in value:
                    values.append(value.split(":", 1)[1])
        return values

    def spool_dir(self) -> Path:
        """Where writes wait for MLflow (k3pipe.records.spool)."""
        return self.home_dir / "spool"

    def artifact_root(self) -> Path:
        return self.home_dir / "mlflow" / "artifacts"

    def process_env(self) -> dict[str, str]:
        """The environment an engine process inherits (the spec's env is laid over it)."""
        return dict(os.environ)


class SettingsError(K3pipeError):
    """A ``K3PIPE_`` variable holds a value k3pipe cannot use; the message names the variable, the value
    (masked where it may be a key) and what the setting is."""


def load_settings() -> Settings:
    """:class:`Settings`, or a :class:`SettingsError` naming each bad variable (not pydantic's error,
    which names fields nobody types and, chained, would carry the values)."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = "_".join(str(part) for part in error["loc"])
            value = error.get("input")
            about = Settings.model_fields[field].description if field in Settings.model_fields else None
            problems.append(
                f"K3PIPE_{field.upper()}={shown(str(value))}: {error['msg'].lower()}"
                + (f" ({about[0].lower()}{about[1:].rstrip('.')})" if about else "")
                + "; set it to such a value, or unset it for the default"
            )
        raise SettingsError("; ".join(problems)) from None


def apply_mlflow_client_defaults() -> None:
    """Give MLflow's HTTP client k3pipe's short retry budget (:data:`MLFLOW_CLIENT_DEFAULTS`), each
    setting only where the user did not set it."""
    for key, value in MLFLOW_CLIENT_DEFAULTS.items():
        os.environ.setdefault(key, value)


def read_secret(env_name: str | None) -> SecretStr | None:
    """The value of the environment variable a spec names for a key, or that an ``{env.NAME}``
    reference names (None when unnamed or unset)."""
    if not env_name:
        return None
    value = os.environ.get(env_name)
    return SecretStr(value) if value else None


def env_value(name: str) -> str | None:
    """The value of variable ``name`` for an ``{env.NAME}`` reference (None when unset or empty):
    :func:`read_secret`, unwrapped where the value must be handed on (an engine's environment)."""
    secret = read_secret(name)
    return secret.get_secret_value() if secret is not None else None
