"""A scripted stand-in for a GPUStack 2.3.0 server with one worker, for the ``gpustack`` launcher's tests.

The real server runs here, its worker does not: ``scripts/gpustack-real.sh`` (README, "GPUStack")
starts GPUStack 2.3.0 from PyPI with its worker in a network namespace of its own and drives the
launcher's calls against it, and the worker schedules a custom backend on this CPU-only machine only
with ``cpu_offloading``, then never starts it: it runs a custom backend as a container through
gpustack-runtime's docker, podman or Kubernetes deployer (``gpustack/worker/backends/custom.py:147``)
and has none here ("No available deployer ...", ``gpustack_runtime/deployer/__init__.py:116``), the
instance left SCHEDULED. So this server speaks GPUStack's /v2 API as the 2.3.0 wheel defines it (and
as the real server answered the launcher's calls, 2026-12-05), and runs the deployment's rendered run
command as a local process group instead of a container (the image is recorded, not pulled).
File:line below are of the wheel's ``gpustack/`` package:

- auth: ``Authorization: Bearer <key>`` on every route (``api/auth.py:74,163``); else 401;
- errors: ``{"code", "reason", "message"}`` (``api/exceptions.py:233-252``): 400 BadRequest, 404
  NotFound, 409 AlreadyExists (``:77-96``), 500 and 503;
- lists: ``{"items": [...], "pagination": {page, perPage, total, totalPage}}`` (``schemas/common.py:23,103``);
- ``GET /v2/workers`` (``routes/workers.py:192``), each worker labelled ``worker-name``
  (``worker/worker_manager.py:151``), with its ``cluster_id``; ``GET /v2/clusters``
  (``routes/clusters.py:188``);
- ``GET /v2/inference-backends/backend_name/{name}`` (400 when absent,
  ``routes/inference_backend.py:1162-1186``), ``POST`` (``:1189-1267``: a custom backend's name must end
  in ``-custom``, its versions may be named anything: ``:1239,1381-1392,1792-1821``; 409 on a duplicate
  name), ``PUT /v2/inference-backends/{id}`` (``:1339``);
  bodies per ``schemas/inference_backend.py:34-130``;
- ``GET /v2/models?search=`` (``routes/models.py:159``), ``POST /v2/models`` (``:1627``; 409 on a name
  taken; 500 "Failed to create model" without a ``cluster_id``, the table's NOT NULL column,
  ``:1650-1660``), ``GET /v2/models/{id}`` (``:256``, 404 once deleted), ``DELETE /v2/models/{id}``
  (``:2648``; the instances go with the model, ``server/services.py:913``); fields per
  ``schemas/models.py:1050-1194``, ``restart_on_error`` defaulting to true (``:1112``);
- ``GET /v2/model-instances?model_id=`` (``routes/model_instances.py:104``), instances moving
  PENDING -> SCHEDULED -> DOWNLOADING (``download_progress``) -> STARTING -> RUNNING, or ERROR with a
  ``state_message`` (``schemas/models.py:1586-1614,1707-1761``); with ``restart_on_error`` an ERROR
  instance is started again and ``restart_count`` grows;
- ``GET /v2/model-instances/{id}/logs?follow=true``: the instance's output as text, held open while it
  runs (``routes/model_instances.py:228-306``);
- the run command: the model's ``run_command`` else the version's (``worker/backends/base.py:1474-1493``),
  ``{{model_path}}``/``{{port}}``/``{{model_name}}``/... replaced (``utils/template.py:32,100-139``,
  ``worker/backends/custom.py:155-171``), then ``shlex.split``; its environment the version's ``env``
  and the model's ``env``;
- the OpenAI routes ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``
  (``routes/routes.py:486-491``), the model id the deployment's name (its route, ``routes/models.py:1536``),
  answered by proxying to the instance while it is RUNNING (``routes/openai.py:200-250``); else 503
  ``No running instances available`` while the model is there, 404 ``Model not found`` once it is
  not (``:225-240``).

Scripted faults: ``kill_after_requests=N`` kills the instance's process group after N proxied
requests (a crash mid-workload); ``gateway_status=S`` answers every OpenAI request with S (a gateway
that refuses the probe); ``keep_deleted`` answers a deployment's DELETE but keeps listing it.
``calls`` records every request (method, path) for the tests, ``created`` each deployment's body and
``proxied_models`` the model ids requests named.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_.]*)\}\}")
Routed = tuple[int, Any] | Callable[[], None]
"""A route's answer: status and JSON payload, or a streamer run outside the server's lock."""

WORKER = {
    "id": 1,
    "name": "standin-worker",
    "labels": {"worker-name": "standin-worker"},
    "gpus": 8,
    "cluster_id": 1,
    "state": "ready",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    409: "AlreadyExists",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


class _Error(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"code": status, "reason": _REASONS.get(status, "Error"), "message": message}


def _page(items: list[dict[str, Any]]) -> dict[str, Any]:
    per = max(len(items), 1)
    return {"items": items, "pagination": {"page": 1, "perPage": per, "total": len(items), "totalPage": 1}}


class Instance:
    """One model instance: its record, its engine process, its log lines."""

    def __init__(self, server: GpustackStandin, model: dict[str, Any], ident: int) -> None:
        self.server = server
        self.model = model
        self.record: dict[str, Any] = {
            "id": ident,
            "name": f"{model['name']}-{ident}",
            "model_id": model["id"],
            "model_name": model["name"],
            "state": "pending",
            "state_message": None,
            "download_progress": None,
            "restart_count": 0,
            "worker_id": None,
            "worker_name": None,
            "gpu_indexes": [],
            "port": None,
        }
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.proc: subprocess.Popen[bytes] | None = None
        self.deleted = False
        self.ended = False

    def set(self, **fields: Any) -> None:
        with self.changed:
            self.record.update(fields)
            self.changed.notify_all()

    def run(self) -> None:
        """The scheduler, the download and the worker's start, as states; then the process's watch."""
        pace = self.server.pace_s
        time.sleep(pace)
        selector = self.model.get("gpu_selector") or {}
        gpus = [int(g.rsplit(":", 1)[1]) for g in selector.get("gpu_ids") or []]
        where = {"worker_id": WORKER["id"], "worker_name": WORKER["name"], "gpu_indexes": gpus or [0]}
        self.set(state="scheduled", **where)
        for percent in (0.0, 50.0, 100.0):
            time.sleep(pace)
            if self.deleted:
                return
            self.set(state="downloading", download_progress=percent)
        while not self.deleted:
            self._start_once()
            code = self._watch()
            if code is None or self.deleted:
                return
            self.set(state="error", state_message=f"the inference server exited with code {code}")
            if not self.model.get("restart_on_error", True):
                return
            time.sleep(pace)
            self.set(restart_count=self.record["restart_count"] + 1)

    def _start_once(self) -> None:
        port = _free_port()
        command, env = self.server.command_for(self.model, port, self.record["gpu_indexes"])
        self.set(state="starting", port=port, state_message=None)
        self.proc = subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            with self.changed:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self.changed.notify_all()

    def _watch(self) -> int | None:
        """RUNNING once the health path answers 200; the exit code when the process ends."""
        assert self.proc is not None
        path = self.server.backend_of(self.model).get("health_check_path") or "/health"
        while not self.deleted:
            code = self.proc.poll()
            if code is not None:
                return code
            if self.record["state"] == "starting" and self._healthy(path):
                self.set(state="running")
            time.sleep(0.2)
        return None

    def _healthy(self, path: str) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.record["port"], timeout=2)
        try:
            conn.request("GET", path)
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def kill(self, sig: int = signal.SIGTERM) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def delete(self) -> None:
        self.deleted = True
        self.kill()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def follow(self) -> Iterator[str]:
        """The log's lines, then each new one while the process runs."""
        sent = 0
        while True:
            with self.changed:
                while sent >= len(self.lines) and not self._over():
                    self.changed.wait(0.5)
                batch, over = self.lines[sent:], self._over()
            sent += len(batch)
            yield from batch
            if over and sent >= len(self.lines):
                return

    def _over(self) -> bool:
        proc_done = self.proc is not None and self.proc.poll() is not None
        return self.ended or (proc_done and not self.model.get("restart_on_error", True))


class GpustackStandin:
    """The server, in a thread of the test process; ``with GpustackStandin(key) as gs: gs.url``."""

    def __init__(
        self,
        key: str,
        pace_s: float = 0.3,
        kill_after_requests: int | None = None,
        gateway_status: int | None = None,
        keep_deleted: bool = False,
    ) -> None:
        self.key = key
        self.pace_s = pace_s
        self.kill_after_requests = kill_after_requests
        self.gateway_status = gateway_status
        self.keep_deleted = keep_deleted
        self.backends: dict[int, dict[str, Any]] = {}
        self.models: dict[int, dict[str, Any]] = {}
        self.instances: dict[int, Instance] = {}
        self.calls: list[tuple[str, str]] = []
        self.proxied_models: list[str] = []
        self.created: list[dict[str, Any]] = []
        self.lock = threading.RLock()
        self._ids = iter(range(1, 1_000_000))
        self._proxied = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> GpustackStandin:
        threading.Thread(target=self.httpd.serve_forever, name="gpustack-standin", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for instance in list(self.instances.values()):
            instance.delete()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the /v2 resources ------------------------------------------------------------------------

    def backend_of(self, model: dict[str, Any]) -> dict[str, Any]:
        for backend in self.backends.values():
            if backend["backend_name"] == model.get("backend"):
                return backend
        raise _Error(400, f"Inference backend {model.get('backend')} not found")

    def command_for(
        self, model: dict[str, Any], port: int, gpus: list[int]
    ) -> tuple[list[str], dict[str, str]]:
        backend = self.backend_of(model)
        version = (backend.get("version_configs") or {}).get(model.get("backend_version")) or {}
        command = model.get("run_command") or version.get("run_command") or backend.get("default_run_command")
        values = {
            "model_path": model.get("local_path") or "",
            "port": port,
            "worker_ip": "127.0.0.1",
            "model_name": model["name"],
            "gpu_count": len(gpus),
            "gpu_ids": ",".join(map(str, gpus)),
        }
        rendered = _PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), command or "")
        env = {**(backend.get("default_env") or {}), **(version.get("env") or {}), **(model.get("env") or {})}
        return shlex.split(rendered), env

    def create_backend(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("backend_name") or ""
        if not name.endswith("-custom"):
            raise _Error(400, f"Custom backend name '{name}' must end with '-custom'")
        if any(b["backend_name"] == name for b in self.backends.values()):
            raise _Error(409, f"Inference backend with name '{name}' already exists.")
        ident = next(self._ids)
        self.backends[ident] = {**body, "id": ident, "backend_source": "custom", "enabled": True}
        return self.backends[ident]

    def update_backend(self, ident: int, body: dict[str, Any]) -> dict[str, Any]:
        if ident not in self.backends:
            raise _Error(404, f"Inference backend {ident} not found")
        self.backends[ident] = {**self.backends[ident], **body, "id": ident}
        return self.backends[ident]

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("cluster_id") is None:  # the real server's NOT NULL column, caught as a 500
            raise _Error(500, "Failed to create model")
        if any(m["name"] == body.get("name") for m in self.models.values()):
            raise _Error(409, f"Model with name '{body.get('name')}' already exists.")
        self.backend_of(body)
        self.created.append(dict(body))
        ident = next(self._ids)
        model = {"restart_on_error": True, **body, "id": ident, "state": "not_ready"}
        self.models[ident] = model
        for _ in range(int(body.get("replicas", 1))):
            instance = Instance(self, model, next(self._ids))
            self.instances[instance.record["id"]] = instance
            threading.Thread(target=instance.run, daemon=True).start()
        return model

    def delete_model(self, ident: int) -> None:
        if ident not in self.models:
            raise _Error(404, "Model not found")
        if self.keep_deleted:
            return  # scripted: answered, yet still listed (a stuck deletion)
        del self.models[ident]
        for key, instance in list(self.instances.items()):
            if instance.model["id"] == ident:
                del self.instances[key]
                instance.delete()

    def running_instance(self, model_name: str) -> Instance | None:
        for instance in self.instances.values():
            if instance.model["name"] == model_name and instance.record["state"] == "running":
                return instance
        return None

    def proxied(self) -> None:
        """Count one proxied request; the scripted crash after ``kill_after_requests``."""
        with self.lock:
            self._proxied += 1
            crash = self.kill_after_requests is not None and self._proxied == self.kill_after_requests
        if crash:
            for instance in list(self.instances.values()):
                threading.Thread(target=instance.kill, args=(signal.SIGKILL,), daemon=True).start()


def _handler(gs: GpustackStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # a streamed body ends when the connection closes

        def log_message(self, format: str, *args: Any) -> None:
            return None

        # -- plumbing ---------------------------------------------------------------------------

        def _send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            data: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
            return data

        def _dispatch(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            gs.calls.append((method, parts.path))
            try:
                if self.headers.get("Authorization") != f"Bearer {gs.key}":
                    raise _Error(401, "Invalid authentication credentials")
                with gs.lock:
                    routed = self._route(method, parts.path, query)
                if callable(routed):
                    routed()  # a held-open stream: outside the lock, the server goes on meanwhile
                else:
                    self._send(*routed)
            except _Error as err:
                self._send(err.status, err.body)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

        # -- routes -----------------------------------------------------------------------------

        def _route(self, method: str, path: str, query: dict[str, str]) -> Routed:
            if path.startswith("/v1/"):
                return self._openai(method, path)
            seg = path.strip("/").split("/")
            if seg[0] != "v2" or len(seg) < 2:
                raise _Error(404, "Not Found")
            key = (method, seg[1], len(seg))
            if key == ("GET", "workers", 2):
                return 200, _page([WORKER])
            if key == ("GET", "clusters", 2):  # routes/clusters.py:188
                return 200, _page([{"id": 1, "name": "default", "state": "ready"}])
            if seg[1] == "inference-backends":
                return self._backends(method, seg)
            if seg[1] == "models":
                return self._models(method, seg, query)
            if seg[1] == "model-instances":
                return self._instances(method, seg, query)
            raise _Error(404, "Not Found")

        def _backends(self, method: str, seg: list[str]) -> tuple[int, Any]:
            if method == "GET" and len(seg) == 4 and seg[2] == "backend_name":
                for backend in gs.backends.values():
                    if backend["backend_name"] == seg[3]:
                        return 200, backend
                raise _Error(400, f"Inference backend {seg[3]} not found")
            if method == "POST" and len(seg) == 2:
                return 200, gs.create_backend(self._body())
            if method == "PUT" and len(seg) == 3:
                return 200, gs.update_backend(int(seg[2]), self._body())
            raise _Error(404, "Not Found")

        def _models(self, method: str, seg: list[str], query: dict[str, str]) -> tuple[int, Any]:
            if method == "GET" and len(seg) == 2:
                search = query.get("search", "")
                return 200, _page([m for m in gs.models.values() if search in m["name"]])
            if method == "POST" and len(seg) == 2:
                return 200, gs.create_model(self._body())
            if len(seg) == 3 and method == "GET":
                model = gs.models.get(int(seg[2]))
                if model is None:
                    raise _Error(404, "Model not found")
                return 200, model
            if len(seg) == 3 and method == "DELETE":
                gs.delete_model(int(seg[2]))
                return 200, None
            raise _Error(404, "Not Found")

        def _instances(self, method: str, seg: list[str], query: dict[str, str]) -> Routed:
            if method == "GET" and len(seg) == 2:
                wanted = query.get("model_id")
                found = [i.record for i in gs.instances.values() if wanted in (None, str(i.model["id"]))]
                return 200, _page([dict(r) for r in found])
            if method == "GET" and len(seg) == 4 and seg[3] == "logs":
                instance = gs.instances.get(int(seg[2]))
                if instance is None:
                    raise _Error(404, f"Model instance {seg[2]} not found")
                return lambda: self._stream_log(instance)
            raise _Error(404, "Not Found")

        def _stream_log(self, instance: Instance) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            with contextlib.suppress(OSError):
                for line in instance.follow():
                    self.wfile.write((line + "\n").encode())
                    self.wfile.flush()

        # -- the OpenAI gateway -----------------------------------------------------------------

        def _openai(self, method: str, path: str) -> Routed:
            if method == "GET" and path == "/v1/models":
                names = [m["name"] for m in gs.models.values()]
                return 200, {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}
            if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
                raise _Error(404, "Not Found")
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            name = str(json.loads(raw or b"{}").get("model"))
            gs.proxied_models.append(name)
            if gs.gateway_status is not None:
                raise _Error(gs.gateway_status, "scripted gateway failure")
            instance = gs.running_instance(name)
            if instance is None and any(m["name"] == name for m in gs.models.values()):
                raise _Error(503, "No running instances available")  # the route is there, not servable
            if instance is None:
                raise _Error(404, "Model not found")
            port = instance.record["port"]

            def proxy() -> None:
                self._proxy(port, path, raw)
                gs.proxied()

            return proxy

        def _proxy(self, port: int, path: str, raw: bytes) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            try:
                conn.request("POST", path, raw, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    self.wfile.flush()
            finally:
                conn.close()

    return Handler
