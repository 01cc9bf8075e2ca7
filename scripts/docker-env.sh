#!/usr/bin/env bash
# An isolated Docker engine and image registry for the tests, on this machine only.
#
#   scripts/docker-env.sh up     install Debian's docker.io/docker-registry/debootstrap if missing, start
#                                dockerd and the registry (idempotent), wait until both answer
#   scripts/docker-env.sh down   remove containers labelled k3pipe.managed=true, stop both
#   scripts/docker-env.sh env    print the exports a client needs (eval "$(scripts/docker-env.sh env)")
#
# Isolation: dockerd runs with --iptables=false --bridge=none --ip-forward=false (no docker0 bridge,
# no NAT rules); containers use host networking and bind to 127.0.0.1. Its socket, data, exec root,
# pid file and log live under $K3PIPE_HOME/docker; the registry (distribution v2) listens on
# 127.0.0.1:5055 (not 5000, which other tools use) and stores under $K3PIPE_HOME/registry.
set -euo pipefail

K3PIPE_HOME=${K3PIPE_HOME:-./.k3pipe}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)

REGISTRY_ADDR=${K3PIPE_REGISTRY_ADDR:-127.0.0.1:5055}
DOCKER_DIR=$K3PIPE_HOME/docker
SOCK=$DOCKER_DIR/docker.sock
DOCKER_PID=$DOCKER_DIR/dockerd.pid
DOCKER_LOG=$DOCKER_DIR/dockerd.log
REG_DIR=$K3PIPE_HOME/registry
REG_CONF=$REG_DIR/config.yml
REG_PID=$REG_DIR/registry.pid
REG_LOG=$REG_DIR/registry.log
# Debian's client matches Debian's daemon (API 1.41); another `docker` may come first on PATH.
DOCKER=/usr/bin/docker
START_TIMEOUT_S=30
STOP_TIMEOUT_S=20

log() { echo "docker-env: $*" >&2; }

# the pid in FILE if that process is alive and runs PROGRAM, else nothing
live_pid() {
    local file=$1 program=$2 pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$program"* ]] || return 1
    echo "$pid"
}

docker_cmd() { "$DOCKER" -H "unix://$SOCK" "$@"; }

install_packages() {
    local missing=() p t0
    for p in docker.io docker-registry debootstrap; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    t0=$SECONDS
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    # policy-rc.d / no systemd: the packages' own services are not started, and we never start them
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    log "installed ${missing[*]} in $((SECONDS - t0)) s"
}

start_dockerd() {
    if live_pid "$DOCKER_PID" dockerd >/dev/null; then
        log "dockerd already running (pid $(<"$DOCKER_PID"))"
        return 0
    fi
    rm -f "$DOCKER_PID" "$SOCK"
    mkdir -p "$DOCKER_DIR/data" "$DOCKER_DIR/exec"
    # our own (empty) daemon config, so that no /etc/docker/daemon.json is read
    [[ -f $DOCKER_DIR/daemon.json ]] || echo '{}' >"$DOCKER_DIR/daemon.json"
    local t0
    t0=$(date +%s%N)
    # setsid: its own session and process group, so no terminal signal reaches it and `down` can end
    # the group; the containerd it starts (its own session) is stopped by dockerd or, failing that,
    # by `down` through containerd's pid file
    setsid dockerd \
        --iptables=false --ip6tables=false --bridge=none --ip-forward=false --ip-masq=false \
        --userland-proxy=false \
        --storage-driver="${K3PIPE_DOCKER_STORAGE_DRIVER:-overlay2}" \
        --config-file "$DOCKER_DIR/daemon.json" \
        -H "unix://$SOCK" \
        --data-root "$DOCKER_DIR/data" \
        --exec-root "$DOCKER_DIR/exec" \
        --pidfile "$DOCKER_PID" \
        </dev/null >>"$DOCKER_LOG" 2>&1 &
    local launched=$!
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until docker_cmd info >/dev/null 2>&1; do
        if ! kill -0 "$launched" 2>/dev/null || ((SECONDS > deadline)); then
            log "dockerd did not start within ${START_TIMEOUT_S} s; end of $DOCKER_LOG:"
            tail -n 30 "$DOCKER_LOG" >&2
            kill -TERM "$launched" 2>/dev/null || true
            return 1
        fi
        sleep 0.1
    done
    log "dockerd ready (pid $(<"$DOCKER_PID")) in $((($(date +%s%N) - t0) / 1000000)) ms"
}

write_registry_config() {
    mkdir -p "$REG_DIR/storage"
    local secret_file=$REG_DIR/http-secret
    [[ -s $secret_file ]] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret_file"
    cat >"$REG_CONF" <<EOF
# written by scripts/docker-env.sh: a local, unauthenticated registry for tests
version: 0.1
log:
  level: info
  fields:
    service: k3pipe-registry
storage:
  filesystem:
    rootdirectory: $REG_DIR/storage
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
http:
  addr: $REGISTRY_ADDR
  secret: $(<"$secret_file")
  headers:
    X-Content-Type-Options: [nosniff]
EOF
}

start_registry() {
    if live_pid "$REG_PID" docker-registry >/dev/null; then
        log "registry already running (pid $(<"$REG_PID"))"
        return 0
    fi
    rm -f "$REG_PID"
    write_registry_config
    local t0
    t0=$(date +%s%N)
    # in a non-interactive shell a background job is not a group leader: setsid execs in place
    setsid docker-registry serve "$REG_CONF" </dev/null >>"$REG_LOG" 2>&1 &
    echo $! >"$REG_PID"
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until curl -fsS -o /dev/null "http://$REGISTRY_ADDR/v2/" 2>/dev/null; do
        if ! live_pid "$REG_PID" docker-registry >/dev/null || ((SECONDS > deadline)); then
            log "registry did not start within ${START_TIMEOUT_S} s; end of $REG_LOG:"
            tail -n 30 "$REG_LOG" >&2
            stop_pidfile "$REG_PID" docker-registry
            return 1
        fi
        sleep 0.1
    done
    log "registry ready on $REGISTRY_ADDR (pid $(<"$REG_PID")) in $((($(date +%s%N) - t0) / 1000000)) ms"
}

# SIGTERM the process in FILE, wait, then SIGKILL; then whatever is left of its process group (it
# was started by setsid, so the group is ours: e.g. the containerd that dockerd manages)
stop_pidfile() {
    local file=$1 program=$2 pid pgid i
    if ! pid=$(live_pid "$file" "$program"); then
        rm -f "$file"
        return 0
    fi
    pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
    log "stopping $program (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT_S * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$program did not stop in ${STOP_TIMEOUT_S} s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    if [[ $pgid == "$pid" ]] && kill -0 -- "-$pgid" 2>/dev/null; then
        log "ending the rest of process group $pgid"
        kill -TERM -- "-$pgid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            kill -0 -- "-$pgid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
    rm -f "$file"
}

# dockerd leaves mounts under its roots after a clean stop (e.g. exec/netns/default); without this,
# `make clean` could not remove $K3PIPE_HOME. Only ever once no dockerd of ours is alive.
unmount_leftovers() {
    live_pid "$DOCKER_PID" dockerd >/dev/null && return 0
    local target
    awk -v root="$DOCKER_DIR/" 'index($5, root) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
        while read -r target; do
            umount "$target" 2>/dev/null || umount -l "$target" 2>/dev/null || log "could not unmount $target"
        done
}

cmd_up() {
    install_packages
    start_dockerd
    start_registry
}

cmd_down() {
    if live_pid "$DOCKER_PID" dockerd >/dev/null && docker_cmd info >/dev/null 2>&1; then
        local ids
        ids=$(docker_cmd ps -aq --filter label=k3pipe.managed=true)
        if [[ -n $ids ]]; then
            log "removing containers: $(echo $ids)"
            # shellcheck disable=SC2086
            docker_cmd rm -f $ids >/dev/null
        fi
    fi
    stop_pidfile "$REG_PID" docker-registry
    stop_pidfile "$DOCKER_PID" dockerd
    # dockerd ends the containerd it manages; if dockerd had to be killed, containerd is left over
    stop_pidfile "$DOCKER_DIR/exec/containerd/containerd.pid" containerd
    rm -f "$SOCK"
    unmount_leftovers
}

cmd_env() {
    echo "export DOCKER_HOST=unix://$SOCK; export K3PIPE_REGISTRY=$REGISTRY_ADDR"
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    env) cmd_env ;;
    *)
        echo "usage: $0 up|down|env" >&2
        exit 2
        ;;
esac
