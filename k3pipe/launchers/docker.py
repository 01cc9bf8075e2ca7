"""Run the engine in a container: pinned image, host network, models mounted read-only, labelled.

Every container k3pipe starts carries ``k3pipe.managed=true`` plus the experiment, arm and flow-run
labels, so a container whose run has ended can always be found and removed (:func:`reap_orphans`);
a leftover container would hold the GPUs and the next launch would run out of memory.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
from docker.types import DeviceRequest, Mount

from k3pipe.core.errors import LaunchError, SpecError
from k3pipe.core.layout import ARM_TAG, ENGINE_TAG, EXPERIMENT_TAG, MANAGED_LABEL, OWNER_LABEL
from k3pipe.core.layout import FLOW_RUN_TAG as FLOW_RUN_LABEL
from k3pipe.core.procs import alive, proc_stat
from k3pipe.core.secrets import scrub
from k3pipe.launchers.base import Launcher, tail_file
from k3pipe.schema.launcher_specs import DockerLauncherSpec

if TYPE_CHECKING:
    from k3pipe.planning.plan import ArmPlan

__all__ = [
    "FLOW_RUN_LABEL",
    "DockerLauncher",
    "connect",
    "reap_orphans",
]


def owner_label() -> str:
    """This process as an owner label (the boot, its pid and start time: never mistaken for another)."""
    stat = proc_stat(os.getpid())
    return f"{_boot_id()}:{os.getpid()}:{stat[2] if stat else ''}"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _owner_gone(label: str | None) -> bool | None:
    """Whether the owner a container's label names is gone (None: the label says nothing usable)."""
    if not label or label.count(":") != 2:
        return None
    boot, pid, start = label.split(":")
    if boot != _boot_id():
        return True  # the machine has rebooted since: that process is gone
    if not pid.isdigit():
        return None
    return not alive(int(pid), int(start) if start.isdigit() else None)


_LIVE: weakref.WeakSet[DockerLauncher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for launcher in list(_LIVE):
        launcher.stop()


def connect() -> docker.DockerClient:
    """A client for the Docker daemon of DOCKER_HOST (or the default socket), or a clear error."""
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as exc:
        raise LaunchError(
            f"the Docker daemon is not reachable ({exc}); start dockerd, or set DOCKER_HOST to its "
            "socket (the tests' daemon: scripts/docker-env.sh up)"
        ) from exc
    return client


def device_requests(gpus: int | list[str] | None) -> list[DeviceRequest]:
    """GPU requests: a count, or device ids; none when unset (a machine without GPUs)."""
    if gpus is None:
        return []
    if isinstance(gpus, int):
        return [DeviceRequest(count=gpus, capabilities=[["gpu"]])]
    return [DeviceRequest(device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])]


class DockerLauncher:
    """One engine container: created from a pinned image, its log streamed to a file."""

    kind = "docker"

    def __init__(
        self,
        client: docker.DockerClient,
        image: str,
        command: list[str],
        env: Mapping[str, str],
        log_path: Path,
        labels: Mapping[str, str],
        mounts: Mapping[str, str],
        gpus: int | list[str] | None = None,
        ipc: str | None = "host",
        shm_size: str | None = None,
        network: str = "host",
        init: bool = True,
        stop_timeout_s: float = 30.0,
        name: str | None = None,
        writable_mounts: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.image = image
        self.command = list(command)
        self.env = dict(env)
        self.log_path: Path | None = log_path
        self.labels = {MANAGED_LABEL: "true", OWNER_LABEL: owner_label(), **labels}
        self.mounts = dict(mounts)
        self.writable_mounts = dict(writable_mounts or {})  # host dir -> path, read-write (caches)
        self.gpus = gpus
        self.ipc = ipc
        self.shm_size = shm_size
        self.network = network
        self.init = init
        self.stop_timeout_s = stop_timeout_s
        self.name = name
        self.container: Any = None
        self._log_thread: threading.Thread | None = None
        self._exit_code: int | None = None

    @property
    def container_id(self) -> str | None:
        return None if self.container is None else str(self.container.id)

    def start(self) -> None:
        if self.container is not None:
            raise LaunchError(f"container already started ({self.container_id})")
        kwargs: dict[str, Any] = {
            "command": self.command,
            "environment": self.env,
            "labels": self.labels,
            "mounts": [Mount(target=c, source=h, type="bind", read_only=True) for h, c in self.mounts.items()]
            + [
                Mount(target=c, source=h, type="bind", read_only=False)
                for h, c in self.writable_mounts.items()
            ],
            "network_mode": self.network,
            "init": self.init,
            "device_requests": device_requests(self.gpus),
            "detach": True,
            "name": self.name,
        }
        if self.ipc:
            kwargs["ipc_mode"] = self.ipc
        if self.shm_size:
            kwargs["shm_size"] = self.shm_size
        try:
            self.container = self.client.containers.create(self.image, **kwargs)
        except docker.errors.DockerException as exc:
            raise LaunchError(f"could not create a container from {self.image}: {exc}") from exc
        _LIVE.add(self)
        try:
            self.container.start()
        except docker.errors.DockerException as exc:
            self.stop()
            raise LaunchError(
                f"could not start container {self.container_id} from {self.image}: {exc}"
            ) from exc
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_thread = threading.Thread(target=self._stream_logs, name="k3pipe-docker-logs", daemon=True)
        self._log_thread.start()

    def _stream_logs(self) -> None:
        """The container's output into the log file, whole lines at a time, each scrubbed of secrets
        (a chunk may end inside a line, and so inside a key)."""
        assert self.log_path is not None

        def write(fh: Any, data: bytes) -> None:
            fh.write(scrub(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape"))
            fh.flush()

        pending = b""
        with contextlib.suppress(Exception), self.log_path.open("ab") as fh:
            try:
                for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                    pending += chunk
                    if b"\n" in pending:
                        lines, pending = pending.rsplit(b"\n", 1)
                        write(fh, lines + b"\n")
            finally:
                if pending:
                    write(fh, pending)

    def _state(self) -> dict[str, Any]:
        try:
            self.container.reload()
        except docker.errors.NotFound:
            return {"Status": "removed", "ExitCode": self._exit_code}
        state: dict[str, Any] = self.container.attrs.get("State", {})
        return state

    def alive(self) -> bool:
        if self.container is None:
            return False
        state = self._state()
        if state.get("Status") in ("exited", "dead"):
            self._exit_code = state.get("ExitCode")
        return state.get("Status") in ("created", "running", "restarting")

    def exit_code(self) -> int | None:
        if self.container is None:
            return None
        if self._exit_code is None:
            self.alive()
        return self._exit_code

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        return True  # the health URL tells

    def log_tail(self, lines: int = 40) -> str:
        if self._log_thread is not None:
            self._log_thread.join(timeout=2)  # let the last lines of a dead container land
        text = tail_file(self.log_path, lines)
        if not text and self.container is not None:
            with contextlib.suppress(docker.errors.DockerException):
                text = scrub(self.container.logs(tail=lines).decode(errors="replace"))
        return text

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM, SIGKILL after the grace period (docker stop), then remove; idempotent."""
        container = self.container
        if container is None:
            return
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            grace = self.stop_timeout_s if grace_s is None else min(grace_s, self.stop_timeout_s)
            container.stop(timeout=max(1, int(grace)))
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            container.reload()
            self._exit_code = container.attrs.get("State", {}).get("ExitCode", self._exit_code)
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        if self._log_thread is not None:
            self._log_thread.join(timeout=5)
        _LIVE.discard(self)


def reap_orphans(
    client: docker.DockerClient,
    is_running: Callable[[str], bool],
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Remove the k3pipe containers whose run has provably ended; returns their ids.

    A container's run has ended when the k3pipe process that started it (its owner label) is gone,
    or, for a container without that label, when ``is_running`` says its flow run is over (it must
    answer True for a flow run it cannot read). Any other container is left alone: it may belong to
    a run that is going on elsewhere.
    """
    removed = []
    for container in client.containers.list(all=True, filters={"label": f"{MANAGED_LABEL}=true"}):
        run_id = container.labels.get(FLOW_RUN_LABEL, "")
        gone = _owner_gone(container.labels.get(OWNER_LABEL))
        if gone is False:
            continue  # its k3pipe process is alive
        if gone is None and (not run_id or run_id == "none" or is_running(run_id)):
            continue  # nothing proves that its run has ended
        if progress:
            progress(
                f"removing orphan container {container.short_id} ({container.labels.get(ARM_TAG, '?')} "
                f"of {container.labels.get(EXPERIMENT_TAG, '?')}, flow run {run_id or 'unknown'})"
            )
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        removed.append(str(container.id))
    return removed


def writable_mounts(spec: DockerLauncherSpec, plan: ArmPlan) -> dict[str, str]:
    """Host directory -> container path, mounted read-write: the compile cache k3pipe keeps."""
    cache = plan.compile_cache
    if cache is None or cache.source != "k3pipe" or not cache.host_dir:
        return {}
    return {cache.host_dir: cache.dir}


def equivalent_command(spec: DockerLauncherSpec, plan: ArmPlan, image: str | None = None) -> str:
    """The ``docker run`` command line (secrets redacted), for humans and the record."""
    parts = ["docker", "run", "--rm", "--network", spec.network]
    if spec.ipc:
        parts += ["--ipc", spec.ipc]
    if spec.shm_size:
        parts += ["--shm-size", spec.shm_size]
    if spec.init:
        parts.append("--init")
    if isinstance(spec.gpus, int):
        parts += ["--gpus", str(spec.gpus)]
    elif spec.gpus:
        parts += ["--gpus", f'"device={",".join(spec.gpus)}"']
    for host, container in plan.mounts.items():
        parts += ["-v", f"{host}:{container}:ro"]
    writable = writable_mounts(spec, plan)
    for host, container in writable.items():
        parts += ["-v", f"{host}:{container}"]
    if writable and plan.compile_cache is not None:
        for key, value in plan.compile_cache.settings(plan.command.env).items():
            parts += ["-e", f"{key}={value}"]
    for key, value in plan.command.redacted_env().items():
        # '-e NAME' takes NAME from the caller's environment: {env.NAME} exactly, never its value
        parts += ["-e", key if value == f"{{env.{key}}}" else f"{key}={value}"]
    parts.append(image or plan.image or "IMAGE")
    return shlex.join(parts) + " " + shlex.join(plan.command.redacted_argv())


def build(
    spec: DockerLauncherSpec,
    plan: ArmPlan,
    log_path: Path,
    env: Mapping[str, str],
    base_env: Mapping[str, str],
    image: str | None,
    labels: Mapping[str, str],
    home: Path | None = None,
) -> Launcher:
    """A container launcher for ``plan`` from the pinned ``image``."""
    if image is None:
        raise SpecError(f"arm {plan.arm!r}: the docker launcher needs the resolved image (pull step)")
    return DockerLauncher(
        connect(),
        image,
        plan.command.argv,
        env,
        log_path,
        labels={
            EXPERIMENT_TAG: plan.experiment,
            ARM_TAG: plan.arm,
            ENGINE_TAG: plan.engine,
            **labels,
        },
        mounts=plan.mounts,
        writable_mounts=writable_mounts(spec, plan),
        gpus=spec.gpus,
        ipc=spec.ipc,
        shm_size=spec.shm_size,
        network=spec.network,
        init=spec.init,
        stop_timeout_s=spec.stop_timeout_s,
    )
