"""Launchers: where an engine runs (start, logs, alive, stop).

The kinds' specs (data) are :mod:`k3pipe.schema.launcher_specs`; each kind's implementation is the module
named after it (``process``, ``docker``, ``external``, ``gpustack``), loaded when an arm of that kind
needs it, so that rendering a process arm never imports the Docker SDK. This registry answers what
a kind does with an arm's plan: build its launcher, the command line a human could paste, the
read-write mounts.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3pipe.launchers.base import Launcher
    from k3pipe.planning.plan import ArmPlan

__all__ = ["build_launcher", "equivalent_command", "implementation", "writable_mounts"]


def implementation(kind: str) -> ModuleType:
    """The module that implements launcher ``kind`` (``k3pipe.launchers.<kind>``): it defines
    ``build(spec, plan, ...)`` and may define ``equivalent_command`` and ``writable_mounts``."""
    return importlib.import_module(f"{__name__}.{kind}")


def build_launcher(
    plan: ArmPlan,
    log_path: Path,
    env: Mapping[str, str],
    base_env: Mapping[str, str],
    image: str | None,
    labels: Mapping[str, str],
    home: Path | None = None,
) -> Launcher:
    """The launcher for ``plan`` (not started). ``env``: the engine's own variables; ``base_env``:
    this machine's environment for a local process; ``image``: the pinned image (a kind that
    pins_image); ``home``: K3PIPE_HOME (where a process group is registered)."""
    build = implementation(plan.launch.kind).build
    return build(plan.launch, plan, log_path, env, base_env, image, labels, home)  # type: ignore[no-any-return]


def equivalent_command(plan: ArmPlan, image: str | None = None) -> str | None:
    """The start as one command line a human could paste (secrets redacted), where it differs from
    the plan's argv (a container's ``docker run``, a process pinned to CPUs); None otherwise."""
    render = getattr(implementation(plan.launch.kind), "equivalent_command", None)
    return render(plan.launch, plan, image) if render is not None else None


def writable_mounts(plan: ArmPlan) -> dict[str, str]:
    """Host directory -> engine path, mounted read-write (the compile cache of a container)."""
    mounts = getattr(implementation(plan.launch.kind), "writable_mounts", None)
    return dict(mounts(plan.launch, plan)) if mounts is not None else {}
