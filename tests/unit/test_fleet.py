"""The fleet's scheduler (k3pipe.fleet.dispatch) with pools that are threads here: placement, every
pool kept busy in the study's order, one launch at a time per pool, failures kept to their launch, and
a pool whose worker never comes named and routed around."""

from __future__ import annotations

import re
import threading
import time

import pytest

from k3pipe.errors import SpecError
from k3pipe.experiment import parse_experiment
from k3pipe.fleet import PoolUnavailable, Ticket, dispatch
from k3pipe.run import ArmOutcome

pytestmark = pytest.mark.unit


class Pools:
    """Runs a launch by sleeping ``seconds[arm]``; records which pool ran what, when, and the most
    launches any pool ran at once."""

    def __init__(
        self,
        seconds: dict[str, float],
        broken: frozenset[str] = frozenset(),
        dead: frozenset[str] = frozenset(),
    ):
        self.seconds = seconds
        self.broken = broken
        self.dead = dead
        self.ran: list[tuple[str, str, float]] = []
        self.busy: dict[str, int] = {}
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, pool: str, ticket: Ticket) -> ArmOutcome:
        if pool in self.dead:
            raise PoolUnavailable(f"no worker of pool {pool} started launch {ticket.label} within 0.1 s")
        with self.lock:
            self.busy[pool] = self.busy.get(pool, 0) + 1
            self.most = max(self.most, self.busy[pool])
            self.ran.append((pool, ticket.label, time.monotonic()))
        try:
            time.sleep(self.seconds[ticket.arm])
            if ticket.arm in self.broken:
                raise RuntimeError(f"engine of {ticket.arm} died")
            return ArmOutcome(
                arm=ticket.arm, mlflow_run_id=f"run-{ticket.label}", status="FINISHED", launch=ticket.launch
            )
        finally:
            with self.lock:
                self.busy[pool] -= 1


def tickets(*labels: str) -> list[Ticket]:
    return [Ticket(a, int(k), 3) for a, k in (label.split("#") for label in labels)]


def test_two_pools_share_the_launches_in_order_one_at_a_time() -> None:
    order = tickets("a#1", "b#1", "b#2", "a#2", "a#3", "b#3")
    pools = Pools({"a": 0.05, "b": 0.05})
    began = time.monotonic()
    out = dispatch(order, lambda arm: ["n1", "n2"], pools)
    wall = time.monotonic() - began
    assert [(o.arm, o.launch, o.status) for o in out] == [(t.arm, t.launch, "FINISHED") for t in order]
    assert pools.most == 1  # a pool never runs two launches at once
    assert {p for p, _, _ in pools.ran} == {"n1", "n2"}
    # taken in the study's order: each launch started no later than the one after it
    starts = {label: t for _, label, t in pools.ran}
    labels = [t.label for t in order]
    assert sorted(labels, key=starts.__getitem__) == labels
    assert wall < 6 * 0.05  # two at a time: about half the time one pool takes


def test_placement_keeps_an_arm_on_its_pools() -> None:
    order = tickets("a#1", "b#1", "a#2", "b#2")
    pools = Pools({"a": 0.02, "b": 0.02})
    dispatch(order, lambda arm: ["gpu-a"] if arm == "a" else ["gpu-a", "gpu-b"], pools)
    assert {label for p, label, _ in pools.ran if label.startswith("a")} == {"a#1", "a#2"}
    assert all(p == "gpu-a" for p, label, _ in pools.ran if label.startswith("a"))


def test_a_failed_launch_is_kept_to_itself() -> None:
    order = tickets("a#1", "b#1", "a#2", "b#2")
    out = dispatch(order, lambda arm: ["n1", "n2"], Pools({"a": 0.01, "b": 0.01}, broken=frozenset({"b"})))
    assert [o.status for o in out] == ["FINISHED", "FAILED", "FINISHED", "FAILED"]
    assert "engine of b died" in (out[1].error or "")
    assert "on pool n" in (out[1].error or "")


def test_a_pool_without_a_worker_is_named_and_routed_around() -> None:
    order = tickets("a#1", "b#1", "a#2", "b#2")
    warnings: list[str] = []
    pools = Pools({"a": 0.02, "b": 0.02}, dead=frozenset({"n2"}))
    out = dispatch(order, lambda arm: ["n1", "n2"] if arm == "a" else ["n2"], pools, warn=warnings.append)
    # a's launches all ran on n1; b may only run on n2, whose worker never came: b fails, named
    assert [(o.arm, o.status) for o in out] == [
        ("a", "FINISHED"),
        ("b", "FAILED"),
        ("a", "FINISHED"),
        ("b", "FAILED"),
    ]
    assert {p for p, _, _ in pools.ran} == {"n1"}
    assert "no worker of pool n2" in (out[1].error or "")
    assert any("pool n2" in w and "no more launches" in w for w in warnings)


def _fleet_experiment(**fleet: object) -> dict:
    return {
        "name": "f",
        "model": {"source": "local", "path": "/m"},
        "arms": [
            {
                "name": n,
                "engine": {"kind": "vllm"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": "http://127.0.0.1:9/v1"},
            }
            for n in ("a", "b")
        ],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
        "fleet": fleet,
    }


def test_the_fleet_section_is_checked() -> None:
    spec = parse_experiment(_fleet_experiment(pools=["n1", "n2"], arms={"a": ["n2"]}))
    assert spec.fleet is not None
    assert spec.fleet.pools_of("a") == ["n2"]
    assert spec.fleet.pools_of("b") == ["n1", "n2"]
    assert spec.fleet.pools_of("a-aa", baseline="a") == ["n2"]
    for fleet, says in [
        ({"pools": []}, "fleet.pools"),
        ({"pools": ["n1", "n1"]}, "repeated: n1"),
        ({"pools": ["n1"], "arms": {"a": ["n9"]}}, "fleet.arms.a names pool(s) n9"),
        ({"pools": ["n1"], "arms": {"c": ["n1"]}}, "fleet.arms names arm(s) c"),
        ({"pools": ["../n1"]}, "work pool"),
    ]:
        with pytest.raises(SpecError, match=re.escape(says)):
            parse_experiment(_fleet_experiment(**fleet))
    primed = _fleet_experiment(pools=["n1"])
    primed["decision"] = {"prime": True}
    with pytest.raises(SpecError, match=r"decision\.prime with fleet"):
        parse_experiment(primed)
