"""Container images: pull through the Docker SDK with progress, pin to the registry digest.

A run launches ``repo@sha256:...``, never a tag, so a tag that moves cannot change a rerun. The
digest comes from the image's ``RepoDigests`` (what the registry served), and is what MLflow records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import docker
import docker.errors
from docker.auth import resolve_repository_name
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core.errors import ImageError

__all__ = ["ImageRecord", "resolve_image", "split_reference"]

Progress = Callable[[str], None]


class ImageRecord(BaseModel):
    """What an image reference resolved to."""

    model_config = ConfigDict(frozen=True)

    reference: str = Field(description="The reference as the spec gave it.")
    registry: str = Field(description="Registry host the image comes from.")
    repository: str = Field(description="Repository, registry included when not Docker Hub.")
    digest: str = Field(description="Manifest digest, 'sha256:...'.")
    pinned: str = Field(description="'repository@digest': what the container is created from.")
    image_id: str = Field(description="Local image id (config digest).")
    pulled: bool = Field(description="Whether this call pulled (False: the digest was present).")
    duration_s: float = Field(description="Time spent resolving and pulling.")


def split_reference(reference: str) -> tuple[str, str, str | None, str | None]:
    """'reg:5000/a/b:tag' -> (registry, repository, tag, digest); Docker Hub images -> 'docker.io'."""
    repo, tag_or_digest = parse_repository_tag(reference)
    registry, _ = resolve_repository_name(repo)
    if tag_or_digest and tag_or_digest.startswith("sha256:"):
        return registry, repo, None, tag_or_digest
    return registry, repo, tag_or_digest or "latest", None


def _repo_digest(attrs: dict[str, Any], repo: str) -> str | None:
    for entry in attrs.get("RepoDigests") or []:
        name, _, digest = str(entry).partition("@")
        if name == repo or name == f"docker.io/{repo}" or f"docker.io/library/{name}" == repo:
            return digest
    return None


def _local(client: docker.DockerClient, ref: str) -> Any | None:
    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


def _pull(client: docker.DockerClient, repo: str, tag: str, progress: Progress | None) -> None:
    """Pull, reporting layer progress at most every 2 s; errors in the stream raise."""
    layers: dict[str, tuple[int, int]] = {}
    last = 0.0
    for event in client.api.pull(repo, tag=tag, stream=True, decode=True):
        if "error" in event:
            raise docker.errors.APIError(str(event.get("error")))
        layer = event.get("id")
        detail = event.get("progressDetail") or {}
        if layer and detail.get("total"):
            layers[layer] = (int(detail.get("current") or 0), int(detail["total"]))
        elif layer and event.get("status") in ("Download complete", "Pull complete", "Already exists"):
            done = layers.get(layer, (0, 0))
            layers[layer] = (done[1], done[1])
        now = time.monotonic()
        if progress and layers and now - last >= 2:
            current = sum(c for c, _ in layers.values())
            total = sum(t for _, t in layers.values())
            progress(
                f"pulling {repo}:{tag}: {current / 1e6:.1f}/{total / 1e6:.1f} MB in {len(layers)} layers"
            )
            last = now
        if progress and str(event.get("status", "")).startswith(("Digest:", "Status:")):
            progress(f"{repo}:{tag}: {event['status']}")


def resolve_image(
    client: docker.DockerClient,
    reference: str,
    pull: Literal["if-missing", "always", "never"] = "if-missing",
    progress: Progress | None = None,
    attempts: int = 3,
    backoff_s: float = 2.0,
) -> ImageRecord:
    """Make ``reference`` present locally and pin it to its registry digest.

    ``if-missing`` pulls only when the reference (a tag, or a digest) is not present with a
    registry digest; ``always`` pulls every time (a moved tag is then picked up, and recorded);
    ``never`` fails when it is absent. Pulls are retried ``attempts`` times with growing back-off.
    """
    t0 = time.perf_counter()
    registry, repo, tag, digest = split_reference(reference)
    pulled = False
    image = _local(client, reference)
    have_digest = image is not None and _repo_digest(image.attrs, repo) is not None
    if pull == "always" or not have_digest:
        if pull == "never":
            raise ImageError(
                f"image {reference!r} is not present on this Docker host and launcher.pull is 'never'; "
                f"pull it from {registry} or set launcher.pull to 'if-missing'"
            )
        last_error: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                _pull(client, repo, digest or tag or "latest", progress)
                last_error = None
                break
            except (docker.errors.APIError, docker.errors.DockerException, OSError) as exc:
                last_error = exc
                if progress:
                    progress(f"pull of {reference} failed (attempt {attempt}/{attempts}): {exc}")
                if attempt < attempts:
                    time.sleep(backoff_s * attempt)
        if last_error is not None:
            raise ImageError(
                f"could not pull image {reference!r} from registry {registry} after {attempts} attempts: "
                f"{last_error}; check the image name and tag, that the registry is reachable from this "
                "Docker host, and its credentials (docker login)"
            ) from last_error
        pulled = True
        image = _local(client, reference)
    if image is None:
        raise ImageError(f"image {reference!r} is still not present after pulling from {registry}")
    found = _repo_digest(image.attrs, repo)
    if found is None:
        raise ImageError(
            f"image {reference!r} has no registry digest (RepoDigests is empty): it was built or "
            f"loaded locally, not pulled from {registry}; push it to a registry and use that reference"
        )
    if (
        digest
        and found != digest
        and digest not in [str(e).partition("@")[2] for e in image.attrs.get("RepoDigests") or []]
    ):
        raise ImageError(f"image {reference!r} resolved to {found}, not the digest it names")
    pinned_digest = digest or found
    return ImageRecord(
        reference=reference,
        registry=registry,
        repository=repo,
        digest=pinned_digest,
        pinned=f"{repo}@{pinned_digest}",
        image_id=str(image.id),
        pulled=pulled,
        duration_s=time.perf_counter() - t0,
    )
