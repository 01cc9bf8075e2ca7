"""What leaves a node is scrubbed (k3pipe/ops/scrub.py, the GPU kit's collect): a log copied with every secret
k3pipe's scrubber knows blanked: the node's keys, the experiment's references' values, the
environment's secret-named variables, credential-shaped strings; the leak count is the node's keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3pipe.core import secrets
from k3pipe.ops.scrub import main, register_known, scrub_file


def test_a_log_is_copied_with_every_known_secret_blanked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made_up = "made-up-" + "0a1b2c3d" * 3
    referenced = "Zr7Qp2Lx9Vb4Nc8Md1Kf"  # not shaped like any known key: known only by its reference
    named = "q9W8e7R6t5Y4u3I2o1P0"  # in a secret-named variable of the environment
    shaped = "sk-" + "A1b2C3d4" * 3  # known by its shape alone
    monkeypatch.setenv("K3PIPE_T_HF", referenced)
    monkeypatch.setenv("SOME_SERVICE_TOKEN", named)
    keys = tmp_path / "api-keys"
    keys.write_text(f"{made_up}\n")
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("arms:\n  - engine:\n      args:\n        hf_token: '{env.K3PIPE_T_HF}'\n")
    src = tmp_path / "engine.log"
    src.write_text(
        f"non-default args: {{'api_key': '{made_up}'}}\n"
        f"ignoring engine flags ['--hf-token', '{referenced}']\n"
        f"token {named} and {shaped}; a made-up key again: {made_up}\n"
    )
    dest = tmp_path / "record" / "engine.log"
    assert main(["--keys", str(keys), "--experiment", str(experiment), str(src), str(dest)]) == 0
    assert capsys.readouterr().out == f"{src} 2 3\n"  # the node's key twice; three others
    copied = dest.read_text()
    for value in (made_up, referenced, named, shaped):
        assert value not in copied
    assert "ignoring engine flags ['--hf-token', '***']" in copied
    assert src.read_text().count(made_up) == 2  # the node's own file is left as it is


def test_an_unreadable_experiment_registers_nothing_and_nothing_fails(tmp_path: Path) -> None:
    bad = tmp_path / "exp.yaml"
    bad.write_text("arms: [unclosed\n")
    register_known(tmp_path / "no-keys", bad)
    src, dest = tmp_path / "a.log", tmp_path / "b.log"
    src.write_bytes(b"plain \xff bytes\n")
    assert scrub_file(src, dest, []) == (0, 0)
    assert dest.read_bytes() == b"plain \xff bytes\n"
    assert secrets.scrub("plain") == "plain"
