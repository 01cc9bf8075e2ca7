"""Where the model comes from: ModelScope (pinned revision) or a local directory.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from k3pipe.schema.common import (
    _SAFE_NAME,
    _served,
    _Spec,
)


class ModelScopeModel(_Spec):
    """Weights downloaded from ModelScope with ``snapshot_download``."""

    source: Literal["modelscope"] = Field(description="Download from the ModelScope hub.")
    id: str = Field(description="ModelScope model id, 'owner/name', e.g. 'moonshotai/Kimi-K3'.")
    revision: str = Field(default="master", description="Branch, tag or commit to download.")
    allow_patterns: list[str] | None = Field(
        default=None, min_length=1, description="Only download files matching these glob patterns."
    )
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )

    @field_validator("id")
    @classmethod
    def _owner_name(cls, value: str) -> str:
        parts = value.split("/")
        # both parts name directories under K3PIPE_HOME/models: no '..', no spaces
        if len(parts) != 2 or not all(_SAFE_NAME.fullmatch(p) and ".." not in p for p in parts):
            raise ValueError(
                f"model id {value!r} must look like 'owner/name' (letters, digits, '-', '_', '.'), "
                "e.g. 'Qwen/Qwen2.5-0.5B-Instruct'"
            )
        return value

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        # it names a directory under K3PIPE_HOME/models/OWNER/NAME: no '..' part, no absolute path
        parts = value.split("/")
        if (
            not value
            or value.startswith("/")
            or any(p in ("", ".", "..") for p in parts)
            or any(c.isspace() for c in value)
        ):
            raise ValueError(
                f"revision {value!r} must be a branch, tag or commit (e.g. 'master' or 'v1.0'), "
                "without spaces or '..'"
            )
        return value

    @field_validator("allow_patterns")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not p.strip() for p in value):
            raise ValueError("allow_patterns holds an empty pattern; give glob patterns such as '*.json'")
        return value

    @field_validator("served_name")
    @classmethod
    def _served_name(cls, value: str | None) -> str | None:
        return _served(value)


class LocalModel(_Spec):
    """Weights already on disk (or made locally, like the tiny demo model)."""

    source: Literal["local"] = Field(description="Use a directory on this machine.")
    path: str = Field(min_length=1, description="Model directory; '{home}' expands to K3PIPE_HOME.")
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )

    @field_validator("served_name")
    @classmethod
    def _served_name(cls, value: str | None) -> str | None:
        return _served(value)


ModelSpec = Annotated[ModelScopeModel | LocalModel, Field(discriminator="source")]
