"""A scripted stand-in for the ModelScope hub's file API, served on 127.0.0.1.

The real hub cannot be reached from this machine, so tests point ``MODELSCOPE_ENDPOINT`` at this
server and let the real ``modelscope`` client talk to it. It speaks only what
``modelscope.snapshot_download`` (modelscope 1.40.2, which delegates to modelscope-hub 0.5.1) calls.
Paths, query parameters and JSON shapes are taken from that source:

- ``modelscope/hub/snapshot_download.py`` -> ``modelscope_hub/compat/snapshot_download.py``
  -> ``HubApi.download_repo`` (``modelscope_hub/api.py``) -> ``DownloadManager.download_repo``
  (``modelscope_hub/_download.py``).
- ``GET /api/v1/models/{owner}/{name}/repo/files?Revision=R&Recursive=True[&Root=DIR]``:
  ``LegacyClient._list_files_page`` (``modelscope_hub/_legacy_api.py``), which reads
  ``{"Code": 200, "Data": {"Files": [{"Name", "Path", "Type": "blob"|"tree", "Size", "Sha256",
  "Revision"}]}}`` (``Revision``: the file's last commit, which the real client keys its cache on,
  ``modelscope/hub/utils/caching.py``).
  A listing is cut by the real server at 3000 entries (``REPO_FILES_TRUNCATION_LIMIT``); this one
  never is.
- ``GET /api/v1/repos/internalAccelerationInfo``: ``DownloadManager._detect_region_uncached``, only
  when a file has to be fetched and ``MODELSCOPE_DOWNLOAD_INTRA_CLOUD`` is not false. Answered 404,
  which the client reads as "no intra-cloud region".
- ``GET /api/v1/models/{owner}/{name}/repo?Revision=R&FilePath=P``: ``LegacyClient.download_stream``
  / ``get_download_url``; raw bytes. ``DownloadManager._download_with_resume`` resumes with
  ``Range: bytes=N-`` and expects ``206`` with ``Content-Range``, or ``416`` with
  ``Content-Range: bytes */SIZE``; ``_probe_redirect_url`` sends ``HEAD`` (only with inter-cloud
  regions configured). Both are supported.
- Errors go through ``raise_for_status`` (``modelscope_hub/errors.py``): HTTP 404 -> ``NotExistError``;
  an HTTP 200 body without ``Data`` (the hub's ``Code != 200`` style) reads as an empty listing.

The client calls no revisions endpoint (``/api/v1/models/{id}/revisions``) and no model-info
endpoint on this path, so neither is served: any other route answers 404 and is logged like the
rest, so a test can assert that none was asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["FakeHub", "HubRequest", "client_pointed_at_fake_hub"]

_FILES = re.compile(r"^/api/v1/models/([^/]+)/([^/]+)/repo/files$")
_FILE = re.compile(r"^/api/v1/models/([^/]+)/([^/]+)/repo$")
_ACCEL = "/api/v1/repos/internalAccelerationInfo"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
# The hub's business code for "model does not exist" (any value other than 200 will do here).
_NOT_FOUND_CODE = 10010205001


@dataclass
class HubRequest:
    """One request the fake hub received."""

    method: str
    path: str
    query: dict[str, str]
    status: int
    headers: dict[str, str]


class FakeHub:
    """Serve ``models`` = ``{model_id: {revision: {path: bytes}}}`` over the hub's file API.

    Use as a context manager (``with FakeHub(models) as hub: ... hub.url``); the server always stops
    on exit. ``requests`` logs every request; ``corrupt()`` makes a file's bytes differ from the
    Sha256 the listing gives for it (``corrupted.discard`` repairs it).
    """

    def __init__(self, models: dict[str, dict[str, dict[str, bytes]]] | None = None) -> None:
        self.models: dict[str, dict[str, dict[str, bytes]]] = models if models is not None else {}
        self.requests: list[HubRequest] = []
        # model ids answered like the hub's "Code != 200" error: HTTP 200 with no Data
        self.code_errors: set[str] = set()
        # (model_id, path) pairs served with bytes that differ from the listed Sha256
        self.corrupted: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- scripting ---------------------------------------------------------------------------
    def corrupt(self, model_id: str, path: str) -> None:
        """Serve different bytes (same length) for ``path`` than the listing's Sha256 describes."""
        self.corrupted.add((model_id, path))

    def served_bytes(self, model_id: str, revision: str, path: str) -> bytes:
        """The bytes a GET of that file returns (corrupted ones if ``corrupt()`` was called)."""
        data = self.models[model_id][revision][path]
        if (model_id, path) in self.corrupted:
            return bytes(b ^ 0xFF for b in data) if data else b"x"
        return data

    def file_gets(self, path: str | None = None) -> list[HubRequest]:
        """Logged GETs of the per-file download route (of one file when ``path`` is given)."""
        return [
            r
            for r in self.snapshot()
            if r.method == "GET" and _FILE.match(r.path) and (path is None or r.query.get("FilePath") == path)
        ]

    def snapshot(self) -> list[HubRequest]:
        """A copy of the request log (the server appends from its own threads)."""
        with self._lock:
            return list(self.requests)

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT`` (what MODELSCOPE_ENDPOINT is set to)."""
        if self._server is None:
            raise RuntimeError("FakeHub is not running: use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fakehub", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    # -- routes ------------------------------------------------------------------------------
    def _listing(
        self, model_id: str, revision: str, recursive: bool, root: str | None
    ) -> list[dict[str, Any]]:
        files = self.models[model_id][revision]
        entries: dict[str, dict[str, Any]] = {}
        prefix = f"{root.strip('/')}/" if root else ""
        for path, data in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :].split("/")
            if not recursive and len(rest) > 1:
                tree = prefix + rest[0]
                entries[tree] = _tree(rest[0], tree)
                continue
            # the real listing also names every directory as a "tree" entry, which the client skips
            for depth in range(1, len(rest)):
                tree = prefix + "/".join(rest[:depth])
                entries[tree] = _tree(rest[depth - 1], tree)
            entries[path] = {
                "Name": rest[-1],
                "Path": path,
                "Type": "blob",
                "Size": len(data),
                "Sha256": hashlib.sha256(data).hexdigest(),
                # the commit that last changed the file: here a function of the file's bytes, so that
                # a file changed on a moved branch gets a new one and the others keep theirs
                "Revision": hashlib.sha1(f"{model_id}\0{path}\0".encode() + data).hexdigest(),
            }
        return list(entries.values())


def _tree(name: str, path: str) -> dict[str, Any]:
    return {"Name": name, "Path": path, "Type": "tree", "Size": 0, "Sha256": ""}


def _not_found(what: str) -> dict[str, Any]:
    return {"Code": _NOT_FOUND_CODE, "Message": f"{what} not found", "Success": False, "RequestId": "fake"}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    server_version = "FakeModelScopeHub/1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep pytest output clean; every request is in FakeHub.requests instead

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _route(self, *, head: bool) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        query = dict(parse_qsl(split.query, keep_blank_values=True))
        # logged before it is answered, so a client that has its answer finds its request in the log;
        # send_response fills in the status before the client can read it
        headers = {k.lower(): v for k, v in self.headers.items()}
        self._logged = HubRequest(self.command, path, query, 0, headers)
        with self.fake._lock:
            self.fake.requests.append(self._logged)
        self._answer(path, query, head=head)

    def send_response(self, code: int, message: str | None = None) -> None:
        with self.fake._lock:
            self._logged.status = code
        super().send_response(code, message)

    def _answer(self, path: str, query: dict[str, str], *, head: bool) -> int:
        fake = self.fake
        if path == _ACCEL:
            return self._json(404, _not_found("region info"), head=head)
        if m := _FILES.match(path):
            model_id = f"{m[1]}/{m[2]}"
            revision = query.get("Revision", "master")
            if model_id in fake.code_errors:
                return self._json(200, _not_found(f"model {model_id}"), head=head)
            if revision not in fake.models.get(model_id, {}):
                return self._json(404, _not_found(f"model {model_id}@{revision}"), head=head)
            recursive = query.get("Recursive", "False").lower() == "true"
            files = fake._listing(model_id, revision, recursive, query.get("Root"))
            body = {"Code": 200, "Data": {"Files": files}, "Message": "success", "Success": True}
            return self._json(200, body, head=head)
        if m := _FILE.match(path):
            model_id = f"{m[1]}/{m[2]}"
            revision = query.get("Revision", "master")
            file_path = query.get("FilePath", "")
            if file_path not in fake.models.get(model_id, {}).get(revision, {}):
                return self._json(404, _not_found(f"file {file_path}"), head=head)
            return self._bytes(fake.served_bytes(model_id, revision, file_path), head=head)
        return self._json(404, _not_found(f"route {path}"), head=head)

    def _json(self, status: int, body: dict[str, Any], *, head: bool) -> int:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)
        return status

    def _bytes(self, data: bytes, *, head: bool) -> int:
        total = len(data)
        status, start, end = 200, 0, total - 1
        wanted = self.headers.get("Range")
        if wanted:
            m = _RANGE.match(wanted.strip())
            if m is None or int(m[1]) >= total:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return 416
            start = int(m[1])
            end = min(int(m[2]), total - 1) if m[2] else total - 1
            status = 206
        body = data[start : end + 1]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        self.end_headers()
        if not head:
            self.wfile.write(body)
        return status


@contextmanager
def client_pointed_at_fake_hub(
    models: dict[str, dict[str, dict[str, bytes]]], monkeypatch: Any, tmp_path: Path
) -> Iterator[FakeHub]:
    """Run a fake hub serving ``models`` and point the real modelscope client at it."""
    from modelscope_hub.config import set_default_config

    with FakeHub(models) as fake:
        monkeypatch.setenv("MODELSCOPE_ENDPOINT", fake.url)
        monkeypatch.setenv("MODELSCOPE_DOWNLOAD_INTRA_CLOUD", "false")
        monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
        monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))  # token + session files
        monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
        monkeypatch.delenv("MODELSCOPE_DOMAIN", raising=False)
        # modelscope-hub builds its config from the environment once per process and caches it
        # (modelscope_hub/config.py: get_default_config); drop it so this endpoint is read.
        set_default_config(None)
        try:
            yield fake
        finally:
            set_default_config(None)
