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
#
# `up` is all or nothing: when a step fails (or `up` is interrupted), it stops what it started itself
# before it exits non-zero, so a failed `up` leaves no daemon. Each start waits at most
# K3PIPE_DOCKER_START_TIMEOUT_S (30) seconds, whether the page cache is cold or warm.
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
# the programs; tests put a wrapper here (e.g. one that is slow to exec, as on a cold page cache)
DOCKERD_BIN=${K3PIPE_DOCKERD_BIN:-dockerd}
REGISTRY_BIN=${K3PIPE_REGISTRY_BIN:-docker-registry}
START_TIMEOUT_S=${K3PIPE_DOCKER_START_TIMEOUT_S:-30}
STOP_TIMEOUT_S=20
# what this invocation of `up` started: stopped again if a later step fails
STARTED_DOCKERD=""
STARTED_REGISTRY=""

log() { echo "docker-env: $*" >&2; }

# the pid in FILE if that process is alive and runs PROGRAM, else nothing. For a pid file that may
# be stale (a pid reused by another program); not for a process we have just forked, whose exec of
# PROGRAM may not have happened yet: that one is followed by its pid (running, below).
live_pid() {
    local file=$1 program=$2 pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    running "$pid" || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$program"* ]] || return 1
    echo "$pid"
}

# whether process PID exists and has not exited (a zombie has exited)
running() {
    local state
    kill -0 "$1" 2>/dev/null || return 1
    state=$(awk '{ sub(/^.*\) /, ""); print $1 }' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}

# wait_started PID NAME WHERE LOG PROBE...: until PROBE succeeds, while process PID (just forked by
# us) runs, for at most START_TIMEOUT_S; on failure say which way it failed, with the end of LOG
wait_started() {
    local pid=$1 name=$2 where=$3 logfile=$4 deadline=$((SECONDS + START_TIMEOUT_S))
    shift 4
    until "$@" >/dev/null 2>&1; do
        if ! running "$pid"; then
            log "$name exited during start-up; end of $logfile:"
            tail -n 30 "$logfile" >&2
            return 1
        fi
        if ((SECONDS >= deadline)); then
            log "$name did not answer$where within ${START_TIMEOUT_S} s; end of $logfile:"
            tail -n 30 "$logfile" >&2
            return 1
        fi
        sleep 0.1
    done
}

# fail if something already listens on ADDR (host:port): our daemon could not bind, and a readiness
# probe would be answered by the other program
port_free() {
    local addr=$1
    if (exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}") 2>/dev/null; then
        log "$addr is already in use by another program: stop it, or set K3PIPE_REGISTRY_ADDR to a free 127.0.0.1 port"
        return 1
    fi
}

docker_cmd() { "$DOCKER" -H "unix://$SOCK" "$@"; }

# whether Debian package $1 is installed: `dpkg -s` also succeeds for a package that was removed
# but left its configuration files ('deinstall ok config-files'), whose programs are gone
installed() {
    [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) == "install ok installed" ]]
}

install_packages() {
    local missing=() p t0
    for p in docker.io docker-registry debootstrap; do
        installed "$p" || missing+=("$p")
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
    # dockerd's containerd listens on EXEC_ROOT/containerd/containerd.sock.ttrpc: past a unix socket
    # path's 108 bytes it never comes up (dockerd times out after 20 s with a gRPC dial error)
    local ttrpc=$DOCKER_DIR/exec/containerd/containerd.sock.ttrpc
    if ((${#ttrpc} > 107)); then
        log "K3PIPE_HOME ($K3PIPE_HOME) is too long for a unix socket under it ($ttrpc is ${#ttrpc} bytes, at most 107): use a shorter K3PIPE_HOME"
        return 1
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
    setsid "$DOCKERD_BIN" \
        --iptables=false --ip6tables=false --bridge=none --ip-forward=false --ip-masq=false \
        --userland-proxy=false \
        --storage-driver="${K3PIPE_DOCKER_STORAGE_DRIVER:-overlay2}" \
        --config-file "$DOCKER_DIR/daemon.json" \
        -H "unix://$SOCK" \
        --data-root "$DOCKER_DIR/data" \
        --exec-root "$DOCKER_DIR/exec" \
        --pidfile "$DOCKER_PID" \
        </dev/null >>"$DOCKER_LOG" 2>&1 &
    STARTED_DOCKERD=$!
    # `docker info` answers only once the daemon is up; its own timeout keeps each try short
    wait_started "$STARTED_DOCKERD" dockerd "" "$DOCKER_LOG" \
        timeout 5 "$DOCKER" -H "unix://$SOCK" info || return 1
    log "dockerd ready (pid $STARTED_DOCKERD) in $((($(date +%s%N) - t0) / 1000000)) ms"
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
    port_free "$REGISTRY_ADDR"
    write_registry_config
    local t0
    t0=$(date +%s%N)
    # In a non-interactive shell a background job is not a group leader, so setsid execs in place and
    # $! is the registry's pid. Until that exec has happened (milliseconds, or seconds when the binary
    # is not in the page cache) /proc/PID/comm still names the shell or setsid: the wait follows the
    # pid itself, and only the pid file's later readers (live_pid) check the program's name.
    setsid "$REGISTRY_BIN" serve "$REG_CONF" </dev/null >>"$REG_LOG" 2>&1 &
    STARTED_REGISTRY=$!
    echo "$STARTED_REGISTRY" >"$REG_PID"
    wait_started "$STARTED_REGISTRY" "the registry" " on $REGISTRY_ADDR" "$REG_LOG" \
        curl -fsS --max-time 2 -o /dev/null "http://$REGISTRY_ADDR/v2/" || return 1
    log "registry ready on $REGISTRY_ADDR (pid $STARTED_REGISTRY) in $((($(date +%s%N) - t0) / 1000000)) ms"
}

# SIGTERM the process in FILE, wait, then SIGKILL; then whatever is left of its process group (it
# was started by setsid, so the group is ours: e.g. the containerd that dockerd manages)
stop_pidfile() {
    local file=$1 program=$2 pid
    if pid=$(live_pid "$file" "$program"); then
        stop_pid "$pid" "$program"
    fi
    rm -f "$file"
}

# stop process PID (one we started, so no check of its name) and the rest of its process group
stop_pid() {
    local pid=$1 program=$2 pgid i
    running "$pid" || return 0
    pgid=$(ps -o pgid= -p "$pid" | tr -d ' ') || true
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

# After a failed or interrupted `up`: stop what this invocation started (and nothing else: a daemon
# that was already running stays), so that no daemon is left behind.
undo_up() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n $STARTED_REGISTRY || -n $STARTED_DOCKERD ]]; then
        log "up failed: stopping what it started"
        [[ -n $STARTED_REGISTRY ]] && stop_pid "$STARTED_REGISTRY" docker-registry
        [[ -n $STARTED_REGISTRY ]] && rm -f "$REG_PID"
        if [[ -n $STARTED_DOCKERD ]]; then
            stop_pid "$STARTED_DOCKERD" dockerd
            stop_pidfile "$DOCKER_DIR/exec/containerd/containerd.pid" containerd
            rm -f "$DOCKER_PID" "$SOCK"
            unmount_leftovers
        fi
    fi
    exit $((status == 0 ? 1 : status))
}

cmd_up() {
    trap undo_up EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    install_packages
    start_dockerd
    start_registry
    trap - EXIT INT TERM
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
