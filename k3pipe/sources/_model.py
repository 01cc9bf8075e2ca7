"""Model weights: download them from ModelScope (or find them on disk) and fingerprint every file.

A model is recorded as a :class:`ModelRecord`: where it lives, each file's sha256 computed from the
bytes on disk, and whether this call had to fetch anything. ``digest()`` folds the file hashes into
one fingerprint, so two runs can tell whether they served the very same weights.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core.errors import ModelSourceError
from k3pipe.schema.specs import LocalModel, ModelScopeModel, expand_home

__all__ = [
    "ModelRecord",
    "changed_files",
    "content_dir_name",
    "fetch_model",
    "hub_files",
    "model_dir",
    "recorded_dir",
    "verify_dir",
]

Progress = Callable[[str], None]

_BLOCK = 8 * 1024 * 1024
# Files this large get a progress message every tenth of the way, not only at the end.
_CHATTY_BYTES = 100 * 1024 * 1024
# What modelscope-hub leaves beside a file while fetching it (modelscope_hub/_download.py:
# ``_incomplete_path``, ``_parallel_download``): ``X.incomplete``, ``X.parallel_tmp``, ``X_START_END``.
_PARTIAL_SUFFIXES = (".incomplete", ".parallel_tmp")


class ModelRecord(BaseModel):
    """What was fetched or found: the model directory and the sha256 of each of its files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["modelscope", "local"] = Field(description="Where the weights came from.")
    model_id: str | None = Field(description="ModelScope id 'owner/name'; None for a local directory.")
    requested_revision: str | None = Field(description="Revision the spec asked for (None when local).")
    resolved_revision: str | None = Field(
        description="Revision the hub served the file listing for (None when local)."
    )
    path: str = Field(description="Absolute path of the model directory.")
    files: dict[str, str] = Field(description="Relative POSIX path -> sha256 hex of the bytes on disk.")
    file_revisions: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "ModelScope: relative path -> the commit that last changed the file, as the hub's listing "
            "gives it (empty when local, or where the listing names none)."
        ),
    )
    total_bytes: int = Field(ge=0, description="Sum of the sizes of the recorded files.")
    downloaded: bool = Field(description="Whether this call fetched any file from the hub.")
    duration_s: float = Field(ge=0, description="Wall time of the fetch or scan, hashing included.")

    def digest(self) -> str:
        """One sha256 over the sorted (path, sha256) pairs: the fingerprint of the whole model."""
        h = hashlib.sha256()
        for rel, sha in sorted(self.files.items()):
            h.update(f"{rel}\0{sha}\n".encode())
        return h.hexdigest()


CONTENT_PREFIX = "sha256:"


def content_dir_name(digest: str) -> str:
    """The directory a ModelScope model's files are kept in: named by their content, so that two
    revisions (a branch before and after it moved) live side by side."""
    return f"sha256-{digest[:16]}"


def _model_root(spec: ModelScopeModel, home: Path) -> Path:
    owner, name = spec.id.split("/")
    return home / "models" / owner / name


def model_dir(spec: ModelScopeModel | LocalModel, home: Path) -> Path:
    """Where the model lives: a local spec's path ('{home}' expanded); for a ModelScope model
    ``home/models/OWNER/NAME/REVISION``, a link to the content directory (``sha256-<digest>``) that
    revision was last fetched as (resolved here), or the path itself before any fetch."""
    if isinstance(spec, LocalModel):
        return Path(expand_home(spec.path, home)).expanduser().resolve()
    return (_model_root(spec, home) / spec.revision).resolve()


def recorded_dir(record: ModelRecord, home: Path) -> Path | None:
    """The content directory a recorded ModelScope fetch is kept in on this machine (None: a local
    model, or a record made before models were kept by content)."""
    revision = record.resolved_revision or ""
    if record.source != "modelscope" or not record.model_id or not revision.startswith(CONTENT_PREFIX):
        return None
    owner, name = record.model_id.split("/")
    return home / "models" / owner / name / content_dir_name(revision.removeprefix(CONTENT_PREFIX))


def hub_files(spec: ModelScopeModel) -> dict[str, str]:
    """The files the hub lists for ``spec`` now (allow_patterns applied): path -> sha256 ('' where the
    hub gives none). Nothing is downloaded. Raises :class:`ModelSourceError` as :func:`fetch_model`."""
    _, wanted = _listing(spec, lambda _msg: None)
    return {p: (f.sha256 or "").lower() for p, f in wanted.items()}


def verify_dir(root: Path, files: Mapping[str, str]) -> list[str]:
    """What differs between ``root`` and ``files`` (path -> sha256): the paths missing or changed."""
    bad = []
    for rel, sha in sorted(files.items()):
        path = root / rel
        if not path.is_file() or _hash_file(path)[0] != sha:
            bad.append(rel)
    return bad


def changed_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """What moved between two fingerprints (path -> sha256), file by file, as phrases."""
    changed = sorted(f for f in before if f in after and before[f] != after[f])
    removed = sorted(f for f in before if f not in after)
    added = sorted(f for f in after if f not in before)
    out = []
    for what, names in (("changed", changed), ("removed", removed), ("added", added)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            out.append(f"{what}: {shown}")
    return out


def fetch_model(
    spec: ModelScopeModel | LocalModel, home: Path, progress: Progress | None = None
) -> ModelRecord:
    """Make the model's files present and verified in :func:`model_dir`, and record them.

    ModelScope: list the files at the revision, keep those that already match the hub's sha256,
    download only the others with ``modelscope.snapshot_download`` (so a second call fetches
    nothing), then hash every file. Local: check the directory and hash every file.

    ``progress`` receives short messages (listing, each file verified or downloaded). During a
    download it is called from the client's worker threads, so it must be thread-safe.

    Raises :class:`ModelSourceError` when the model is unknown, the hub cannot be reached, a file
    keeps failing its hash check, or the local directory is missing or is not a model.
    """
    say: Progress = progress or (lambda _msg: None)
    if isinstance(spec, LocalModel):
        return _scan_local(spec, home, say)
    return _fetch_modelscope(spec, home, say)


# -- local --------------------------------------------------------------------------------------


def _scan_local(spec: LocalModel, home: Path, say: Progress) -> ModelRecord:
    start = time.perf_counter()
    root = model_dir(spec, home)
    # retryable=False: a directory that is not there does not appear by waiting (the flow's fetch
    # task retries a download, not this)
    if not root.is_dir():
        raise ModelSourceError(
            f"model.path {spec.path!r}: directory {root} does not exist; set model.path to a model "
            "directory ('{home}' expands to K3PIPE_HOME) or make the model there first",
            retryable=False,
        )
    if not (root / "config.json").is_file():
        raise ModelSourceError(
            f"model.path {spec.path!r}: {root} has no config.json, so it is not a model directory "
            "(save_pretrained writes one); point model.path at the directory that holds it",
            retryable=False,
        )
    files: dict[str, str] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache, ...
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            say(f"hashing {rel}")
            files[rel], size = _hash_file(path)
            total += size
    return ModelRecord(
        source="local",
        model_id=None,
        requested_revision=None,
        resolved_revision=None,
        path=str(root),
        files=files,
        total_bytes=total,
        downloaded=False,
        duration_s=time.perf_counter() - start,
    )


# -- ModelScope ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Listed:
    """One entry of the hub's file listing, as its JSON names it (``Path``, ``Type``, ``Size``,
    ``Sha256``, ``Revision``: the commit that last changed the file, which the real client reads as
    a file's cache key, modelscope/hub/utils/caching.py, and modelscope_hub's FileInfo drops)."""

    path: str
    type: str
    size: int
    sha256: str | None
    revision: str | None

    @classmethod
    def of(cls, item: Mapping[str, Any]) -> _Listed:
        return cls(
            path=str(item.get("Path") or item.get("path") or item.get("Name") or ""),
            type=str(item.get("Type") or item.get("type") or "blob"),
            size=int(item.get("Size") or item.get("size") or 0),
            sha256=item.get("Sha256") or item.get("sha256") or None,
            revision=item.get("Revision") or item.get("revision") or None,
        )


def _listing(spec: ModelScopeModel, say: Progress) -> tuple[str, dict[str, _Listed]]:
    """The endpoint and the files of ``spec`` the hub lists (allow_patterns applied)."""
    from modelscope_hub import HubApi, get_default_config
    from modelscope_hub.errors import HubError, NotExistError

    where = f"ModelScope model {spec.id!r} at revision {spec.revision!r}"
    # The client reads MODELSCOPE_ENDPOINT itself; ask it which endpoint it will use.
    endpoint = get_default_config().endpoint or "?"
    try:
        endpoint = HubApi().resolve_endpoint_for_read(spec.id, repo_type="model")
        say(f"listing {spec.id}@{spec.revision} on {endpoint}")
        # the listing as the hub sent it (HubApi.list_repo_files keeps no file's revision); the same
        # call, truncation handling included (modelscope_hub/_legacy_api.py: list_repo_files)
        raw = HubApi(endpoint=endpoint).legacy.list_repo_files(
            repo_id=spec.id, repo_type="model", revision=spec.revision, recursive=True
        )
        listing = [_Listed.of(item) for item in raw]
    except NotExistError as exc:
        raise ModelSourceError(
            f"{where} was not found on {endpoint} ({_headline(exc)}); check model.id (owner/name, as on the "
            "hub's page) and model.revision, or set MODELSCOPE_ENDPOINT to the hub that has it"
        ) from exc
    except (HubError, OSError) as exc:  # OSError covers requests' own exceptions
        raise ModelSourceError(
            f"could not list {where} on {endpoint}: {_headline(exc)}; check the network or proxy and "
            "MODELSCOPE_ENDPOINT, then run again"
        ) from exc

    blobs = {f.path: f for f in listing if f.type != "tree" and f.path}
    if not blobs:
        # The hub can answer an unknown model or revision with HTTP 200 and a body whose Code is
        # not 200; the client reads that as an empty listing (modelscope_hub/_legacy_api.py:
        # _list_files_page) and would "download" nothing without complaint.
        raise ModelSourceError(
            f"{where}: {endpoint} lists no files; the model or revision probably does not exist "
            "there. Check model.id and model.revision (a branch, tag or commit)"
        )
    patterns = _normalize(spec.allow_patterns)
    wanted = {p: f for p, f in sorted(blobs.items()) if patterns is None or _matches(p, patterns)}
    if not wanted:
        shown = ", ".join(sorted(blobs)[:20]) + (" ..." if len(blobs) > 20 else "")
        raise ModelSourceError(
            f"{where}: model.allow_patterns {spec.allow_patterns} match none of its {len(blobs)} "
            f"files ({shown}); fix the patterns or remove them"
        )
    return endpoint, wanted


def _fetch_modelscope(spec: ModelScopeModel, home: Path, say: Progress) -> ModelRecord:
    # Imported here: the hub client is heavy and only this path needs it.
    from modelscope import snapshot_download
    from modelscope_hub.errors import FileDownloadError

    start = time.perf_counter()
    where = f"ModelScope model {spec.id!r} at revision {spec.revision!r}"
    endpoint, wanted = _listing(spec, say)
    expected = {p: (f.sha256 or "").lower() for p, f in wanted.items()}
    revisions = {p: f.revision for p, f in sorted(wanted.items()) if f.revision}
    root = _model_root(spec, home)
    pointer = root / spec.revision
    if all(expected.values()):
        # kept by content: a branch that moved is fetched beside what it was, never over it
        target = root / content_dir_name(_digest(expected))
    else:
        # the hub left some file's sha256 out: the content is known only once fetched, so the files
        # go where the revision points (a real directory, as before models were kept by content)
        target = pointer
        if pointer.is_symlink():
            pointer.unlink()
    _say_moved(pointer, target, expected, say)
    target.mkdir(parents=True, exist_ok=True)

    hashes: dict[str, str] = {}
    need: list[str] = []
    for rel, info in wanted.items():
        path = target / rel
        if path.is_file() and (not info.size or path.stat().st_size == info.size):
            sha, _ = _hash_file(path)
            if not expected[rel] or sha == expected[rel]:
                hashes[rel] = sha
                say(f"verified {rel}")
                continue
            say(f"{rel}: local copy differs from the hub, fetching it again")
        if expected[rel] and _link_from_sibling(root, target, rel, info.size, expected[rel]):
            hashes[rel] = expected[rel]
            say(f"verified {rel} (the same file as in another revision's directory, linked)")
            continue
        need.append(rel)

    if need:
        nbytes = sum(wanted[p].size for p in need)
        say(f"downloading {len(need)} of {len(wanted)} files ({_human(nbytes)}) to {target}")
        try:
            snapshot_download(
                spec.id,
                revision=spec.revision,
                local_dir=str(target),
                cache_dir=str(home / "modelscope-cache"),
                # Only what is missing: the client would otherwise re-hash every verified file.
                allow_patterns=_exact_patterns(need) or spec.allow_patterns,
                endpoint=endpoint,
                progress_callbacks=[_progress_callback(say)],
            )
        except FileDownloadError as exc:
            _discard_partials(target, exc.failed_files)
            message = _failed_files_message(where, endpoint, exc.failed_files, expected)
            raise ModelSourceError(message) from exc
        except Exception as exc:  # the client also raises requests' HTTPError and OSError
            _discard_partials(target, need)
            raise ModelSourceError(
                f"downloading {where} from {endpoint} failed: {_headline(exc)}; check the network and "
                "MODELSCOPE_ENDPOINT, then run again (verified files are kept)"
            ) from exc
        for rel in need:
            try:
                sha, _ = _hash_file(target / rel)
            except OSError as exc:
                raise ModelSourceError(
                    f"{where}: {rel} is missing after the download ({exc}); the listing on "
                    f"{endpoint} may have changed meanwhile, run again"
                ) from exc
            if expected[rel] and sha != expected[rel]:
                (target / rel).unlink(missing_ok=True)
                raise ModelSourceError(
                    f"{where}: {rel} has sha256 {sha} on disk but {endpoint} lists {expected[rel]}; "
                    "the file was removed, run again"
                )
            hashes[rel] = sha
            say(f"downloaded {rel}")

    total = sum((target / rel).stat().st_size for rel in hashes)
    files = dict(sorted(hashes.items()))
    if target != pointer:
        _manifest(target).write_text(json.dumps(files, indent=1))
        _point(pointer, target, say)
    return ModelRecord(
        source="modelscope",
        model_id=spec.id,
        requested_revision=spec.revision,
        # modelscope 1.40.2 resolves no revision: snapshot_download hands it verbatim to
        # DownloadManager.download_repo (modelscope_hub/_download.py, ``revision or "master"``),
        # which lists and fetches with ``Revision=<it>`` and calls no revisions endpoint. So what
        # was fetched is named by its content: the digest of every file's sha256, never a branch;
        # each file's own commit, as the listing gives it, beside
        resolved_revision=CONTENT_PREFIX + _digest(files),
        path=str(target.resolve()),
        files=files,
        file_revisions={p: r for p, r in revisions.items() if p in files},
        total_bytes=total,
        downloaded=bool(need),
        duration_s=time.perf_counter() - start,
    )


def _digest(files: Mapping[str, str]) -> str:
    """:meth:`ModelRecord.digest` of path -> sha256 pairs."""
    h = hashlib.sha256()
    for rel, sha in sorted(files.items()):
        h.update(f"{rel}\0{sha}\n".encode())
    return h.hexdigest()


def _manifest(content: Path) -> Path:
    """Beside a content directory: its files and their sha256 (not inside it: it is the model)."""
    return content.with_name(f"{content.name}.files.json")


def _say_moved(pointer: Path, target: Path, expected: Mapping[str, str], say: Progress) -> None:
    """Say so, file by file, when the revision pointed elsewhere before: it moved on the hub."""
    if not pointer.is_symlink():
        return
    before = pointer.resolve()
    if before == target.resolve():
        return
    try:
        old = json.loads(_manifest(before).read_text())
    except (OSError, ValueError):
        old = None
    what = "; ".join(changed_files(old, expected)) if isinstance(old, dict) else "its files differ"
    say(
        f"{pointer.name} has moved since it was last fetched ({before.name} -> {target.name}; {what}): "
        f"fetching it into {target} beside {before}, which is kept"
    )


def _point(pointer: Path, target: Path, say: Progress) -> None:
    """Make ``pointer`` (ROOT/REVISION) a link to ``target``, atomically; a real directory there (a
    home from before models were kept by content) is moved aside, not deleted."""
    if pointer.exists() and not pointer.is_symlink():
        aside = pointer.with_name(f"{pointer.name}.before-content-dirs")
        pointer.rename(aside)
        say(f"{pointer} was a directory of its own; moved to {aside} (its files are linked where equal)")
    link = pointer.with_name(f".{pointer.name}.link-{os.getpid()}")
    link.unlink(missing_ok=True)
    link.symlink_to(target.name)
    os.replace(link, pointer)


def _link_from_sibling(root: Path, target: Path, rel: str, size: int, sha: str) -> bool:
    """Hard-link ``rel`` into ``target`` from another directory of the same model holding the same
    bytes (another revision's content directory, or a directory of before content directories), so a
    moved branch fetches only what changed; copied where a link cannot be made."""
    if not root.is_dir():
        return False
    for sibling in sorted(root.iterdir()):
        if sibling.is_symlink() or not sibling.is_dir() or sibling.resolve() == target.resolve():
            continue
        source = sibling / rel
        if not source.is_file() or (size and source.stat().st_size != size) or _hash_file(source)[0] != sha:
            continue
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(source, dest)
        except OSError:
            shutil.copy2(source, dest)
        return True
    return False


def _normalize(patterns: list[str] | None) -> list[str] | None:
    # The client splits comma-separated patterns (modelscope_hub/utils/patterns.py).
    from modelscope_hub.utils.patterns import normalize_patterns

    return normalize_patterns(patterns)


def _matches(path: str, patterns: list[str]) -> bool:
    """Mirror of ``_matches_patterns`` in modelscope_hub/_download.py, so both select the same files."""
    return any(
        fnmatch.fnmatch(path, p) or (".*" in p and fnmatch.fnmatch(path, p.replace(".*", "*")))
        for p in patterns
    )


def _exact_patterns(paths: list[str]) -> list[str] | None:
    """Glob patterns that select exactly ``paths``; None when a path cannot be written as one."""
    # Commas split patterns and '.*' is read as a regex by the client.
    if any("," in p or ".*" in p or "\\" in p for p in paths):
        return None
    return [glob.escape(p) for p in paths]


def _progress_callback(say: Progress) -> type:
    from modelscope_hub import ProgressCallback

    class _Report(ProgressCallback):
        """Per-file callback the client instantiates with (filename, file_size)."""

        def __init__(self, filename: str, file_size: int) -> None:
            super().__init__(filename, file_size)
            self.received = 0
            self.next_mark = file_size // 10 if file_size >= _CHATTY_BYTES else None

        def update(self, size: int) -> None:
            self.received += size
            if self.next_mark is not None and self.received >= self.next_mark:
                say(f"{self.filename}: {_human(self.received)} of {_human(self.file_size)}")
                self.next_mark += self.file_size // 10

        def end(self) -> None:
            # also called when an attempt fails: say what arrived, not that it succeeded
            say(f"{self.filename}: transfer ended, {_human(self.received)} received")

    return _Report


def _failed_files_message(
    where: str, endpoint: str, failed: Mapping[str, BaseException], expected: Mapping[str, str]
) -> str:
    from modelscope_hub.errors import FileIntegrityError, FileSizeMismatchError

    lines = [f"downloading {where} from {endpoint} failed for {len(failed)} file(s):"]
    for rel, exc in sorted(failed.items()):
        text = _headline(exc)
        if isinstance(exc, FileIntegrityError) and not isinstance(exc, FileSizeMismatchError):
            # The client deletes the bad bytes and keeps only a prefix of their hash in the message.
            got = re.search(r"got ([0-9a-f]+)", text)
            actual = f"{got[1]}... (prefix reported by the client)" if got else "unknown"
            lines.append(
                f"  {rel}: sha256 mismatch after the client's retries: expected "
                f"{expected.get(rel) or '?'}, got {actual}"
            )
        else:
            lines.append(f"  {rel}: {text}")
    lines.append(
        "The failed files were removed (no partial or corrupt copy is kept); files that verified "
        "are kept, so running again fetches only the failed ones. If a hash keeps failing, the hub "
        "serves bytes that differ from its listing: report it to the model's owner."
    )
    return "\n".join(lines)


def _discard_partials(root: Path, paths: Mapping[str, object] | list[str]) -> None:
    """Remove what the client may leave of these files: the file itself and its partial copies."""
    for rel in paths:
        target = root / rel
        target.unlink(missing_ok=True)
        for suffix in _PARTIAL_SUFFIXES:
            target.with_name(target.name + suffix).unlink(missing_ok=True)
        parts = re.compile(re.escape(target.name) + r"_\d+_\d+")
        if target.parent.is_dir():
            for part in target.parent.iterdir():
                if parts.fullmatch(part.name):
                    part.unlink(missing_ok=True)


def _headline(exc: BaseException) -> str:
    # modelscope-hub errors append the request and response on further lines (see __cause__)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while block := fh.read(_BLOCK):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
