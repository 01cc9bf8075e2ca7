"""The run record: what an arm's run was made of, as one value that MLflow stores and a rerun reads.

An arm's MLflow run holds ``run_record.json`` (a :class:`RunRecord`) and, beside it, every prompt it
sent (``prompts/<workload>/r<repeat>.json``, each a :class:`~k3pipe.prompts.corpora.PromptSet`). The
record names every input a rerun needs and how to verify it: the experiment as it was resolved
(restricted to nothing: all arms and workloads, so the file it came from is not needed), the model
files with their sha256, the image digest, the engine version, the rendered command (secrets
redacted), each prompt set's digest, the seeds, and k3pipe's commit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core.layout import prompts_path
from k3pipe.prompts.corpora import PromptSet
from k3pipe.sources import ModelRecord
from k3pipe.sources.images import ImageRecord

__all__ = ["KeptWorkloads", "PromptsRef", "RunRecord", "prompts_artifact", "prompts_digest"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class KeptWorkloads:
    """The workloads a launch that did not finish had finished cleanly (in the experiment's order),
    kept by a resume instead of measured again, and that launch's earlier arm run (k3pipe.jobs.resume)."""

    arm_run_id: str
    workloads: dict[str, str]
    """Workload name -> its run (under ``arm_run_id`` until the resume moves it); a ladder's name ->
    its points' runs, lowest first, comma-separated."""
    ladders: dict[str, str] = field(default_factory=dict)
    """A kept ladder's name -> how it went (its ``k3pipe.ladder.NAME`` summary)."""


def prompts_artifact(workload: str, repeat: int) -> str:
    """Where a repeat's prompts live in the arm's run (``repeat`` counts from 0)."""
    return prompts_path(workload, repeat)


def prompts_digest(prompts: PromptSet) -> str:
    """sha256 over the prompts as sent (text and token count of each, in order): full length, so that
    a rerun can verify the stored file, not only the 16-digit dataset digest."""
    h = hashlib.sha256()
    for p in prompts.prompts:
        h.update(json.dumps(p.model_dump(mode="json"), sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


class PromptsRef(BaseModel):
    """One repeat's prompts: where they are stored in the arm's run and how to verify them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    repeat: int = Field(ge=0, description="Counted from 0.")
    seed: int | None = Field(description="The seed the prompts were drawn with (the profile's).")
    dataset: str = Field(description="The prompt set's name (its MLflow dataset name).")
    dataset_digest: str = Field(description="The prompt set's 16-digit digest (its MLflow dataset digest).")
    sha256: str = Field(description="prompts_digest() of the prompts as sent.")
    count: int = Field(ge=0)
    artifact: str = Field(description="Artifact path in the arm's run.")


class RunRecord(BaseModel):
    """An arm's run as a value: everything a rerun needs, each input with what verifies it."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    experiment_name: str
    experiment_file: str = Field(description="The file it was loaded from (informative: not needed).")
    experiment: dict[str, Any] = Field(description="The experiment as parsed (ExperimentSpec, JSON mode).")
    arm: str
    models: dict[str, ModelRecord] = Field(description="'model' and each extra model, files hashed.")
    image: ImageRecord | None = Field(default=None, description="The image as pinned (docker arms).")
    engine_version: str | None = Field(default=None, description="What the engine reported.")
    command: str = Field(description="The rendered command line (secrets redacted).")
    env: dict[str, str] = Field(default_factory=dict, description="The engine's env (secrets redacted).")
    prompts: list[PromptsRef] = Field(default_factory=list)
    unpinned_models: list[str] = Field(
        default_factory=list,
        description="Models the engine loaded itself ('engine.args.PATH=VALUE'): neither pinned nor hashed.",
    )
    k3pipe_commit: str
    rerun_of: str | None = Field(default=None, description="The run this one reran, if any.")
    drift: list[str] = Field(
        default_factory=list, description="Inputs that differed from the rerun's original (--allow-drift)."
    )

    def prompts_of(self, workload: str, repeat: int) -> PromptsRef | None:
        return next((p for p in self.prompts if p.workload == workload and p.repeat == repeat), None)
