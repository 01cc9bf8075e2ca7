"""The team stack: PostgreSQL, an MLflow server on it, a Prefect server, a work pool and its worker.

Everything lives under ``K3PIPE_HOME/stack`` and binds 127.0.0.1 unless told otherwise (MLflow and
Prefect beyond loopback only with auth and TLS on: :func:`_check_exposure`):

    stack/postgres/          the PostgreSQL cluster (owned by the unprivileged user it runs as)
    stack/postgres-run/      its unix socket directory
    stack/pgpass             the ``k3pipe`` role's password, in libpq's pgpass format (mode 0600)
    stack/mlflow-artifacts/  MLflow's proxied artifact store (clients upload through the server)
    stack/prefect/           PREFECT_HOME of the Prefect server (its SQLite database)
    stack/logs/NAME.log      each service's output
    stack/state.json         what ``up`` started: pid, process group, port, URL, log per service
    stack/credentials        with auth: 'USER:PASSWORD' of MLflow's admin and Prefect (mode 0600)
    stack/tls/               with TLS: the stack's CA (ca.pem) and the servers' certificate (k3pipe.ops.tls)

Each service runs in its own process group (``start_new_session``); ``down`` ends exactly the groups
the state file records, never anything found by name. Pure subprocess management: the Prefect CLI is
run as an executable, Prefect itself is never imported.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import pwd
import secrets
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from k3pipe.core import secrets as k3secrets
from k3pipe.core.errors import StackError
from k3pipe.core.procs import alive, file_lock, proc_stat, reap, stop_group
from k3pipe.core.settings import Settings
from k3pipe.ops.tls import TlsFiles, describe, ensure_certificates

__all__ = [
    "HOST",
    "SERVICES",
    "WORK_POOL",
    "ServiceRecord",
    "ServiceStatus",
    "StackConfig",
    "client_env",
    "down",
    "env_lines",
    "load_state",
    "security_lines",
    "status",
    "up",
]

HOST = "127.0.0.1"
"""Every server of the stack binds this address only."""
SERVICES = ("postgres", "mlflow", "prefect", "worker")
"""The services in start order (``down`` stops them in reverse)."""
WORK_POOL = "k3pipe"
"""The process work pool prefect.yaml's deployments name."""
MLFLOW_AUTH_CACHE_S = 60
"""How long MLflow's basic-auth app keeps a checked password (its ``auth_cache_ttl_seconds``; it is off
by default): without it every request hashes the password again (werkzeug's scrypt, about 0.1 s of a
core here), which made the server the busiest process of a fleet study. The stack runs one MLflow
worker, so a password changed through MLflow's API takes effect at once; a cached one is forgotten
after this long, or when the server restarts."""
PG_ROLE = "k3pipe"
PG_DATABASE = "mlflow"

Progress = Callable[[str], None]

# how each service is asked to stop, signal by signal, each with its grace period (s); SIGKILL follows.
# Prefect's worker ignores SIGTERM for minutes; PostgreSQL's SIGINT is its fast shutdown.
_STOP_SIGNALS: dict[str, tuple[tuple[signal.Signals, float], ...]] = {
    "worker": ((signal.SIGINT, 10.0), (signal.SIGINT, 10.0)),
    "prefect": ((signal.SIGTERM, 15.0),),
    "mlflow": ((signal.SIGTERM, 15.0),),
    "postgres": ((signal.SIGINT, 20.0),),
}
_PORT_SETTING = {
    "postgres": "K3PIPE_STACK_POSTGRES_PORT",
    "mlflow": "K3PIPE_STACK_MLFLOW_PORT",
    "prefect": "K3PIPE_STACK_PREFECT_PORT",
}
_UNIX_SOCKET_MAX = 107  # sun_path is 108 bytes with its NUL


@dataclass(frozen=True)
class StackConfig:
    """Where the stack lives, its ports, and the programs it runs."""

    home: Path
    postgres_port: int = 5433
    mlflow_port: int = 5050
    prefect_port: int = 4200
    postgres_bin: Path | None = None
    postgres_user: str = "postgres"
    start_timeout_s: float = 180.0
    worker: bool = True
    project_dir: Path = field(default_factory=Path.cwd)
    """The checkout whose prefect.yaml is deployed and where the worker runs flows."""
    base_env: Mapping[str, str] = field(default_factory=dict)
    """The environment the services inherit (the MLflow server and the worker need PATH and keys)."""
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    """Where the ``mlflow`` and ``prefect`` executables are (this interpreter's venv)."""
    host: str = HOST
    """The address MLflow and Prefect bind (PostgreSQL stays on loopback: only MLflow reaches it)."""
    auth: bool = False
    """Whether MLflow and Prefect require the stack's user and password (:meth:`credentials`)."""
    credentials_path: Path | None = None
    """The 'USER:PASSWORD' file (None: stack/credentials, made on first use)."""
    tls: bool = False
    """Whether MLflow and Prefect serve HTTPS, with a certificate of the stack's own CA (k3pipe.ops.tls)."""
    tls_names: tuple[str, ...] = ()
    """Names and addresses the certificate carries besides loopback's, the host's and its name."""

    @classmethod
    def from_settings(cls, settings: Settings, project_dir: Path) -> StackConfig:
        """The stack as K3PIPE_HOME and the K3PIPE_STACK_* settings describe it."""
        exposed = not _loopback(settings.stack_host)
        auth = settings.stack_auth if settings.stack_auth is not None else exposed
        tls = settings.stack_tls if settings.stack_tls is not None else exposed
        return cls(
            host=settings.stack_host,
            auth=auth,
            tls=tls,
            tls_names=tuple(n.strip() for n in settings.stack_tls_names.split(",") if n.strip()),
            credentials_path=settings.stack_credentials_file,
            home=settings.home_dir,
            postgres_port=settings.stack_postgres_port,
            mlflow_port=settings.stack_mlflow_port,
            prefect_port=settings.stack_prefect_port,
            postgres_bin=settings.stack_postgres_bin,
            postgres_user=settings.stack_postgres_user,
            start_timeout_s=settings.stack_start_timeout_s,
            worker=settings.stack_worker,
            project_dir=project_dir.resolve(),
            base_env=settings.process_env(),
        )

    @property
    def stack_dir(self) -> Path:
        return self.home / "stack"

    @property
    def state_file(self) -> Path:
        return self.stack_dir / "state.json"

    @property
    def logs_dir(self) -> Path:
        return self.stack_dir / "logs"

    @property
    def pg_data(self) -> Path:
        return self.stack_dir / "postgres"

    @property
    def pg_socket_dir(self) -> Path:
        return self.stack_dir / "postgres-run"

    @property
    def pgpass(self) -> Path:
        return self.stack_dir / "pgpass"

    @property
    def artifacts_dir(self) -> Path:
        return self.stack_dir / "mlflow-artifacts"

    @property
    def prefect_home(self) -> Path:
        return self.stack_dir / "prefect"

    @property
    def tls_files(self) -> TlsFiles:
        return TlsFiles(self.stack_dir / "tls")

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def cert_names(self) -> list[str]:
        """What the servers' certificate is valid for: loopback, the bound address (unless a
        wildcard), this host's name and fully qualified name, and :attr:`tls_names`."""
        names = ["127.0.0.1", "::1", "localhost"]
        if self.host not in ("0.0.0.0", "::", ""):
            names.append(self.host)
        names += [socket.gethostname(), socket.getfqdn(), *self.tls_names]
        return list(dict.fromkeys(n for n in names if n))

    def port(self, service: str) -> int:
        """The configured port of a server (the worker has none: 0)."""
        return {"postgres": self.postgres_port, "mlflow": self.mlflow_port, "prefect": self.prefect_port}.get(
            service, 0
        )

    def url(self, service: str, port: int | None = None) -> str:
        """Where a service answers (for the worker: the Prefect API it polls)."""
        port = port or self.port(service)
        if service == "postgres":
            return f"postgresql://{PG_ROLE}@{HOST}:{port}/{PG_DATABASE}"
        if service == "worker":
            return f"pool {WORK_POOL}"
        return f"{self.scheme}://{self.client_host}:{port}"

    @property
    def client_host(self) -> str:
        """Where this machine reaches MLflow and Prefect: their address, or loopback for 'all'."""
        return HOST if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def credentials_file(self) -> Path:
        return self.credentials_path or self.stack_dir / "credentials"

    def credentials(self) -> tuple[str, str] | None:
        """The stack's (user, password) when auth is on (None: off): read from
        :attr:`credentials_file`, made there first (a random password, mode 0600) when it does not
        exist. The password is registered with k3pipe's scrubber: no log shows it."""
        if not self.auth:
            return None
        path = self.credentials_file
        if not path.exists():
            if self.credentials_path is not None:
                raise StackError(
                    f"K3PIPE_STACK_CREDENTIALS_FILE={path} does not exist: write 'USER:PASSWORD' in it "
                    "(mode 0600), or leave the setting out to have one made"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"k3pipe:{secrets.token_urlsafe(24)}\n")
        user, sep, password = path.read_text().strip().partition(":")
        if not sep or not user or not password:
            raise StackError(
                f"{path} must hold one line 'USER:PASSWORD' (a user without ':'); it holds something else"
            )
        k3secrets.register(password)
        return user, password

    def log_path(self, service: str) -> Path:
        return self.logs_dir / f"{service}.log"


@dataclass
class ServiceRecord:
    """One service ``up`` started: its process group and where it answers."""

    name: str
    pid: int
    pgid: int
    port: int
    url: str
    log: str
    started_at: str
    proc_start: int | None = None
    """The process's start time (clock ticks since boot): a reused pid is never mistaken for it."""
    log_offset: int = 0
    """Where this start's lines begin in the log."""


@dataclass(frozen=True)
class ServiceStatus:
    """What ``status`` reports of one service."""

    name: str
    running: bool
    pid: int | None
    url: str
    log: Path
    answering: bool | None = None
    """The server's health check (None: not asked, e.g. not running, or no endpoint)."""
    note: str = ""


# ----------------------------------------------------------------------------------------------------
# state file and processes


def load_state(config: StackConfig) -> dict[str, ServiceRecord]:
    """The services the state file records (empty when there is none)."""
    path = config.state_file
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {name: ServiceRecord(**rec) for name, rec in data.get("services", {}).items()}
    except (ValueError, TypeError) as exc:
        raise StackError(
            f"the stack's state file {path} is unreadable ({exc}); stop what it started by hand "
            "(see its pids) and remove the file"
        ) from exc


def _save_state(config: StackConfig, state: Mapping[str, ServiceRecord]) -> None:
    path = config.state_file
    if not state:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = {name: asdict(state[name]) for name in SERVICES if name in state}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"services": ordered}, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def _locked(config: StackConfig) -> Iterator[None]:
    """One ``up``/``down`` at a time per stack."""
    with file_lock(config.stack_dir / ".lock"):
        yield


def _stop_group(record: ServiceRecord) -> str:
    """End the service's process group: its polite signal(s), then SIGKILL. Returns what happened."""
    reap(record.pid)
    what, left = stop_group(
        record.pgid, record.proc_start, _STOP_SIGNALS.get(record.name, ((signal.SIGTERM, 15.0),))
    )
    if left:
        raise StackError(
            f"{record.name}: process group {record.pgid} still has processes {left} after SIGKILL; "
            f"end them by hand (kill -9 -- -{record.pgid})"
        )
    return what


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _check_port(config: StackConfig, service: str) -> None:
    port = config.port(service)
    if not _port_free(port):
        raise StackError(
            f"{service} cannot start: port {port} on {HOST} is already in use by another program; "
            f"free it, or choose another port with {_PORT_SETTING[service]}=PORT"
        )


def _log_excerpt(record: ServiceRecord | None, path: Path, lines: int = 25) -> str:
    """The last lines this start wrote to the service's log."""
    if not path.exists():
        return "(no log)"
    with path.open("rb") as fh:
        fh.seek(record.log_offset if record is not None else 0)
        text = fh.read().decode(errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _launch(
    config: StackConfig,
    name: str,
    argv: list[str],
    env: Mapping[str, str],
    cwd: Path,
    run_as: tuple[int, int] | None = None,
) -> tuple[ServiceRecord, subprocess.Popen[bytes]]:
    """Start a service in a new session (its own process group), its output appended to its log."""
    log = config.log_path(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    extra: dict[str, object] = {}
    if run_as is not None:
        extra = {"user": run_as[0], "group": run_as[1], "extra_groups": []}
    with log.open("ab") as fh:
        fh.write(f"\n=== k3pipe stack: {name} starting {started.isoformat()}: {shlex.join(argv)}\n".encode())
        fh.flush()
        offset = fh.tell()
        try:
            proc = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **extra,  # type: ignore[call-overload]
            )
        except OSError as exc:
            raise StackError(f"{name} could not be started ({argv[0]}): {exc}") from exc
    stat = proc_stat(proc.pid)
    record = ServiceRecord(
        name=name,
        pid=proc.pid,
        pgid=proc.pid,  # the leader of a new session: its pid is the group's id
        port=config.port(name),
        url=config.url(name),
        log=str(log),
        started_at=started.isoformat(timespec="seconds"),
        proc_start=stat[2] if stat else None,
        log_offset=offset,
    )
    return record, proc


def _wait_ready(
    name: str,
    record: ServiceRecord,
    proc: subprocess.Popen[bytes] | None,
    ready: Callable[[], bool],
    what: str,
    timeout_s: float,
) -> float:
    """Wait until ``ready()``; a clear error naming the service and its log when it dies or times out."""
    start = time.monotonic()
    log = Path(record.log)
    while True:
        if ready():
            return time.monotonic() - start
        code = proc.poll() if proc is not None else None
        if code is not None or (proc is None and not alive(record.pid, record.proc_start)):
            how = (
                f"exited with code {code}" if code is not None else f"(pid {record.pid}) is no longer running"
            )
            raise StackError(
                f"{name} {how} before it was ready ({what}); its log {log} ends with:\n"
                f"{_log_excerpt(record, log)}"
            )
        if time.monotonic() - start > timeout_s:
            raise StackError(
                f"{name} was not ready within {timeout_s:.0f} s ({what} never answered); its log {log} "
                f"ends with:\n{_log_excerpt(record, log)}\n"
                "raise K3PIPE_STACK_START_TIMEOUT_S if the machine is just slow"
            )
        time.sleep(0.3)


def _http_ok(config: StackConfig, url: str) -> bool:
    try:
        with _client(config, 2.0) as http:
            return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------------------------------
# PostgreSQL


def _pg_bin(config: StackConfig) -> Path:
    """The directory holding initdb, postgres, pg_isready and psql."""
    if config.postgres_bin is not None:
        if not (config.postgres_bin / "postgres").is_file():
            raise StackError(
                f"K3PIPE_STACK_POSTGRES_BIN={config.postgres_bin} holds no 'postgres' executable; "
                "point it at PostgreSQL's bin directory (e.g. /usr/lib/postgresql/15/bin)"
            )
        return config.postgres_bin

    def version(path: Path) -> float:
        try:
            return float(path.parent.name)
        except ValueError:
            return 0.0

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: version(p.parent))
    if found:
        return found[-1].parent
    raise StackError(
        "PostgreSQL's server programs (initdb, postgres) are not in /usr/lib/postgresql/*/bin: "
        "install Debian's postgresql package (`apt-get install -y postgresql` as root; `make stack` "
        "does it), or set K3PIPE_STACK_POSTGRES_BIN to the directory holding them"
    )


def _pg_account(config: StackConfig) -> tuple[int, int] | None:
    """(uid, gid) PostgreSQL runs as: an unprivileged user when k3pipe is root, else None (ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(config.postgres_user)
    except KeyError:
        raise StackError(
            f"PostgreSQL refuses to run as root, and the user it should run as, "
            f"{config.postgres_user!r} (K3PIPE_STACK_POSTGRES_USER), does not exist; install Debian's "
            "postgresql package (it creates the 'postgres' user) or name another unprivileged user"
        ) from None
    if entry.pw_uid == 0:
        raise StackError(
            f"K3PIPE_STACK_POSTGRES_USER={config.postgres_user!r} is root, and PostgreSQL refuses to run "
            "as root; name an unprivileged user (default: postgres)"
        )
    return entry.pw_uid, entry.pw_gid


def _unenterable(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory from / down to ``path`` that (uid, gid) may not enter, if any."""
    for directory in [*reversed(path.parents), path]:
        st = directory.stat()
        if st.st_uid == uid:
            bit = 0o100
        elif st.st_gid == gid:
            bit = 0o010
        else:
            bit = 0o001
        if not st.st_mode & bit:
            return directory
    return None


def _own(path: Path, account: tuple[int, int] | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if account is not None:
        os.chown(path, *account)
    path.chmod(0o700)


def _prepare_postgres(config: StackConfig, bin_dir: Path, account: tuple[int, int] | None) -> None:
    """Create the cluster on the first ``up`` (initdb as the unprivileged user), else check it."""
    data, sockets = config.pg_data, config.pg_socket_dir
    socket_path = sockets / f".s.PGSQL.{config.postgres_port}"
    if len(str(socket_path)) > _UNIX_SOCKET_MAX:
        raise StackError(
            f"PostgreSQL's socket path {socket_path} is longer than the {_UNIX_SOCKET_MAX} characters a "
            "unix socket may have; use a shorter K3PIPE_HOME"
        )
    config.stack_dir.mkdir(parents=True, exist_ok=True)
    if account is not None:
        blocked = _unenterable(config.stack_dir, *account)
        if blocked is not None:
            user = pwd.getpwuid(account[0]).pw_name
            raise StackError(
                f"PostgreSQL runs as user {user!r}, which may not enter {blocked} (mode "
                f"{blocked.stat().st_mode & 0o777:o}, owner {pwd.getpwuid(blocked.stat().st_uid).pw_name}) "
                f"on the way to its data directory {data}; put K3PIPE_HOME where that user can reach it "
                f"(e.g. under /srv or /work), or let it pass: chmod o+x {blocked}"
            )
    _own(sockets, account)
    if (data / "PG_VERSION").exists():
        return
    if data.exists() and any(data.iterdir()):
        raise StackError(
            f"{data} is not empty but holds no PostgreSQL cluster (no PG_VERSION); move it away and run "
            "`k3pipe stack up` again"
        )
    _own(data, account)
    log = config.log_path("postgres")
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        str(bin_dir / "initdb"),
        "--pgdata",
        str(data),
        "--username",
        PG_ROLE,
        "--auth-local=trust",  # the socket directory is mode 0700: only its owner (and root) reach it
        "--auth-host=scram-sha-256",
        "--encoding=UTF8",
        "--locale=C",
    ]
    extra: dict[str, object] = {}
    if account is not None:
        extra = {"user": account[0], "group": account[1], "extra_groups": []}
    with log.open("ab") as fh:
        fh.write(f"\n=== k3pipe stack: initdb: {shlex.join(argv)}\n".encode())
        fh.flush()
        offset = fh.tell()
        done = subprocess.run(
            argv,
            cwd=data,
            env=_pg_env(config),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            check=False,
            **extra,  # type: ignore[call-overload]
        )
    if done.returncode != 0:
        with log.open("rb") as fh:
            fh.seek(offset)
            tail = "\n".join(fh.read().decode(errors="replace").rstrip().splitlines()[-20:])
        raise StackError(
            f"postgres: initdb of {data} failed (exit code {done.returncode}); "
            f"its log {log} ends with:\n{tail}"
        )


def _pg_env(config: StackConfig) -> dict[str, str]:
    """PostgreSQL's programs get a minimal environment (no keys of the caller's)."""
    return {"PATH": config.base_env.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}


def _pg_argv(config: StackConfig, bin_dir: Path) -> list[str]:
    return [
        str(bin_dir / "postgres"),
        "-D",
        str(config.pg_data),
        "-p",
        str(config.postgres_port),
        "-c",
        f"listen_addresses={HOST}",
        "-c",
        f"unix_socket_directories={config.pg_socket_dir}",
    ]


def _pg_ready(config: StackConfig, bin_dir: Path, port: int) -> bool:
    done = subprocess.run(
        [str(bin_dir / "pg_isready"), "-q", "-h", HOST, "-p", str(port), "-U", PG_ROLE, "-d", "postgres"],
        env=_pg_env(config),
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _pg_password(config: StackConfig) -> str:
    """The ``k3pipe`` role's password, from the pgpass file (made, mode 0600, on first use)."""
    path = config.pgpass
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split(":")
            if len(parts) == 5 and parts[3] == PG_ROLE:
                return parts[4]
    password = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{HOST}:*:*:{PG_ROLE}:{password}\nlocalhost:*:*:{PG_ROLE}:{password}\n")
    return password


def _pg_provision(config: StackConfig, bin_dir: Path, port: int) -> None:
    """The role's password (as pgpass holds it) and the ``mlflow`` database, through the socket."""
    password = _pg_password(config)
    sql = (
        f"ALTER ROLE {PG_ROLE} WITH PASSWORD '{password}';\n"
        f"SELECT 'CREATE DATABASE {PG_DATABASE} OWNER {PG_ROLE}' "
        f"WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{PG_DATABASE}')\\gexec\n"
    )
    argv = [str(bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(config.pg_socket_dir)]
    argv += ["-p", str(port), "-U", PG_ROLE, "-d", "postgres", "-f", "-"]
    # the SQL (with the password) goes through stdin, never onto a command line
    done = subprocess.run(argv, input=sql, text=True, env=_pg_env(config), capture_output=True, check=False)
    if done.returncode != 0:
        raise StackError(
            f"postgres: could not set up role {PG_ROLE!r} and database {PG_DATABASE!r} through "
            f"{config.pg_socket_dir}: {(done.stderr or done.stdout).strip()[-1500:]}"
        )


# ----------------------------------------------------------------------------------------------------
# MLflow, Prefect and the worker


def _executable(config: StackConfig, name: str) -> str:
    path = config.bin_dir / name
    if not path.exists():
        raise StackError(f"the {name!r} executable is not in {config.bin_dir}; run `make venv` first")
    return str(path)


def _service_env(config: StackConfig, **overrides: str) -> dict[str, str]:
    env = dict(config.base_env)
    env.update(overrides)
    return env


def _prefect_env(config: StackConfig, api_port: int) -> dict[str, str]:
    env = _service_env(
        config,
        PREFECT_HOME=str(config.prefect_home),
        PREFECT_API_URL=config.url("prefect", api_port) + "/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    if (creds := config.credentials()) is not None:
        env["PREFECT_API_AUTH_STRING"] = ":".join(creds)
    if config.tls:
        env["PREFECT_API_SSL_CERT_FILE"] = str(config.tls_files.ca)
    return env


def _mlflow_auth_env(config: StackConfig) -> dict[str, str]:
    """With auth: MLflow's basic-auth app configured (its users in the stack's directory, the admin
    the stack's user, every other user given nothing by default) and the admin's password in the
    environment it reads at its first start."""
    creds = config.credentials()
    if creds is None:
        return {}
    ini = config.stack_dir / "mlflow-auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"auth_cache_ttl_seconds = {MLFLOW_AUTH_CACHE_S}\n"
        f"database_uri = sqlite:///{config.stack_dir / 'mlflow-auth.db'}\n"
        f"admin_username = {creds[0]}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    key_file = config.stack_dir / "mlflow-secret-key"  # its CSRF key: the same across restarts
    if not key_file.exists():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    key = key_file.read_text().strip()
    k3secrets.register(key)
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": creds[1],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": key,
    }


def _client(config: StackConfig, timeout_s: float) -> httpx.Client:
    """httpx for the stack's own calls to its servers: basic auth (with auth on), the stack's CA as
    the only trusted one (once it exists: a server started with TLS), no proxy from the environment."""
    verify: ssl.SSLContext | bool = True
    if config.tls_files.ca.exists():
        verify = ssl.create_default_context(cafile=str(config.tls_files.ca))
    return httpx.Client(auth=config.credentials(), verify=verify, trust_env=False, timeout=timeout_s)


def _mlflow_argv(config: StackConfig, pg_port: int) -> list[str]:
    tls = config.tls_files
    # uvicorn (MLflow's server by default) serves TLS itself; the key file is mode 0600
    serve_tls = ["--ssl-keyfile", str(tls.key), "--ssl-certfile", str(tls.cert)] if config.tls else []
    return [
        _executable(config, "mlflow"),
        "server",
        *(["--app-name", "basic-auth"] if config.auth else []),
        *(["--uvicorn-opts", shlex.join(serve_tls)] if serve_tls else []),
        "--host",
        config.host,
        "--port",
        str(config.mlflow_port),
        "--backend-store-uri",
        # SQLAlchemy 2.1's default PostgreSQL driver is psycopg 3: name psycopg2 (psycopg2-binary).
        # No password in it: libpq reads it from PGPASSFILE.
        f"postgresql+psycopg2://{PG_ROLE}@{HOST}:{pg_port}/{PG_DATABASE}",
        "--artifacts-destination",
        str(config.artifacts_dir),
        "--serve-artifacts",
        "--workers",
        "1",
    ]


def _prefect_argv(config: StackConfig, env: dict[str, str]) -> list[str]:
    """``prefect server start``; with TLS, the same application under uvicorn with its TLS options
    (``prefect server start`` has none: it runs ``create_app(final=True)`` under uvicorn in-process,
    which ``PREFECT__SERVER_FINAL`` and uvicorn's ``--factory`` do here). ``env`` gets what it needs."""
    if not config.tls:
        argv = [_executable(config, "prefect"), "server", "start", "--host", config.host]
        return [*argv, "--port", str(config.prefect_port)]
    env["PREFECT__SERVER_FINAL"] = "1"
    tls = config.tls_files
    return [
        _executable(config, "python"), "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
        "--host", config.host, "--port", str(config.prefect_port),
        "--ssl-keyfile", str(tls.key), "--ssl-certfile", str(tls.cert),
    ]  # fmt: skip


def _run_prefect(config: StackConfig, api_port: int, args: list[str], what: str, timeout_s: float) -> str:
    """Run the Prefect CLI against the stack's server; its output goes to logs/prefect-setup.log."""
    env = _prefect_env(config, api_port)
    env["PWD"] = str(config.project_dir)  # prefect.yaml's pull step is "{{ $PWD }}" at deploy time
    log = config.log_path("prefect-setup")
    argv = [_executable(config, "prefect"), *args]
    try:
        done = subprocess.run(
            argv,
            cwd=config.project_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            f"prefect: {what} did not finish within {timeout_s:.0f} s ({shlex.join(argv)})"
        ) from exc
    output = (done.stdout or "") + (done.stderr or "")
    with log.open("a") as fh:
        fh.write(f"\n=== k3pipe stack: {shlex.join(args)} (exit code {done.returncode})\n{output}")
    if done.returncode != 0:
        tail = "\n".join(output.rstrip().splitlines()[-25:])
        raise StackError(
            f"prefect: {what} failed (`prefect {shlex.join(args)}` exit code {done.returncode}, output in "
            f"{log}):\n{tail}"
        )
    return output


def _pools_named(project_dir: Path) -> list[str]:
    """The work pools prefect.yaml's deployments name, ``k3pipe`` first (a deploy fails for a pool
    that does not exist, although it deploys)."""
    config = yaml.safe_load((project_dir / "prefect.yaml").read_text()) or {}
    named = [
        str((d.get("work_pool") or {}).get("name"))
        for d in config.get("deployments") or []
        if (d.get("work_pool") or {}).get("name")
    ]
    return list(dict.fromkeys([WORK_POOL, *named]))


def _ensure_pool(config: StackConfig, api_port: int, name: str) -> None:
    api = config.url("prefect", api_port) + "/api"
    with _client(config, 10.0) as http:
        pool = http.get(f"{api}/work_pools/{name}")
    if pool.status_code == 404:
        _run_prefect(config, api_port, ["work-pool", "create", name, "--type", "process"], "work pool", 120)
        limit = None
    elif pool.status_code == 200:
        limit = pool.json().get("concurrency_limit")
    else:
        raise StackError(
            f"prefect: GET {api}/work_pools/{name} answered {pool.status_code}: {pool.text[:300]}"
        )
    if limit != 1:
        _run_prefect(
            config, api_port, ["work-pool", "set-concurrency-limit", name, "1"], "concurrency limit", 120
        )


def _ensure_pool_and_deployments(config: StackConfig, api_port: int, progress: Progress) -> None:
    """Every work pool prefect.yaml names (process, concurrency limit 1: one run at a time on a
    node), and prefect.yaml's deployments. The stack's worker serves the ``k3pipe`` pool; another
    pool (a GPU node's, ``gpu-node``) waits for that node's worker."""
    if not (config.project_dir / "prefect.yaml").is_file():
        raise StackError(
            f"prefect: no prefect.yaml in {config.project_dir} to deploy; run `k3pipe stack up` from the "
            "k3pipe checkout"
        )
    pools = _pools_named(config.project_dir)
    for name in pools:
        _ensure_pool(config, api_port, name)
    progress(f"prefect: work pool(s) {', '.join(map(repr, pools))} (process, concurrency limit 1)")
    _run_prefect(config, api_port, ["--no-prompt", "deploy", "--all"], "deploy --all", 300)
    progress(f"prefect: deployed prefect.yaml's deployments from {config.project_dir}")


def _worker_name() -> str:
    return f"k3pipe-stack-{socket.gethostname()}"


def _worker_online(config: StackConfig, api_port: int, name: str, since: dt.datetime) -> bool:
    """Whether the worker called ``name`` has sent a heartbeat since ``since``."""
    url = config.url("prefect", api_port) + f"/api/work_pools/{WORK_POOL}/workers/filter"
    try:
        with _client(config, 5.0) as http:
            answer = http.post(url, json={})
    except httpx.HTTPError:
        return False
    if answer.status_code != 200:
        return False
    for worker in answer.json():
        beat = worker.get("last_heartbeat_time")
        if worker.get("name") == name and beat:
            when = dt.datetime.fromisoformat(beat.replace("Z", "+00:00"))
            if when >= since:
                return True
    return False


def _worker_env(config: StackConfig, api_port: int, mlflow_port: int) -> dict[str, str]:
    env = _prefect_env(config, api_port)
    env.update(client_env(config, mlflow_port, api_port))
    env["K3PIPE_HOME"] = str(config.home)
    env.pop("K3PIPE_MLFLOW_TRACKING_URI", None)
    return env


def client_env(
    config: StackConfig, mlflow_port: int | None = None, prefect_port: int | None = None
) -> dict[str, str]:
    """What a client of the stack (a worker, a node's worker, a study started from a shell) needs in
    its environment, by MLflow's and Prefect's own names: the two URLs; with auth the user and
    password (read from the credentials file: pass this to a process's environment, never to a
    command line or a log); with TLS the stack's CA for both clients."""
    state = load_state(config)
    if mlflow_port is None:
        mlflow_port = state["mlflow"].port if "mlflow" in state else config.mlflow_port
    if prefect_port is None:
        prefect_port = state["prefect"].port if "prefect" in state else config.prefect_port
    env = {
        "MLFLOW_TRACKING_URI": config.url("mlflow", mlflow_port),
        "PREFECT_API_URL": config.url("prefect", prefect_port) + "/api",
    }
    if (creds := config.credentials()) is not None:
        env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"] = creds
        env["PREFECT_API_AUTH_STRING"] = ":".join(creds)
    if config.tls:
        env["PREFECT_API_SSL_CERT_FILE"] = env["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(config.tls_files.ca)
    return env


# ----------------------------------------------------------------------------------------------------
# up, down, status, env


def _running(state: Mapping[str, ServiceRecord], name: str) -> ServiceRecord | None:
    record = state.get(name)
    if record is not None and alive(record.pid, record.proc_start):
        return record
    return None


def up(config: StackConfig, progress: Progress = lambda _line: None) -> dict[str, ServiceRecord]:
    """Start what is not running (PostgreSQL, MLflow, Prefect, pool and deployments, worker) and wait
    until each is ready. A running service is left as it is. When a start fails, everything this call
    started is stopped again and a StackError names the service, its log and the log's last lines."""
    _check_distinct_ports(config)
    _check_exposure(config)
    with _locked(config):
        state = load_state(config)
        launched: dict[str, subprocess.Popen[bytes]] = {}
        try:
            _up(config, state, launched, progress)
        except BaseException:
            for name in reversed(SERVICES):
                if name in launched and name in state:
                    outcome = _stop_group(state.pop(name))
                    launched[name].poll()
                    progress(f"{name}: {outcome} (a start failed)")
            _save_state(config, state)
            raise
        return state


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def _check_exposure(config: StackConfig) -> None:
    """MLflow and Prefect bind beyond loopback only with auth and TLS on: neither asks who calls by
    itself, and over plain HTTP the password and every run cross the network readable."""
    if _loopback(config.host):
        return
    if not config.auth:
        raise StackError(
            f"K3PIPE_STACK_HOST={config.host} binds MLflow and Prefect beyond loopback, where anyone who "
            "reaches the ports could read and change every run, with K3PIPE_STACK_AUTH off: turn it on "
            f"(the user and password are kept in {config.credentials_file}, made if absent), or bind "
            "127.0.0.1 and reach the stack through an SSH tunnel"
        )
    if not config.tls:
        raise StackError(
            f"K3PIPE_STACK_HOST={config.host} binds MLflow and Prefect beyond loopback with K3PIPE_STACK_TLS "
            "off: the stack's password and every run would cross the network as plain HTTP; turn it on "
            f"(the stack's CA and certificate are made in {config.tls_files.directory}; name the addresses "
            "nodes use in K3PIPE_STACK_TLS_NAMES), or bind 127.0.0.1 and reach the stack through an SSH "
            "tunnel"
        )


def _check_distinct_ports(config: StackConfig) -> None:
    ports = {s: config.port(s) for s in ("postgres", "mlflow", "prefect")}
    for a in ports:
        for b in ports:
            if a < b and ports[a] == ports[b]:
                raise StackError(
                    f"{a} and {b} are both set to port {ports[a]}; give each its own "
                    f"({_PORT_SETTING[a]}, {_PORT_SETTING[b]})"
                )


def _up(
    config: StackConfig,
    state: dict[str, ServiceRecord],
    launched: dict[str, subprocess.Popen[bytes]],
    progress: Progress,
) -> None:
    t0 = time.monotonic()
    timeout = config.start_timeout_s
    for name in SERVICES:
        record = state.get(name)
        if record is not None and not _running(state, name):
            # the leader died: end what is left of its group, forget it, start it again below
            progress(f"{name}: {_stop_group(record)}; starting it again")
            del state[name]
    _save_state(config, state)

    def start(name: str, argv: list[str], env: Mapping[str, str], cwd: Path, **kw: object) -> None:
        record, proc = _launch(config, name, argv, env, cwd, **kw)  # type: ignore[arg-type]
        state[name], launched[name] = record, proc
        _save_state(config, state)
        progress(f"{name}: started (pid {record.pid}), log {record.log}")

    def keep(name: str) -> None:
        rec = state[name]
        note = f" (settings now say port {config.port(name)})" if rec.port != config.port(name) else ""
        progress(f"{name}: already running (pid {rec.pid}), {rec.url}{note}")

    if config.tls:
        tls = ensure_certificates(config.tls_files.directory, config.cert_names())
        progress(f"tls: {describe(tls)}")
    # PostgreSQL and the Prefect server start side by side; MLflow needs PostgreSQL first
    pg_bin = _pg_bin(config)
    if "postgres" in state:
        keep("postgres")
    else:
        account = _pg_account(config)
        _prepare_postgres(config, pg_bin, account)
        _check_port(config, "postgres")
        start("postgres", _pg_argv(config, pg_bin), _pg_env(config), config.pg_data, run_as=account)
    if "prefect" in state:
        keep("prefect")
    else:
        _check_port(config, "prefect")
        config.prefect_home.mkdir(parents=True, exist_ok=True)
        env = _prefect_env(config, config.prefect_port)
        if (creds := config.credentials()) is not None:  # in the environment, never on a command line
            env["PREFECT_SERVER_API_AUTH_STRING"] = ":".join(creds)
        start("prefect", _prefect_argv(config, env), env, config.prefect_home)

    pg = state["postgres"]
    _wait_ready(
        "postgres",
        pg,
        launched.get("postgres"),
        lambda: _pg_ready(config, pg_bin, pg.port),
        f"pg_isready on {HOST}:{pg.port}",
        timeout,
    )
    _pg_provision(config, pg_bin, pg.port)
    progress(f"postgres: ready at {pg.url} ({time.monotonic() - t0:.1f} s)")

    if "mlflow" in state:
        keep("mlflow")
    else:
        _check_port(config, "mlflow")
        config.artifacts_dir.mkdir(parents=True, exist_ok=True)
        env = _service_env(config, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", PGPASSFILE=str(config.pgpass))
        env.pop("MLFLOW_TRACKING_URI", None)
        env.update(_mlflow_auth_env(config))
        start("mlflow", _mlflow_argv(config, pg.port), env, config.stack_dir)

    pf = state["prefect"]
    _wait_ready(
        "prefect",
        pf,
        launched.get("prefect"),
        lambda: _http_ok(config, f"{pf.url}/api/health"),
        f"GET {pf.url}/api/health",
        timeout,
    )
    progress(f"prefect: ready at {pf.url} (API {pf.url}/api) ({time.monotonic() - t0:.1f} s)")
    start_worker = config.worker and "worker" not in state
    if start_worker:
        # deployments are (re)made when a worker is started for them; a running worker keeps its own
        _ensure_pool_and_deployments(config, pf.port, progress)

    ml = state["mlflow"]
    _wait_ready(
        "mlflow",
        ml,
        launched.get("mlflow"),
        lambda: _http_ok(config, f"{ml.url}/health"),
        f"GET {ml.url}/health",
        timeout,
    )
    progress(f"mlflow: ready at {ml.url} ({time.monotonic() - t0:.1f} s)")

    if "worker" in state:
        keep("worker")
    elif start_worker:
        name = _worker_name()
        since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
        argv = [_executable(config, "prefect"), "worker", "start", "--pool", WORK_POOL, "--name", name]
        start("worker", argv, _worker_env(config, pf.port, ml.port), config.project_dir)
        wk = state["worker"]
        _wait_ready(
            "worker",
            wk,
            launched["worker"],
            lambda: _worker_online(config, pf.port, name, since),
            f"a heartbeat of worker {name!r} in pool {WORK_POOL!r}",
            timeout,
        )
        wk.url = f"pool {WORK_POOL} at {pf.url}/api"
        _save_state(config, state)
        progress(f"worker: {name!r} polling pool {WORK_POOL!r} ({time.monotonic() - t0:.1f} s)")
    else:
        progress("worker: not started (K3PIPE_STACK_WORKER=false)")


def down(config: StackConfig, progress: Progress = lambda _line: None) -> dict[str, str]:
    """Stop exactly what the state file records, worker first, each by its process group (also when
    some already died). Returns what happened to each service."""
    if not config.state_file.exists():
        progress(f"nothing to stop: no stack recorded in {config.state_file}")
        return {}
    with _locked(config):
        state = load_state(config)
        outcomes: dict[str, str] = {}
        for name in reversed(SERVICES):
            record = state.get(name)
            if record is None:
                continue
            outcomes[name] = _stop_group(record)
            del state[name]
            _save_state(config, state)
            progress(f"{name}: {outcomes[name]}")
        if not outcomes:
            progress(f"nothing to stop: no stack recorded in {config.state_file}")
        return outcomes


def status(config: StackConfig) -> list[ServiceStatus]:
    """Each service: running or not, pid, URL, log, and whether its server answers its health check."""
    state = load_state(config)
    rows = []
    for name in SERVICES:
        record = state.get(name)
        log = Path(record.log) if record else config.log_path(name)
        if record is None:
            note = "not started (K3PIPE_STACK_WORKER=false)" if name == "worker" and not config.worker else ""
            rows.append(ServiceStatus(name, False, None, config.url(name), log, note=note or "not started"))
            continue
        running = alive(record.pid, record.proc_start)
        answering: bool | None = None
        if running and name == "mlflow":
            answering = _http_ok(config, f"{record.url}/health")
        elif running and name == "prefect":
            answering = _http_ok(config, f"{record.url}/api/health")
        elif running and name == "postgres":
            with contextlib.suppress(StackError):
                answering = _pg_ready(config, _pg_bin(config), record.port)
        note = "" if running else f"not running (pid {record.pid} gone; `k3pipe stack up` restarts it)"
        rows.append(ServiceStatus(name, running, record.pid, record.url, log, answering, note))
    return rows


def env_lines(config: StackConfig) -> list[str]:
    """The export lines that point a shell (or a GPU node) at the stack's MLflow and Prefect."""
    state = load_state(config)
    mlflow_port = state["mlflow"].port if "mlflow" in state else config.mlflow_port
    prefect_port = state["prefect"].port if "prefect" in state else config.prefect_port
    lines = [
        f"export MLFLOW_TRACKING_URI={shlex.quote(config.url('mlflow', mlflow_port))}",
        f"export PREFECT_API_URL={shlex.quote(config.url('prefect', prefect_port) + '/api')}",
    ]
    if config.auth:  # read from the file where the shell runs: the password is never printed
        path = shlex.quote(str(config.credentials_file))
        lines += [
            f'export PREFECT_API_AUTH_STRING="$(cat {path})"',
            f'export MLFLOW_TRACKING_USERNAME="$(cut -d: -f1 {path})"',
            f'export MLFLOW_TRACKING_PASSWORD="$(cut -d: -f2- {path})"',
        ]
    if config.tls:  # each client trusts the stack's CA: Prefect's and MLflow's own settings
        ca = shlex.quote(str(config.tls_files.ca))
        lines += [f"export PREFECT_API_SSL_CERT_FILE={ca}", f"export MLFLOW_TRACKING_SERVER_CERT_PATH={ca}"]
    return lines


def security_lines(config: StackConfig) -> list[str]:
    """What ``k3pipe stack status`` says of who may call the servers and how: auth, TLS."""
    where = "beyond loopback" if not _loopback(config.host) else "loopback only"
    auth = (
        f"auth: on (user and password in {config.credentials_file}, mode 0600)"
        if config.auth
        else "auth: off (K3PIPE_STACK_AUTH=true turns it on)"
    )
    tls = (
        f"tls: on ({describe(config.tls_files)})"
        if config.tls
        else "tls: off: plain HTTP (K3PIPE_STACK_TLS=true turns it on)"
    )
    return [f"bind: {config.host} ({where})", auth, tls]


def add_node(config: StackConfig, name: str, progress: Progress = lambda _line: None) -> list[str]:
    """A GPU node for fleet studies: its work pool ``name`` (process, concurrency limit 1) and the
    ``launch/<name>`` deployment of ``flows/fleet.py``'s launch flow on it, on the running stack's
    Prefect; returns the lines that start the node's worker (run them on the node, from its k3pipe
    checkout, with its own K3PIPE_HOME)."""
    from k3pipe.schema.specs import safe_name

    try:
        safe_name(name, "node (work pool)")
    except ValueError as exc:
        raise StackError(str(exc)) from None
    state = load_state(config)
    prefect = _running(state, "prefect")
    mlflow = _running(state, "mlflow")
    if prefect is None or mlflow is None:
        raise StackError("the stack is not running (Prefect and MLflow): `k3pipe stack up` first")
    _ensure_pool(config, prefect.port, name)
    progress(f"prefect: work pool {name!r} (process, concurrency limit 1)")
    _run_prefect(
        config, prefect.port,
        ["--no-prompt", "deploy", "flows/fleet.py:launch", "--name", name, "--pool", name],
        f"deploy launch/{name}", 300,
    )  # fmt: skip
    progress(f"prefect: deployed launch/{name} (flows/fleet.py:launch) from {config.project_dir}")
    copy = (
        [f"# first copy {config.credentials_file} to the node, at the same path, mode 0600"]
        if config.auth
        else ["# the stack binds 127.0.0.1: reach it through an SSH tunnel (README, 'GPU nodes')"]
    )
    if config.tls:
        copy.append(f"# and {config.tls_files.ca} (the stack's CA: not secret), at the same path")
    return [
        *copy,
        *env_lines(config),
        "export K3PIPE_HOME=/path/to/the/nodes/k3pipe-home   # its models, engine venvs, caches",
        f"prefect worker start --pool {shlex.quote(name)}   # from the node's k3pipe checkout",
    ]
