"""A stand-in engine for the process launcher: the scripted OpenAI server (k3pipe/testing/scripted_openai.py)
started the way k3pipe starts vLLM (``--model DIR [--served-model-name N] --host H --port P`` and the
arm's own flags), as its own process, for tests that need a real launch without the real engine.

It behaves as vLLM does where the tests look:

- the key: ``/v1`` requests need ``Authorization: Bearer $VLLM_API_KEY`` (the variable k3pipe passes
  the endpoint's key through); ``--api-key`` is accepted and reported, not enforced;
- its log: like vLLM's "non-default args", it prints its arguments as it got them, and the values of
  the variables ``SCRIPTED_ENGINE_ECHO`` names (comma-separated), raw: what an engine prints about
  itself, which k3pipe must keep out of every record. It also prints the sha256 of each, so that a
  test can prove what the engine received without the value being written anywhere;
- ``SCRIPTED_ENGINE_FAIL_AFTER=N``: the chat requests after the first N answer 500 with an error
  body that echoes the request's Authorization header (a gateway that echoes its headers);
- ``SCRIPTED_ENGINE_INTER_TOKEN_S=S``: S seconds between token chunks (default none: a TPOT of 0);
- ``SCRIPTED_ENGINE_TOOLS=good,bad-json,...``: chat requests that offer tools are answered with these
  behaviours in turn (k3pipe/testing/scripted_tools.py: good and broken tool calls as vLLM spells them).

Run as ``python k3pipe/testing/scripted_engine.py ...``; SIGTERM ends it (k3pipe stops its process group).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import threading
from pathlib import Path

# run as a script, from any directory: the repo root on sys.path, so that k3pipe imports as in pytest
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3pipe.testing.scripted_openai import Received, Script, ScriptedOpenAI
from k3pipe.testing.scripted_tools import ToolScript


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key")
    args, rest = parser.parse_known_args()
    if args.host != "127.0.0.1":
        sys.exit(f"scripted engine: binds 127.0.0.1 only, got --host {args.host}")
    print(f"non-default args: {vars(args)} {rest}", flush=True)
    if args.api_key:
        print(f"scripted engine: --api-key sha256={_sha(args.api_key)}", flush=True)
    for name in filter(None, os.environ.get("SCRIPTED_ENGINE_ECHO", "").split(",")):
        value = os.environ.get(name, "")
        print(f"scripted engine: environment {name}={value} sha256={_sha(value)}", flush=True)

    fail_after = int(os.environ.get("SCRIPTED_ENGINE_FAIL_AFTER", "-1"))
    inter_token_s = float(os.environ.get("SCRIPTED_ENGINE_INTER_TOKEN_S", "0"))

    def script(received: Received) -> Script:
        if 0 <= fail_after <= received.index:
            return Script(status=500, echo_auth_in_error=True)
        return Script(inter_token_s=inter_token_s)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    model = args.served_model_name or "scripted"
    behaviours = [b for b in os.environ.get("SCRIPTED_ENGINE_TOOLS", "").split(",") if b]
    tools = ToolScript(behaviours) if behaviours else None
    key = os.environ.get("VLLM_API_KEY")
    with ScriptedOpenAI(script, api_key=key, model=model, port=args.port, tools=tools):
        print(f"scripted engine: serving {model!r} on 127.0.0.1:{args.port}", flush=True)
        stop.wait()
    print("scripted engine: stopped", flush=True)


if __name__ == "__main__":
    main()
