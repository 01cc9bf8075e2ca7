"""The fleet's scheduler (k3pipe.jobs.fleet.dispatch) with pools that are threads here: placement, every
pool kept busy in the study's order, one launch at a time per pool, failures kept to their launch, and
a pool whose worker never comes named and routed around; a busy pool (its worker alive, running
another flow run) passed over and waited for, a lost one (no live worker) given up, each by its own
limit and named as what it is."""

from __future__ import annotations

import re
import threading
import time

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.arm_run import ArmOutcome
from k3pipe.jobs.fleet import PoolState, PoolUnavailable, Ticket, Waits, dispatch

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


class Probe:
    """A pool's state as its server would tell it: ``busy[pool]`` (or ``lost[pool]``) until that many
    seconds after the first question, free after."""

    def __init__(self, busy: dict[str, float] | None = None, lost: dict[str, float] | None = None) -> None:
        self.busy, self.lost = busy or {}, lost or {}
        self.t0: float | None = None

    def __call__(self, pool: str) -> PoolState:
        self.t0 = self.t0 or time.monotonic()
        spent = time.monotonic() - self.t0
        if spent < self.lost.get(pool, 0):
            return PoolState("lost", "no worker of it is alive (its last, 'w2', was heard at 10:00:00 UTC)")
        if spent < self.busy.get(pool, 0):
            return PoolState("busy", "flow run 'other-study' of launch/n2, Running since 10:00:00 UTC")
        return PoolState("free")


FAST = Waits(busy_timeout_s=30, pickup_timeout_s=30, poll_s=0.02, say_every_s=0.1)


def test_a_busy_pool_is_passed_over_and_waited_for_not_lost() -> None:
    """n2 runs another study's flow run for 0.4 s: a (n1 or n2) runs on n1 meanwhile; b (n2 only)
    waits, lines naming n2 and what it runs, then runs there once it is free. Nothing fails."""
    order = tickets("a#1", "b#1", "a#2", "b#2")
    pools, lines, warnings = Pools({"a": 0.05, "b": 0.05}), [], []
    out = dispatch(
        order, lambda arm: ["n1", "n2"] if arm == "a" else ["n2"], pools, lines.append, warnings.append,
        probe=Probe(busy={"n2": 0.4}), waits=FAST,
    )  # fmt: skip
    assert [o.status for o in out] == ["FINISHED"] * 4
    assert {label: p for p, label, _ in pools.ran} == {"a#1": "n1", "a#2": "n1", "b#1": "n2", "b#2": "n2"}
    busy = [line for line in lines if "pool n2 is busy" in line]
    assert busy, lines
    assert "flow run 'other-study' of launch/n2" in busy[0]
    assert "b#1" in busy[0]
    assert "fleet.busy_timeout_s 30" in busy[0]
    assert not warnings
    assert not any("lost" in line for line in lines)


def test_a_launch_goes_to_whichever_of_its_pools_is_free() -> None:
    order = tickets("a#1", "a#2", "a#3")
    pools = Pools({"a": 0.03})
    out = dispatch(order, lambda arm: ["n1", "n2"], pools, probe=Probe(busy={"n1": 5.0}), waits=FAST)
    assert [o.status for o in out] == ["FINISHED"] * 3
    assert {p for p, _, _ in pools.ran} == {"n2"}


def test_a_pool_busy_past_its_limit_gets_nothing_more_and_is_named_busy() -> None:
    order = tickets("a#1", "b#1")
    warnings: list[str] = []
    out = dispatch(
        order, lambda arm: ["n1"] if arm == "a" else ["n2"], Pools({"a": 0.02, "b": 0.02}),
        warn=warnings.append, probe=Probe(busy={"n2": 60}), waits=Waits(busy_timeout_s=0.3, poll_s=0.02),
    )  # fmt: skip
    assert [o.status for o in out] == ["FINISHED", "FAILED"]
    error = out[1].error or ""
    assert "no pool could run it (pool n2 is busy with another flow run (flow run 'other-study'" in error
    assert "(fleet.busy_timeout_s 0.3)" in error
    assert "lost" not in error
    assert any("pool n2 gets no more launches" in w for w in warnings)


def test_a_pool_without_a_live_worker_is_lost_after_the_pickup_timeout() -> None:
    order = tickets("a#1", "b#1")
    out = dispatch(
        order, lambda arm: ["n1"] if arm == "a" else ["n2"], Pools({"a": 0.02, "b": 0.02}),
        probe=Probe(lost={"n2": 60}), waits=Waits(busy_timeout_s=60, pickup_timeout_s=0.3, poll_s=0.02),
    )  # fmt: skip
    assert [o.status for o in out] == ["FINISHED", "FAILED"]
    error = out[1].error or ""
    assert "pool n2 is lost: no worker of it is alive" in error
    assert "(fleet.pickup_timeout_s 0.3)" in error
    assert "busy" not in error


def test_a_launch_given_back_is_taken_by_a_pool_that_had_run_out_of_work() -> None:
    """n1 finishes a#1 with nothing left to take while a#2 is on n2; n2 turns out unavailable and
    gives a#2 back: n1, still serving, runs it."""

    class Late(Pools):
        def __call__(self, pool: str, ticket: Ticket) -> ArmOutcome:
            if pool == "n2":
                time.sleep(0.3)
                raise PoolUnavailable(f"no worker of pool n2 started launch {ticket.label} within 0.3 s")
            return super().__call__(pool, ticket)

    pools = Late({"a": 0.02})
    out = dispatch(tickets("a#1", "a#2"), lambda arm: ["n1", "n2"], pools)
    assert [(o.status, o.launch) for o in out] == [("FINISHED", 1), ("FINISHED", 2)]
    assert [(p, label) for p, label, _ in pools.ran] == [("n1", "a#1"), ("n1", "a#2")]


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
