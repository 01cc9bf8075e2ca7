#!/usr/bin/env bash
# The gpustack launcher against the real GPUStack server (2.3.0 from PyPI): start it in a network
# namespace of its own with a PostgreSQL of its own, deploy a vLLM arm through the launcher, follow it,
# ask the gateway, delete it, and print what the server answered as JSON (tests/gpustack_real.py).
# Needs root (unshare -n), `make gpustack` and `make model` (make test does all three).
# Usage: scripts/gpustack-real.sh [--wait SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m tests.gpustack_real check "$@"
