#!/usr/bin/env bash
# SGLang 0.5.16 on the air-gapped GPU node, for real (docs/gpu.md, "SGLang for real"). One device call
# per subcommand, at the repo root, the bundles' parts carried under .gpu/sgl (SGLang) and .gpu/sglp
# (k3pipe's pipeline), one part of at most 56 MiB a call:
#   stage          copy the carried SGLang bundle files into /tmp/sgl-stage (the node keeps them while warm)
#   install        its install.sh into /tmp/sgl-venv (the node's torch 2.11 seen through system site
#                  packages), then the small wheels of .gpu/sgl/extra that k3pipe's client imports
#   model          the random-weight 1B Llama (scripts/make_random_llama.py) into /tmp/sgl-model
#   serve [ARGS]   SGLang on 127.0.0.1:30000 with a made-up key, probed by scripts/sglang_probe.py into
#                  $OUT (health timeline, 401, raw streams, /metrics, k3pipe's client), then stopped
#   pipe-stage     copy the carried pipeline bundle files into /tmp/sglp-stage
#   pipe-install   its install.sh into /tmp/k3-venv
#   flow           `k3pipe run experiments/sglang-h200.yaml` (key in K3PIPE_SGL_KEY, made up), then
#                  scripts/sglang_record.py: what MLflow holds, and whether the key is anywhere
set -uo pipefail
STAGE=/tmp/sgl-stage
VENV=/tmp/sgl-venv
MODEL=/tmp/sgl-model
cmd=$1; shift || true
case "$cmd" in
stage)
    mkdir -p "$STAGE"
    for f in .gpu/sgl/*; do [ -f "$f" ] && cp -f "$f" "$STAGE/"; done
    [ -d .gpu/sgl/extra ] && mkdir -p "$STAGE/extra" && cp -f .gpu/sgl/extra/* "$STAGE/extra/"
    ls -la "$STAGE" | tail -n +2 | awk '{print $5, $9}'
    df -h /tmp | tail -1
    ;;
install)
    t0=$(date +%s)
    bash "$STAGE/install.sh" --layout one --venv "$VENV" --python python3 --skip-target-check 2>&1 | tail -40
    echo "install rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
    for w in "$STAGE"/extra/*.whl; do
        name=$(basename "$w" | cut -d- -f1 | tr _ -)
        "$VENV/bin/python" -m pip show -q "$name" >/dev/null 2>&1 || "$VENV/bin/python" -m pip install -q --no-index --no-deps "$w"
    done
    "$VENV/bin/python" -c "import sglang, sgl_kernel, flashinfer, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tail -5
    ;;
model)
    python3 scripts/make_random_llama.py "$MODEL" --preset 1b 2>&1 | tail -5
    ;;
serve)
    out=${OUT:-/tmp/sgl-out}; mkdir -p "$out"
    key="sgl-node-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    export K3PIPE_PROBE_KEY="$key"
    setsid "$VENV/bin/python" -m sglang.launch_server --model-path "$MODEL" --served-model-name llama \
        --host 127.0.0.1 --port 30000 --api-key "$key" --enable-metrics --mem-fraction-static 0.5 \
        "$@" > /tmp/sgl-server.log 2>&1 &
    pid=$!
    python3 scripts/sglang_probe.py "$out" 2>&1 | tail -60
    kill -TERM -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null
    sed "s/$key/***/g" /tmp/sgl-server.log > "$out/server.log"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
    grep -c "$key" "$out"/* | grep -v ':0$' || echo "key in no file of OUT"
    ;;
pipe-stage)
    mkdir -p /tmp/sglp-stage
    for f in .gpu/sglp/*; do [ -f "$f" ] && cp -f "$f" /tmp/sglp-stage/; done
    ls /tmp/sglp-stage
    ;;
pipe-install)
    bash /tmp/sglp-stage/install.sh --layout one --venv /tmp/k3-venv --python python3 --skip-target-check 2>&1 | tail -8
    /tmp/k3-venv/bin/k3pipe --help > /dev/null && echo "k3pipe ok"
    ;;
flow)
    out=${OUT:-/tmp/sgl-out}; mkdir -p "$out"
    export K3PIPE_HOME=/tmp/k3home-sgl K3PIPE_SGL_KEY="sgl-flow-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    export PREFECT_SERVER_ANALYTICS_ENABLED=false
    t0=$(date +%s)
    timeout 480 /tmp/k3-venv/bin/k3pipe run experiments/sglang-h200.yaml > "$out/k3pipe-run.txt" 2>&1
    echo "k3pipe run rc=$? in $(( $(date +%s) - t0 )) s"
    tail -40 "$out/k3pipe-run.txt"
    /tmp/k3-venv/bin/python scripts/sglang_record.py > "$out/record.json" 2>&1; tail -c 3000 "$out/record.json"
    cp "$(ls -t $K3PIPE_HOME/logs/sglang-h200-sglang-*.log | head -1)" "$out/engine.log" 2>/dev/null
    grep -c "$K3PIPE_SGL_KEY" "$out"/* | grep -v ':0$' || echo "key in no file of OUT"
    ;;
esac
