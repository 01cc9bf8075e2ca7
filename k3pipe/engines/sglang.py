"""SGLang: command line, endpoints and conventions (python/sglang/srt/server_args.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from k3pipe.engines.base import Engine

__all__ = ["ENGINE", "SGLangEngine"]


class SGLangEngine(Engine):
    kind: ClassVar[str] = "sglang"
    default_port: ClassVar[int] = 30000
    model_flag: ClassVar[str] = "--model-path"
    health_path: ClassVar[str] = "/health"
    version_path: ClassVar[str | None] = "/get_server_info"
    api_key_env_var: ClassVar[str | None] = None  # SGLang takes --api-key only

    def version_from(self, payload: Any) -> str | None:
        if isinstance(payload, dict):
            version = payload.get("version")
            if isinstance(version, str):
                return version
        return None


ENGINE = SGLangEngine()
