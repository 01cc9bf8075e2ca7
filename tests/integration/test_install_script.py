"""The bundle's installer as the script file it is (k3pipe/ops/install.sh): bash parses it, its Python part
compiles and uses the standard library alone (the node may have nothing else), and the bundle
writes exactly this file with the manifest's digest in place. tests/integration/test_bundle.py runs it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from k3pipe.ops.bundle import INSTALL_SH

SCRIPT = Path(__file__).resolve().parents[2] / "k3pipe" / "ops" / "install.sh"


def _python_part(text: str) -> str:
    match = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF\n", text, re.S)
    assert match is not None, "install.sh has no <<'PYEOF' ... PYEOF block"
    return match.group(1)


def test_bash_parses_it() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_its_python_compiles_and_imports_the_standard_library_only() -> None:
    tree = ast.parse(_python_part(SCRIPT.read_text()), "install.sh")
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported, "the scan found no import"
    assert sorted(imported - sys.stdlib_module_names) == []


def test_the_bundle_ships_this_file() -> None:
    assert SCRIPT.read_text() == INSTALL_SH
    assert INSTALL_SH.startswith("#!/usr/bin/env bash\n")
    assert INSTALL_SH.count("@MANIFEST_SHA256@") == 1
