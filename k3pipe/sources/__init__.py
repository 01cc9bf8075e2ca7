"""Model sources: fetch a model's weights (ModelScope) or find them (local) and fingerprint them."""

from __future__ import annotations

from k3pipe.sources._model import ModelRecord, fetch_model, model_dir

__all__ = ["ModelRecord", "fetch_model", "model_dir"]
