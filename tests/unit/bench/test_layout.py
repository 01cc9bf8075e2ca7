"""How many client processes send a workload, on which CPUs (k3pipe.bench.shards.client_layout), and
the CPU lists and client settings an experiment may give (k3pipe.schema.specs.ClientSpec)."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from k3pipe.bench.shards import STREAMS_PER_PROCESS, client_layout
from k3pipe.core.procs import parse_cpu_list
from k3pipe.schema.launcher_specs import ProcessLauncherSpec
from k3pipe.schema.specs import ClientSpec

MINE = sorted(os.sched_getaffinity(0))


def test_cpu_lists_read_as_taskset_does() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list(" 5 , 1-2,2") == [1, 2, 5]
    for bad, says in [
        ("a-b", "is not a CPU list"),
        ("3-1", "'3-1' is not a range"),
        ("", "is not a CPU list"),
        ("0-99999", "not a range of CPUs 0-4095"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_cpu_list(bad, "client.cpus")


def test_client_and_engine_cpus_are_checked_where_written() -> None:
    with pytest.raises(ValidationError, match=r"client.cpus '0-x' is not a CPU list"):
        ClientSpec(cpus="0-x")
    with pytest.raises(ValidationError, match=r"launcher.cpus '9-2'"):
        ProcessLauncherSpec(cpus="9-2")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ClientSpec(processes=0)
    assert ProcessLauncherSpec(cpus="2-3").engine_cpus() == [2, 3]


def test_by_default_one_process_per_128_streams_at_most_one_per_cpu() -> None:
    assert client_layout(ClientSpec(), 1) == (1, None)
    assert client_layout(ClientSpec(), STREAMS_PER_PROCESS) == (1, None)
    n, sets = client_layout(ClientSpec(), STREAMS_PER_PROCESS + 1)
    assert n == min(2, len(MINE))
    assert sets is None  # nothing was pinned: neither is the client
    assert client_layout(ClientSpec(), 100_000)[0] == len(MINE)


def test_given_cpus_are_split_among_the_processes() -> None:
    n, sets = client_layout(ClientSpec(processes=3, cpus="4-9"), 10)
    assert n == 3
    assert sets == [[4, 7], [5, 8], [6, 9]]
    # more processes than CPUs: they share them
    assert client_layout(ClientSpec(processes=3, cpus="1"), 10) == (3, [[1], [1], [1]])


@pytest.mark.skipif(len(MINE) < 2, reason="needs two CPUs")
def test_the_client_keeps_off_a_pinned_engine() -> None:
    engine = [MINE[0]]
    n, sets = client_layout(ClientSpec(processes=2), 10, engine)
    assert n == 2
    assert sets is not None
    assert all(MINE[0] not in s for s in sets)
    # an engine on every CPU leaves the client all of them rather than none
    assert client_layout(ClientSpec(processes=1), 10, MINE)[1] == [MINE]
