"""Probe a real SGLang on 127.0.0.1:30000 (key in $K3PIPE_PROBE_KEY): health timeline, auth, raw streams,
/metrics, /server_info's keys; then k3pipe's own client (if it imports) for a small workload.
Writes into OUT (argv[1]); never writes the key."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
key = os.environ["K3PIPE_PROBE_KEY"]
root = "http://127.0.0.1:30000"
auth = {"Authorization": f"Bearer {key}"}
c = httpx.Client(timeout=60, trust_env=False)
t0 = time.time()
timeline = []
last = None
ready = False
while time.time() - t0 < 480:
    try:
        s = c.get(root + "/health", timeout=5).status_code
    except httpx.HTTPError as e:
        s = type(e).__name__
    if s != last:
        timeline.append([round(time.time() - t0, 1), s])
        print("health", timeline[-1], flush=True)
        last = s
    if s == 200:
        ready = True
        break
    time.sleep(0.5)
(out / "health_timeline.json").write_text(json.dumps(timeline))
if not ready:
    print("NOT READY after", round(time.time() - t0), "s")
    sys.exit(1)
res = {"ready_s": round(time.time() - t0, 1)}
res["models_no_key"] = [c.get(root + "/v1/models").status_code, c.get(root + "/v1/models").text[:200]]
res["models"] = c.get(root + "/v1/models", headers=auth).json()
res["metrics_no_key_status"] = c.get(root + "/metrics").status_code
info = c.get(root + "/server_info", headers=auth).json()
res["server_info_keys"] = sorted(info)
res["version"] = info.get("version")
for name, path, body in [
    (
        "chat_stream",
        "/v1/chat/completions",
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "completions_stream",
        "/v1/completions",
        {
            "model": "llama",
            "prompt": "hello there",
            "max_tokens": 6,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
]:
    with c.stream("POST", root + path, json=body, headers=auth) as r:
        raw = b"".join(r.iter_raw())
    (out / f"{name}.sse").write_bytes(raw)
    res[name + "_status"] = r.status_code
(out / "metrics.txt").write_text(c.get(root + "/metrics").text)
(out / "probe.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: v for k, v in res.items() if k != "server_info_keys"})[:1500], flush=True)

# k3pipe's own client against it (the repo is the cwd; extra wheels installed into the venv)
script = r"""
import asyncio, json, os, sys
from pydantic import SecretStr
from k3pipe.bench import Prompt, summarize
from k3pipe.bench.shards import run_sharded
from k3pipe.schema.specs import WorkloadSpec
KEYS = ("completed", "failed", "output_throughput_tps", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50",
        "itl_per_token", "client_cpu_max_pct", "client_loop_lag_ms_p99")
key = SecretStr(os.environ["K3PIPE_PROBE_KEY"])
rows = []
for conc, n, procs in [(16, 64, 1), (128, 256, 1), (128, 256, 4)]:
    spec = WorkloadSpec(name=f"c{conc}", input_tokens=512, output_tokens=128, concurrency=conc,
                        num_requests=n, warmup_requests=min(conc, 16), ignore_eos=True)
    total = n + spec.warmup_requests
    prompts = [Prompt(text=("word " * 500) + str(i), tokens=501) for i in range(total)]
    url = "http://127.0.0.1:30000/v1"
    result = asyncio.run(run_sharded(url, "llama", key, spec, prompts, procs))
    m = summarize(result).metrics()
    rows.append({"concurrency": conc, "processes": procs, **{k: m.get(k) for k in KEYS}})
    print(json.dumps(rows[-1]), flush=True)
open(os.path.join(sys.argv[1], "k3pipe_client.json"), "w").write(json.dumps(rows, indent=1))
"""
venv_python = "/tmp/sgl-venv/bin/python"
proc = subprocess.run(
    [venv_python, "-c", script, str(out)],
    env={**os.environ, "PYTHONPATH": os.getcwd()},
    capture_output=True,
    text=True,
    timeout=300,
)
print("k3pipe client rc", proc.returncode)
print(proc.stdout[-3000:])
print(proc.stderr[-3000:].replace(key, "***"))
(out / "k3pipe_client.log").write_text((proc.stdout + proc.stderr).replace(key, "***"))
(out / "metrics_after_load.txt").write_text(c.get(root + "/metrics").text)
