"""vLLM: command line, endpoints and conventions (vllm/entrypoints/openai/cli_args.py)."""

from __future__ import annotations

from typing import ClassVar

from k3pipe.engines.base import Engine

__all__ = ["ENGINE", "VLLMEngine"]


class VLLMEngine(Engine):
    kind: ClassVar[str] = "vllm"
    default_port: ClassVar[int] = 8000
    model_flag: ClassVar[str] = "--model"
    health_path: ClassVar[str] = "/health"
    version_path: ClassVar[str | None] = "/version"
    # vLLM's api server takes --api-key or, when unset, the VLLM_API_KEY environment variable.
    api_key_env_var: ClassVar[str | None] = "VLLM_API_KEY"


ENGINE = VLLMEngine()
