#!/usr/bin/env bash
# Build tests/docker/Dockerfile (the fake engine: fake_engine.py and the openai_wire.py it imports, both
# from the build context k3pipe/testing) with the legacy builder as
# $K3PIPE_REGISTRY/k3pipe/fake-engine:test, push it to the local registry and print its pinned
# reference (NAME@sha256:...) as the last line of stdout. Idempotent: the build is cached, and the
# push is skipped when the registry already serves this very image under the tag.
#
# Needs scripts/docker-env.sh up (DOCKER_HOST and K3PIPE_REGISTRY default to what it starts).
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
K3PIPE_HOME=${K3PIPE_HOME:-./.k3pipe}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)
export K3PIPE_HOME
export DOCKER_HOST=${DOCKER_HOST:-unix://$K3PIPE_HOME/docker/docker.sock}
REGISTRY=${K3PIPE_REGISTRY:-127.0.0.1:5055}
DOCKER=/usr/bin/docker # Debian's client, matching Debian's daemon
NAME=k3pipe/fake-engine
TAG=test
IMAGE=$REGISTRY/$NAME:$TAG
STAMP=$K3PIPE_HOME/docker/fake-engine.pushed

log() { echo "build-test-image: $*" >&2; }
ms_since() { echo $((($(date +%s%N) - $1) / 1000000)); }

# the digest the registry serves for NAME:TAG (empty if none)
registry_digest() {
    curl -fsSI \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$REGISTRY/v2/$NAME/manifests/$TAG" 2>/dev/null |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }' || true
}

if ! "$DOCKER" image inspect k3pipe/base:bookworm >/dev/null 2>&1; then
    "$REPO_DIR/scripts/build-base-image.sh" >&2
fi

t0=$(date +%s%N)
DOCKER_BUILDKIT=0 "$DOCKER" build -q -t "$IMAGE" -f "$REPO_DIR/tests/docker/Dockerfile" "$REPO_DIR/k3pipe/testing" >/dev/null
image_id=$("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE")
log "built $IMAGE ($image_id) in $(ms_since "$t0") ms"

remote=$(registry_digest)
if [[ -n $remote && -s $STAMP && $(<"$STAMP") == "$image_id $remote" ]]; then
    log "the registry already serves this image as $NAME:$TAG: push skipped"
else
    t0=$(date +%s%N)
    "$DOCKER" push "$IMAGE" >/dev/null
    remote=$(registry_digest)
    [[ -n $remote ]] || { log "the push of $IMAGE did not reach $REGISTRY"; exit 1; }
    echo "$image_id $remote" >"$STAMP"
    log "pushed $IMAGE in $(ms_since "$t0") ms"
fi
echo "$REGISTRY/$NAME@$remote"
