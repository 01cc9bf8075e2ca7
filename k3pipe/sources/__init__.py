"""Model sources: fetch a model's weights (ModelScope) or find them (local) and fingerprint them."""

from __future__ import annotations

from k3pipe.sources._model import (
    ModelRecord,
    changed_files,
    content_dir_name,
    fetch_model,
    hub_files,
    model_dir,
    recorded_dir,
    verify_dir,
)

__all__ = [
    "ModelRecord",
    "changed_files",
    "content_dir_name",
    "fetch_model",
    "hub_files",
    "model_dir",
    "recorded_dir",
    "verify_dir",
]
