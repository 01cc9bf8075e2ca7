"""What the vLLM engine module knows, held against the installed vLLM (tests/unit/engines/ holds the
rest, against the fixture files)."""

from __future__ import annotations

import subprocess

import pytest

from k3pipe.engines.base import load_flag_table
from k3pipe.engines.vllm import VLLMEngine
from tests.conftest import VLLM_PYTHON


@pytest.mark.engine
def test_vllm_flag_table_matches_installed_vllm() -> None:
    """The committed table is what the installed vLLM 0.32.0's `vllm serve` parser defines."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing; run the tests with `make test`, which builds it")
    code = (
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "p = make_arg_parser(FlexibleArgumentParser(prog='vllm serve'))\n"
        "print('\\n'.join(sorted({o for a in p._actions for o in a.option_strings} - {'-h', '--help'})))\n"
    )
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert set(out.stdout.split()) == load_flag_table(VLLMEngine.flags_file or "").flags
