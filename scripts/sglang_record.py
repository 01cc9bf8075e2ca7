"""What a flow run on the GPU node recorded, as one JSON on stdout (no key): each run's params that
show the launch, its metrics (client, engine, log), error tags, and every file under K3PIPE_HOME
that holds the value of K3PIPE_SGL_KEY (none expected). Run by `scripts/gpu-sglang.sh flow`."""

import json
import os
from pathlib import Path

from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker

PARAMS = ("command", "api_key_env", "engine_version", "client.processes", "engine_version_declared")
METRICS = ("engine_", "completed", "failed", "output_throughput", "ttft_ms_p50", "tpot_ms_p50")
METRICS += ("itl_ms_p50", "itl_per_token", "client_", "cold_start_s")

settings = Settings()
tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
runs = []
for run in tracker.client.search_runs([tracker.require_experiment_id()]):
    runs.append(
        {
            "name": run.info.run_name,
            "status": run.info.status,
            "params": {k: v for k, v in run.data.params.items() if k in PARAMS},
            "metrics": {k: round(v, 3) for k, v in run.data.metrics.items() if k.startswith(METRICS)},
            "tags": {k: v for k, v in run.data.tags.items() if k.startswith("k3pipe.") and "error" in k},
        }
    )
key = os.environ["K3PIPE_SGL_KEY"].encode()
leaks = [str(p) for p in Path(settings.home_dir).rglob("*") if p.is_file() and key in p.read_bytes()]
print(json.dumps({"runs": runs, "key_found_in": leaks}, indent=1))
