"""k3pipe/testing/exact_server.py with several worker processes on one port (the GPU node's benchmarks).

Real processes and sockets on 127.0.0.1: the server is forked into workers that share the port
through SO_REUSEPORT; each keeps its own records and control port, and the benchmarks' wrapper
(``client_vs_peers.ExactServer``) merges them.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks import client_vs_peers as bench

pytestmark = pytest.mark.serial


def _stream(client: httpx.Client, url: str, prompt: str) -> list[str]:
    body = {"model": "exact", "prompt": prompt, "max_tokens": 3, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_workers_share_the_port_and_their_records_are_merged(tmp_path: Path) -> None:
    shape = bench.Shape(ttft_ms=5.0, gap_ms=2.0, output_tokens=3)
    with (tmp_path / "server.log").open("w") as log, bench.ExactServer(None, 0, log, workers=2) as server:
        assert len(server.controls) == 2
        assert len(set(server.pids)) == 2
        server.set_script(shape)
        server.reset()
        prompts = [f"prompt {i}" for i in range(24)]
        for prompt in prompts:  # a new connection per request: the kernel spreads them by address
            with httpx.Client(trust_env=False) as client:
                events = _stream(client, server.base_url, prompt)
            assert events[-1] == "data: [DONE]"
            assert len(events) == 4
        with httpx.Client(trust_env=False) as client:
            refused = client.post(server.base_url + "/_control/reset")
        records = server.records()
    assert refused.status_code == 409
    assert "control port" in refused.json()["error"]["message"]
    assert len(records) == len(prompts)
    assert [r["index"] for r in records] == list(range(len(prompts)))
    assert [r["t_received"] for r in records] == sorted(r["t_received"] for r in records)
    assert {r["worker"] for r in records} == {0, 1}  # 24 connections on one worker: p = 2**-23
    assert len({r["connection"] for r in records}) == len(prompts)  # serials unique across workers
    assert all(r["completed"] and len(r["due"]) == len(r["sent"]) == 3 for r in records)
    assert all(abs((r["due"][1] - r["due"][0]) - 0.002) < 1e-9 for r in records)


def test_a_bad_cpu_list_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from k3pipe.testing import exact_server

    with pytest.raises(SystemExit):
        exact_server.main(["--workers", "2", "--cpus", "a,b"])
    assert "--cpus 'a,b'" in capsys.readouterr().err


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("continuous", [True, False])
def test_the_cached_chunks_are_openai_wire_chunks(chat: bool, continuous: bool) -> None:
    """_Plan.of encodes each shape of chunk once and writes the counts into its text: the result is
    what openai_wire builds chunk by chunk."""
    from k3pipe.testing import exact_server
    from k3pipe.testing import openai_wire as wire

    script = exact_server.Script(reasoning_tokens=3, tokens_per_chunk=2)
    prompt = 0 if continuous else 7  # 0: the two counts in a template are the same number
    plan = exact_server._Plan.of(chat, script, 9, prompt, True, continuous)
    head = wire.chunk_head(chat, "m")
    if chat:  # 3 reasoning tokens, then 6 of content, 2 a chunk (the first carries the role: "merged")
        kinds = [("reasoning", 2), ("reasoning", 1), ("content", 2), ("content", 2), ("content", 2)]
    else:
        kinds = [("content", 2)] * 4 + [("content", 1)]
    done = 0
    for n, (kind, count) in enumerate(kinds):
        done += count
        finish = "length" if n == len(kinds) - 1 else None
        text = (" r" if kind == "reasoning" else " t") * count
        delta = wire.token_delta(kind, text)
        choice = wire.delta_choice({"role": "assistant", **delta} if n == 0 else delta, finish)
        choice = choice if chat else wire.text_choice(text, finish)
        running = wire.usage(prompt, done) if continuous else None
        assert exact_server._head(head) + plan.bodies[n] == wire.dumps(wire.chunk(head, [choice], running))
    assert len(plan.bodies) == len(kinds)
    final = wire.usage_chunk(head, wire.usage(prompt, 9, 3 if chat else None), chat)
    assert exact_server._head(head) + (plan.usage or "") == wire.dumps(final)
