"""Thin Prefect tasks: each calls one k3pipe library function, logs, and returns its result.

This folder is the package ``k3pipe.tasks`` (``k3pipe/tasks`` links here, and the wheel installs it
so); the bare name ``tasks`` is refused, as ``flows`` is (flows/__init__.py says why)."""

if __name__ != "k3pipe.tasks":
    raise ImportError(
        f"{__name__!r}: the tasks are the package k3pipe.tasks (from k3pipe.tasks.steps import ...); "
        "the bare name would load a second copy of each"
    )
