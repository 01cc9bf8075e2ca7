"""Engine modules, one per engine kind. Adding an engine means adding a module here that defines
``ENGINE``, an instance of :class:`k3pipe.engines.base.Engine`."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from k3pipe.core.errors import SpecError
from k3pipe.engines.base import Engine, RenderedCommand, render_args

__all__ = ["Engine", "RenderedCommand", "engine_kinds", "get_engine", "render_args"]


@cache
def _registry() -> dict[str, Engine]:
    found: dict[str, Engine] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        engine = getattr(module, "ENGINE", None)
        if isinstance(engine, Engine):
            found[engine.kind] = engine
    return dict(sorted(found.items()))


def engine_kinds() -> list[str]:
    """The registered engine kinds."""
    return list(_registry())


def get_engine(kind: str) -> Engine:
    """The engine module for ``kind``."""
    try:
        return _registry()[kind]
    except KeyError:
        raise SpecError(
            f"engine kind {kind!r} is not registered; available: {', '.join(engine_kinds())}"
        ) from None
