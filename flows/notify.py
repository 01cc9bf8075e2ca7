"""The notify flow: what a retest's regression becomes (k3pipe.jobs.alerts). prefect.yaml's ``notify``
deployment is triggered by the ``k3pipe.regression.detected`` event a retest flow emits; the flow
reads the regression from the retest's MLflow run, publishes it as a Prefect artifact and, where a
Webhook block named ``k3pipe-regression`` exists, posts it there (Slack, a pager, a local receiver).
"""

from __future__ import annotations

from typing import Any, cast

from prefect.artifacts import create_markdown_artifact
from prefect.blocks.webhook import Webhook
from prefect.exceptions import ObjectNotFound
from prefect.utilities.asyncutils import run_coro_as_sync

from k3pipe.core.errors import K3pipeError
from k3pipe.core.layout import REGRESSION_FILE
from k3pipe.core.layout import RETEST_RESOURCE_PREFIX as RESOURCE_PREFIX
from k3pipe.flows.runtime import flow_job
from k3pipe.flows.secrecy import guard, scrubbed_flow

__all__ = ["WEBHOOK_BLOCK", "notify"]

WEBHOOK_BLOCK = "k3pipe-regression"
"""The Webhook block a regression is posted to, when it exists (`prefect block create webhook`, or
``Webhook(url=..., method="POST").save("k3pipe-regression")``)."""


@scrubbed_flow("notify")
def notify(retest: str) -> dict[str, Any]:
    """Tell of a retest's regression: a Prefect artifact, and a post to the Webhook block
    'k3pipe-regression' where it exists.

    Args:
        retest: The retest's MLflow run id (or the event's resource id, k3pipe.retest.<run id>).
    """
    guard()
    job = flow_job()
    run_id = retest.removeprefix(RESOURCE_PREFIX)
    raw = job.tracker.read_artifact(run_id, REGRESSION_FILE)
    if raw is None:
        raise K3pipeError(f"retest run {run_id} has no {REGRESSION_FILE}: nothing to tell")
    import json

    regression: dict[str, Any] = json.loads(raw)
    lines = [f"# Regression in {regression['experiment']}", "", regression["summary"], ""]
    lines += [
        f"- {w['arm']} / {w['workload']}: {w['metric']} {w['change']}{_since(w)}" for w in regression["worse"]
    ]
    lines += [  # the output probe: answers that moved are a regression of their own (k3pipe.jobs.alerts)
        f"- {a['arm']}: answers moved since retest {a['against_run_id'][:12]} ({a['against']}): "
        f"{a['verdict']}"
        for a in regression.get("answers", [])
    ]
    lines += ["", "Versions (the history's last retest -> this retest):"]
    lines += [f"- {arm}: {v['good']} -> {v['bad']}" for arm, v in regression["versions"].items()]
    lines += ["", f"MLflow: {job.tracker.run_link(run_id)}"]
    create_markdown_artifact(
        "\n".join(lines), key="k3pipe-regression", description=regression["summary"][:500]
    )
    try:
        hook = cast(Webhook, Webhook.load(WEBHOOK_BLOCK))  # sync here: Block.load is sync-compatible
    except (ObjectNotFound, ValueError):
        job.say("regression published as an artifact; no Webhook block %r to post it to", WEBHOOK_BLOCK)
        return regression
    answer = run_coro_as_sync(hook.call(payload={"text": "\n".join(lines), "regression": regression}))
    job.say(
        "regression posted to Webhook block %r: HTTP %s", WEBHOOK_BLOCK, getattr(answer, "status_code", "?")
    )
    return regression


def _since(worse: dict[str, Any]) -> str:
    """Since which retest, against how many (a regression.json of the series rule; older ones lack it)."""
    if "segment" not in worse:
        return ""
    ago = (
        "tonight"
        if worse["segment"] == 1
        else f"since retest {worse['since_run_id'][:12]} ({worse['since']})"
    )
    return (
        f", {ago}, against the geometric mean of {worse['history']} earlier retest(s) "
        f"({worse['history_first']} .. {worse['history_last']})"
    )
