"""Prefect flows: composition only; the work is in k3pipe/ and tasks/.

This folder is the package ``k3pipe.flows`` (``k3pipe/flows`` links here, and the wheel installs it
so): imported by the bare name ``flows`` (a checkout's root on ``sys.path``) it would be a second copy
of every flow, so that name is refused. Prefect's deployments load ``flows/study.py`` by its path,
which imports no package."""

if __name__ != "k3pipe.flows":
    raise ImportError(
        f"{__name__!r}: the flows are the package k3pipe.flows (python -m k3pipe.flows.study, "
        "from k3pipe.flows.study import study); the bare name would load a second copy of each"
    )
