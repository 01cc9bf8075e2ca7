"""Deploy the engine through GPUStack as a "custom backend", the way the study did, and benchmark it
through GPUStack's OpenAI-compatible gateway.

The API used is GPUStack 2.3.0's (the ``gpustack`` wheel on PyPI; paths below are files of its
``gpustack/`` package):

- every management route sits under ``/v2`` (``routes/routes.py:79``) and takes the API key as
  ``Authorization: Bearer`` (``api/auth.py:74``); lists answer ``{"items": [...], "pagination": {page,
  perPage, total, totalPage}}`` (``schemas/common.py:23,103``);
- the custom backend: ``GET /v2/inference-backends/backend_name/{name}`` (400 when there is none,
  ``routes/inference_backend.py:1162-1186``), ``POST /v2/inference-backends`` and ``PUT
  /v2/inference-backends/{id}`` (``:1189``, ``:1339``) with ``backend_name``, ``version_configs:
  {version: {image_name, run_command, env}}``, ``default_version``, ``health_check_path``
  (``schemas/inference_backend.py:34-130``); the name must end in ``-custom``, the versions of a
  custom backend may be named anything (``routes/inference_backend.py:1239,1381-1392,1792-1821``);
- the run command's placeholders ``{{model_path}}``, ``{{port}}``, ``{{model_name}}`` (and
  ``{{worker_ip}}``, ``{{gpu_count}}``, ``{{gpu_ids}}``), no spaces inside the braces
  (``utils/template.py:32,100-139``); the custom backend runs it in a container on the host network
  (``worker/backends/custom.py:139,155-176``), the model's name as ``{{model_name}}``;
- the deployment: ``POST /v2/models`` (``routes/models.py:1627``) with ``name``, ``source:
  local_path``, ``local_path``, ``replicas``, ``backend``, ``backend_version``, ``env``,
  ``worker_selector`` (the worker's ``worker-name`` label, ``worker/worker_manager.py:151``),
  ``gpu_selector: {gpu_ids: ["worker:cuda:0"], gpus_per_replica}`` (``schemas/models.py:110-113``),
  ``restart_on_error`` (``:1112``, default true), ``enable_model_route`` (the OpenAI route named
  after the model, ``routes/models.py:1500-1545``) and ``cluster_id``: without it the real server
  answers 500 "Failed to create model" (its table's column is NOT NULL), so the launcher sends
  ``launcher.cluster_id``, else the worker's (``GET /v2/workers`` lists each worker's), else the
  only one ``GET /v2/clusters`` lists; ``DELETE /v2/models/{id}`` (``:2648``), after which ``GET
  /v2/models/{id}`` answers 404;
- its instances: ``GET /v2/model-instances?model_id=ID`` (``routes/model_instances.py:104``), each with
  ``state`` (pending, analyzing, scheduled, initializing, downloading, starting, running, error,
  unreachable: ``schemas/models.py:1586-1614``), ``state_message``, ``download_progress``,
  ``restart_count``, ``worker_name``, ``gpu_indexes`` (``:1707-1761``); the instance's log: ``GET
  /v2/model-instances/{id}/logs?follow=true`` streamed as text (``routes/model_instances.py:228-306``,
  options ``worker/logs.py:40``);
- requests: ``/v1/chat/completions`` and ``/v1/models`` (``routes/routes.py:486-491``; ``/v1-openai``
  is the frozen legacy alias), the model id the deployment's name; 503 "No running instances
  available" while the deployment is not serving (``routes/openai.py:225-240``).

Checked against the real 2.3.0 server on this machine (``scripts/gpustack-real.sh``, 2026-12-05):
every call above answers as described; its worker schedules a deployment only where it has the GPUs
(or with ``cpu_offloading``) and runs it only where it has a container runtime: without one the
instance stays SCHEDULED with no message, which the progress lines say after
:data:`SCHEDULED_STALL_S`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shlex
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from k3pipe.core import secrets
from k3pipe.core.errors import LaunchError
from k3pipe.core.secrets import scrub
from k3pipe.core.settings import env_value
from k3pipe.engines import get_engine
from k3pipe.launchers.base import Launcher, tail_file
from k3pipe.schema.launcher_specs import MODEL_PATH, GpustackLauncherSpec

if TYPE_CHECKING:
    from k3pipe.planning.plan import ArmPlan

__all__ = ["GpustackLauncher", "build"]

log = logging.getLogger("k3pipe.launchers.gpustack")

API = "/v2"
_FAILED = ("error", "unreachable")
SCHEDULED_STALL_S = 120.0
"""An instance SCHEDULED this long without a change is said to be stuck (the image pull and the
engine's start show as DOWNLOADING/STARTING)."""

# Deployments still up at interpreter exit are deleted, as the process launcher ends its groups.
_LIVE: weakref.WeakSet[GpustackLauncher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for launcher in list(_LIVE):
        launcher.stop()


def build(
    spec: GpustackLauncherSpec,
    plan: ArmPlan,
    log_path: Path,
    env: Mapping[str, str],
    base_env: Mapping[str, str],
    image: str | None,
    labels: Mapping[str, str],
    home: Path | None = None,
) -> Launcher:
    """A GPUStack deployment launcher for ``plan``; the GPUStack key from ``launcher.api_key_env``."""
    key = env_value(spec.api_key_env)
    if not key:
        raise LaunchError(
            f"arm {plan.arm!r}: launcher.api_key_env names {spec.api_key_env}, which is not set; "
            f"export {spec.api_key_env}=<a GPUStack API key> and start the run again"
        )
    secrets.register(key)
    return GpustackLauncher(spec, Deployment.of(plan, dict(env)), key, log_path)


@dataclass(frozen=True)
class Deployment:
    """What GPUStack is asked for: the backend version (image, run command for people to read) and
    the model (the command that runs, where, on which worker and GPUs, with which environment)."""

    name: str
    image: str
    run_command: str
    health_path: str
    local_path: str
    env: dict[str, str]

    @classmethod
    def of(cls, plan: ArmPlan, env: dict[str, str]) -> Deployment:
        local = next(host for host, seen in plan.mounts.items() if seen == MODEL_PATH)
        return cls(
            name=plan.model,
            image=plan.image or "",
            run_command=shlex.join(plan.command.argv),
            health_path=get_engine(plan.engine).health_path,
            local_path=local,
            env=env,
        )

    def backend_version(self) -> dict[str, Any]:
        # the backend outlives the deployment: its command is the arm's with every secret masked;
        # the command that runs (secrets resolved) goes with the deployment, which is deleted
        return {"image_name": self.image, "run_command": scrub(self.run_command)}

    def model(self, spec: GpustackLauncherSpec, worker: str | None, cluster_id: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "source": "local_path",
            "local_path": self.local_path,
            "replicas": 1,
            "categories": ["llm"],
            "backend": spec.backend,
            "backend_version": spec.backend_version,
            "image_name": self.image,
            "run_command": self.run_command,
            "env": self.env,
            "restart_on_error": spec.restart_on_error,
            "enable_model_route": True,
            "cluster_id": cluster_id,
        }
        if worker is not None:
            body["worker_selector"] = {"worker-name": worker}
        if spec.gpus is not None:
            body["gpu_selector"] = {
                "gpu_ids": [f"{worker}:{spec.device}:{i}" for i in spec.gpus],
                "gpus_per_replica": len(spec.gpus),
            }
        return body


class Api:
    """GPUStack's management API with the key; every failure a LaunchError that says what failed."""

    def __init__(self, server_url: str, key: str, timeout_s: float) -> None:
        self.server_url = server_url
        self.client = httpx.Client(
            base_url=server_url + API,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout_s,
            trust_env=False,
        )

    def call(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kwargs: Any) -> httpx.Response:
        try:
            resp = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise LaunchError(
                f"GPUStack at {self.server_url} did not answer {method} {API}{path}: "
                f"{type(exc).__name__}: {exc}; check launcher.server_url and that the server runs"
            ) from exc
        if resp.status_code not in ok:
            hint = " (check the key in launcher.api_key_env)" if resp.status_code in (401, 403) else ""
            raise LaunchError(
                f"GPUStack {method} {API}{path} answered {resp.status_code}: {_message(resp)}{hint}"
            )
        return resp

    def items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        resp = self.call("GET", path, params={**params, "perPage": 1000})
        items: list[dict[str, Any]] = resp.json()["items"]
        return items

    def close(self) -> None:
        self.client.close()


def _message(resp: httpx.Response) -> str:
    """GPUStack's error message (``{"message": ...}``), else the body's start."""
    try:
        body = resp.json()
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])[:500]
    except ValueError:
        pass
    return resp.text[:500]


class GpustackLauncher:
    """One deployment on GPUStack: started by :meth:`start`, followed by :meth:`ready` (its instance's
    states), its log streamed into ``log_path``, deleted and confirmed gone by :meth:`stop`."""

    kind = "gpustack"

    def __init__(self, spec: GpustackLauncherSpec, deployment: Deployment, key: str, log_path: Path) -> None:
        self.spec = spec
        self.deployment = deployment
        self.api = Api(spec.server_url, key, spec.request_timeout_s)
        self.log_path: Path | None = log_path
        self.model_id: int | None = None
        self.left_behind: str | None = None
        self._seen: tuple[Any, ...] | None = None
        self._since = time.monotonic()  # when the instance's state (as reported) last changed
        self._stalled = False
        self._restarts = 0
        self._had_instance = False
        self._checked: tuple[float, dict[str, Any] | None] | None = None
        self._stopping = threading.Event()
        self._deleted = False
        self._follower: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self.model_id is not None:
            raise LaunchError(f"deployment {self.deployment.name!r} already started (model {self.model_id})")
        worker = self._worker()
        cluster = self._cluster(worker)
        self._register_backend()
        self._delete_leftover()
        body = self.deployment.model(self.spec, worker["name"] if worker else None, cluster)
        created = self.api.call("POST", "/models", json=body).json()
        self.model_id = int(created["id"])
        _LIVE.add(self)
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._follower = threading.Thread(target=self._follow_log, name="k3pipe-gpustack-log", daemon=True)
        self._follower.start()

    def _worker(self) -> dict[str, Any] | None:
        """The worker named by ``launcher.worker`` (name or id): its name goes into gpu_ids and the
        worker-name label, its cluster is the deployment's."""
        wanted = self.spec.worker
        if wanted is None:
            return None
        workers = self.api.items("/workers")
        for worker in workers:
            if str(wanted) in (worker.get("name"), str(worker.get("id"))):
                return {**worker, "name": str(worker["name"])}
        known = ", ".join(f"{w.get('name')} (id {w.get('id')})" for w in workers) or "none"
        raise LaunchError(f"GPUStack has no worker {wanted!r}; launcher.worker may be one of: {known}")

    def _cluster(self, worker: dict[str, Any] | None) -> int:
        """The cluster the deployment goes to: ``launcher.cluster_id``, else the worker's, else the
        server's only cluster. GPUStack 2.3.0 needs one: a model without it fails to be stored (500
        "Failed to create model", its ``cluster_id`` column NOT NULL; seen on the real server)."""
        if self.spec.cluster_id is not None:
            return self.spec.cluster_id
        if worker is not None and worker.get("cluster_id") is not None:
            return int(worker["cluster_id"])
        clusters = self.api.items("/clusters")
        if len(clusters) == 1:
            return int(clusters[0]["id"])
        known = ", ".join(f"{c.get('name')} (id {c.get('id')})" for c in clusters) or "none"
        raise LaunchError(
            f"GPUStack has {len(clusters)} clusters ({known}): name the deployment's in launcher.cluster_id "
            "(or a worker in launcher.worker, whose cluster is taken)"
        )

    def _register_backend(self) -> None:
        """Create the custom backend, or add/replace this arm's version on the one there."""
        spec, dep = self.spec, self.deployment
        resp = self.api.call("GET", f"/inference-backends/backend_name/{spec.backend}", ok=(200, 400, 404))
        version = {spec.backend_version: dep.backend_version()}
        if resp.status_code != 200:
            body = {
                "backend_name": spec.backend,
                "version_configs": version,
                "default_version": spec.backend_version,
                "health_check_path": dep.health_path,
                "description": "registered by k3pipe",
            }
            self.api.call("POST", "/inference-backends", json=body)
            return
        backend = resp.json()
        backend["version_configs"] = {**(backend.get("version_configs") or {}), **version}
        backend["health_check_path"] = dep.health_path
        self.api.call("PUT", f"/inference-backends/{backend['id']}", json=backend)

    def _delete_leftover(self) -> None:
        """A deployment of this name left by a run killed before its teardown: deleted first."""
        for model in self.api.items("/models", search=self.deployment.name):
            if model.get("name") == self.deployment.name:
                log.warning("deleting GPUStack deployment %r left by an earlier run", model["name"])
                self._delete(int(model["id"]), self.spec.stop_timeout_s)

    # -- state ---------------------------------------------------------------------------------

    def _instance(self) -> dict[str, Any] | None:
        if self.model_id is None:
            return None
        items = self.api.items("/model-instances", model_id=self.model_id)
        if items:
            self._had_instance = True
        return items[0] if items else None

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        instance = self._instance()
        self._report(instance, progress)
        if instance is None:
            return False
        if instance.get("state") in _FAILED:
            self._join_log(2.0)
            raise LaunchError(
                f"GPUStack instance {instance.get('name')} of {self.deployment.name!r} went to "
                f"{str(instance.get('state')).upper()}: {instance.get('state_message') or 'no message'}; "
                f"last log lines ({self.log_path}):\n{self.log_tail()}"
            )
        return instance.get("state") == "running"

    def _report(self, instance: dict[str, Any] | None, progress: Callable[[str], None] | None) -> None:
        """One progress line per change of the instance's state (or download's percent)."""
        if instance is None:
            seen: tuple[Any, ...] = ("waiting",)
            line = f"gpustack: deployment {self.deployment.name!r} waiting for an instance"
        else:
            state = str(instance.get("state", "?"))
            percent = instance.get("download_progress")
            message = str(instance.get("state_message") or "").strip()
            seen = (state, int(percent) if state == "downloading" and percent is not None else None, message)
            line = f"gpustack: instance {instance.get('name')} {state.upper()}"
            if seen[1] is not None:
                line += f" {seen[1]}%"
            if state == "running":
                line += f" on worker {instance.get('worker_name')} GPUs {instance.get('gpu_indexes')}"
            elif message:  # why it waits: "No suitable workers found ..." while PENDING
                line += f": {message[:500]}"
            restarts = int(instance.get("restart_count") or 0)
            if restarts > self._restarts:
                self._restarts = restarts
                line += f" (restarted {restarts} times)"
                seen += (restarts,)
        say = progress or log.info
        if seen != self._seen:
            self._seen = seen
            self._since = time.monotonic()
            say(line)
        elif (
            seen[0] == "scheduled"
            and time.monotonic() - self._since > SCHEDULED_STALL_S
            and not self._stalled
        ):
            # the real 2.3.0 worker without a container runtime: "No available deployer" in its own
            # log only, the instance left SCHEDULED with no message (seen on this machine)
            self._stalled = True
            say(
                f"gpustack: instance {instance.get('name') if instance else '?'} SCHEDULED on worker "
                f"{(instance or {}).get('worker_name')} for {SCHEDULED_STALL_S:.0f} s and not starting: a "
                "worker that cannot run containers (no docker, podman or Kubernetes deployer) leaves its "
                "instances so; look for 'No available deployer' in the worker's log"
            )

    def alive(self) -> bool:
        if self.model_id is None or self._stopping.is_set():
            return False
        now = time.monotonic()
        if self._checked is None or now - self._checked[0] >= 1.0:
            try:
                self._checked = (now, self._instance())
            except LaunchError:
                return True  # the server did not answer this time: the requests tell the rest
        instance = self._checked[1]
        if instance is None:
            return not self._had_instance
        return instance.get("state") not in _FAILED

    def exit_code(self) -> int | None:
        return None  # the engine is a container on a GPUStack worker: no exit code reaches here

    # -- log -----------------------------------------------------------------------------------

    def _follow_log(self) -> None:
        """The instance's log into ``log_path`` as it comes, scrubbed; a broken stream resumes past
        the lines already written."""
        assert self.log_path is not None
        written = 0
        with self.log_path.open("a", encoding="utf-8", errors="replace") as out:
            while not self._stopping.is_set():
                instance = self._quiet_instance()
                if instance is None:
                    self._stopping.wait(self.spec.poll_s)
                    continue
                written = self._stream(int(instance["id"]), out, written)
                if self._stopping.is_set() or instance.get("state") in _FAILED:
                    return
                self._stopping.wait(self.spec.poll_s)

    def _quiet_instance(self) -> dict[str, Any] | None:
        try:
            return self._instance()
        except LaunchError:
            return None

    def _stream(self, instance_id: int, out: Any, skip: int) -> int:
        seen = 0
        path = f"/model-instances/{instance_id}/logs"
        with (
            contextlib.suppress(httpx.HTTPError),
            self.api.client.stream(
                "GET", path, params={"follow": "true"}, timeout=httpx.Timeout(10.0, read=None)
            ) as resp,
        ):
            if resp.status_code != 200:
                return skip
            for line in resp.iter_lines():
                seen += 1
                if seen > skip:
                    out.write(scrub(line) + "\n")
                    out.flush()
                if self._stopping.is_set():
                    break
        return max(seen, skip)

    def _join_log(self, timeout_s: float) -> None:
        if self._follower is not None:
            self._follower.join(timeout=timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        return tail_file(self.log_path, lines)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, grace_s: float | None = None) -> None:
        if self.model_id is None or self._deleted:
            return
        bound = self.spec.stop_timeout_s if grace_s is None else min(grace_s, self.spec.stop_timeout_s)
        self._stopping.set()  # alive() says no from here, the log follower ends with the instance
        try:
            self._delete(self.model_id, bound)
        except LaunchError as exc:  # stop must not raise (it runs on every exit, an interrupt's too)
            self.left_behind = str(exc)
            log.warning("%s", exc)
        else:
            self._deleted = True
            self.left_behind = None
            _LIVE.discard(self)
        # a deleted instance's log stream ends; one still running keeps the daemon follower blocked
        self._join_log(min(5.0, bound))
        if self._deleted:
            self.api.close()

    def _delete(self, model_id: int, bound_s: float) -> None:
        """Delete the deployment and confirm it is gone (404, no instance) within ``bound_s``."""
        self.api.call("DELETE", f"/models/{model_id}", ok=(200, 204, 404))
        deadline = time.monotonic() + bound_s
        while True:
            gone = self.api.call("GET", f"/models/{model_id}", ok=(200, 404)).status_code == 404
            if gone and not self.api.items("/model-instances", model_id=model_id):
                log.info("gpustack: deployment %d deleted and gone", model_id)
                return
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"GPUStack deployment {self.deployment.name!r} (model {model_id}) was deleted but is "
                    f"still listed after {bound_s:.0f} s; check GPUStack and delete it there"
                )
            time.sleep(min(0.5, self.spec.poll_s))
