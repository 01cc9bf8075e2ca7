#!/usr/bin/env bash
# Build the base image k3pipe/base:bookworm (Debian bookworm minbase + python3 with its stdlib) locally:
# there is no Docker Hub here. debootstrap downloads from the Debian mirror this machine's apt already
# uses (read from /etc/apt/sources.list{,.d/*}; override with K3PIPE_DEBIAN_MIRROR), the rootfs is
# kept as a tarball in $K3PIPE_HOME/docker/ (a rebuild imports it without downloading again), and
# `docker import` turns it into the image. Skips everything if the image exists.
#
# Needs the engine from scripts/docker-env.sh up (DOCKER_HOST defaults to its socket).
set -euo pipefail

K3PIPE_HOME=${K3PIPE_HOME:-./.k3pipe}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)
DOCKER_DIR=$K3PIPE_HOME/docker
export DOCKER_HOST=${DOCKER_HOST:-unix://$DOCKER_DIR/docker.sock}
DOCKER=/usr/bin/docker # Debian's client, matching Debian's daemon

IMAGE=k3pipe/base:bookworm
SUITE=bookworm
ROOTFS=$DOCKER_DIR/rootfs
TARBALL=$DOCKER_DIR/base-$SUITE-rootfs.tar
# python3-minimal alone lacks http.server, json and socketserver: they are in libpython3.X-stdlib
PACKAGES=python3-minimal,libpython3-stdlib,ca-certificates

log() { echo "build-base-image: $*" >&2; }

if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE exists: nothing to do"
    exit 0
fi

# The first Debian archive URI that serves $SUITE/main (not the security archive), in either the
# one-line (.list) or the deb822 (.sources) format.
apt_mirror() {
    local f
    shopt -s nullglob
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        awk -v suite="$SUITE" '
            $1 == "deb" {
                i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                uri = $i; s = $(i + 1)
                if (s == suite && uri !~ /security/) { for (j = i + 2; j <= NF; j++) if ($j == "main") { print uri; exit } }
            }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        awk -v suite="$SUITE" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && (" " comps " ") ~ / main / && uris !~ /security/) {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                types = uris = suites = comps = ""
            }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            tolower($1) == "types:" { $1 = ""; types = $0 }
            tolower($1) == "uris:" { $1 = ""; uris = $0 }
            tolower($1) == "suites:" { $1 = ""; suites = $0 }
            tolower($1) == "components:" { $1 = ""; comps = $0 }
            END { if (!found) flush() }' "$f"
    done
}

t_start=$(date +%s)
if [[ ! -s $TARBALL ]]; then
    MIRROR=${K3PIPE_DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}
    if [[ -z $MIRROR ]]; then
        log "no Debian $SUITE mirror found in /etc/apt/sources.list{,.d/*}; set K3PIPE_DEBIAN_MIRROR"
        exit 1
    fi
    command -v debootstrap >/dev/null || { log "debootstrap is missing: run scripts/docker-env.sh up"; exit 1; }
    log "debootstrap --variant=minbase $SUITE from $MIRROR into $ROOTFS"
    rm -rf "$ROOTFS"
    mkdir -p "$ROOTFS"
    t0=$(date +%s)
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" \
        >"$DOCKER_DIR/debootstrap.log" 2>&1 || {
        log "debootstrap failed; end of $DOCKER_DIR/debootstrap.log:"
        tail -n 20 "$DOCKER_DIR/debootstrap.log" >&2
        exit 1
    }
    log "debootstrap took $(($(date +%s) - t0)) s"
    chroot "$ROOTFS" python3 -c 'import http.server, json, socketserver, threading, signal; print("python3 ok")' >&2
    # no downloaded .debs or apt lists in the image
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/debootstrap
    tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$ROOTFS"
    log "rootfs tarball: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
else
    log "using the cached rootfs tarball $TARBALL"
fi

t0=$(date +%s)
"$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$IMAGE" >/dev/null
log "docker import took $(($(date +%s) - t0)) s; $IMAGE built in $(($(date +%s) - t_start)) s"
"$DOCKER" run --rm --network host "$IMAGE" python3 -c 'import http.server, json, socketserver, threading; print("base image: python3 ok")'
