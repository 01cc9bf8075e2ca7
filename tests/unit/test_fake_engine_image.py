"""k3pipe/testing/fake_engine.py runs alone in the test image, beside openai_wire.py, on a bare python3:
both import only the standard library and each other, and the Dockerfile copies both (the docker
tier builds and runs the image; this says why it would fail without dockerd)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "k3pipe" / "testing"  # the image's build context
IMAGE_FILES = ("fake_engine.py", "openai_wire.py")


def _imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, but for an import tried first in a ``try`` whose
    ``except ImportError`` imports the fallback (the package's own name, absent in the image)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    optional = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.Try)
        and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers)
        for inner in node.body
    }
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_image_files_import_only_the_standard_library_and_each_other() -> None:
    own = {Path(name).stem for name in IMAGE_FILES}
    for name in IMAGE_FILES:
        foreign = _imports(DOCKER / name) - set(sys.stdlib_module_names) - own - {"__future__"}
        assert not foreign, f"{name} imports {sorted(foreign)}: the image has only python3"


def test_the_dockerfile_copies_every_image_file_into_one_folder() -> None:
    copies = [
        line.split()[1:]
        for line in (REPO / "tests" / "docker" / "Dockerfile").read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
    ]
    assert copies == [[*IMAGE_FILES, "/opt/k3pipe/"]]
