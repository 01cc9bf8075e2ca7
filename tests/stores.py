"""Empty, migrated stores for the tests' homes.

The first use of a new home creates its stores: MLflow's SQLite store runs its schema migrations
(1.5 s of CPU) and Prefect's temporary server runs its own (8 s of CPU, against 5 s for the start of a
server whose database exists). A user pays that once per home; a suite that gives each test a new home
paid it in every test, about a tenth of the suite's CPU. So the templates are made once per machine
(per MLflow and Prefect version, under the assets home's cache) and copied into a test's home before it
runs (tests/conftest.py: every test outside tests/unit/, unless marked `fresh_home`).

A copy holds what the stores hold after their first open and nothing more: MLflow's default
experiment is left out (MLflow makes it again on the first open, with the home's artifact root) and
Prefect's block types are registered by the server's first start, as on a new home. The first run on a
new home stays tested: tests/integration/test_faults.py's concurrent first runs, and `fresh_home`.

    python -m tests.stores                makes the templates where the tests look for them, unless made
    python -m tests.stores --into DIR     makes them in DIR (what templates() runs, in a process of its own)
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from k3pipe.core.procs import file_lock

REPO = Path(__file__).resolve().parents[1]
# read at import, before a test points K3PIPE_HOME at its own home (as tests/conftest.py's ASSETS_HOME)
CACHE = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve() / "cache" / "store-templates"
MLFLOW_DB = "mlflow.db"
PREFECT_DB = "prefect.db"


def _key() -> str:
    return "-".join(f"{name}-{importlib.metadata.version(name)}" for name in ("mlflow", "prefect"))


def templates() -> Path:
    """The folder that holds the templates (``mlflow.db``, ``prefect.db``), made on first use; safe
    against other processes (xdist workers) asking at the same time."""
    folder = CACHE / _key()
    if (folder / PREFECT_DB).is_file():
        return folder
    with file_lock(CACHE / (folder.name + ".lock")):
        if not (folder / PREFECT_DB).is_file():
            work = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=CACHE))
            isolated = ("K3PIPE_", "MLFLOW_", "PREFECT_")
            env = {k: v for k, v in os.environ.items() if not k.startswith(isolated)}
            out = subprocess.run(
                [sys.executable, "-m", "tests.stores", "--into", str(work)],
                cwd=REPO,
                env={**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if out.returncode != 0:
                shutil.rmtree(work, ignore_errors=True)
                output = f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
                raise RuntimeError(f"making the store templates failed:\n{output}")
            work.rename(folder)
    return folder


def seed_home(home: Path) -> None:
    """Put the empty MLflow store (``mlflow/mlflow.db``) and Prefect's database (``prefect/``) into
    a k3pipe home, where it has none."""
    folder = templates()
    _copy(folder / MLFLOW_DB, home / "mlflow" / MLFLOW_DB)
    _copy(folder / PREFECT_DB, home / "prefect" / PREFECT_DB)


def seed_prefect_home(prefect_home: Path) -> None:
    """Put Prefect's migrated database into a PREFECT_HOME, where it has none."""
    _copy(templates() / PREFECT_DB, prefect_home / PREFECT_DB)


def seed_mlflow_db(db: Path) -> None:
    """Put MLflow's migrated, empty SQLite store at ``db`` (an `mlflow server`'s backend store), where
    there is none."""
    _copy(templates() / MLFLOW_DB, db)


def _copy(template: Path, dest: Path) -> None:
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, dest)


def _backup(source: Path, dest: Path) -> None:
    """One self-contained file (no -wal beside it), through SQLite's own backup."""
    src, dst = sqlite3.connect(source), sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def _make(out: Path) -> None:
    scratch = out / "scratch"
    scratch.mkdir()
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{scratch / MLFLOW_DB}", str(scratch / "artifacts"))
    store.engine.dispose()
    with sqlite3.connect(scratch / MLFLOW_DB) as db:
        db.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
        db.execute("DELETE FROM experiments WHERE experiment_id = 0")
    db.close()
    _backup(scratch / MLFLOW_DB, out / MLFLOW_DB)

    os.environ["PREFECT_HOME"] = str(scratch / "prefect")
    from prefect.server.database import provide_database_interface

    asyncio.run(provide_database_interface().create_db())
    _backup(scratch / "prefect" / PREFECT_DB, out / PREFECT_DB)
    shutil.rmtree(scratch)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--into"]:
        _make(Path(sys.argv[2]))
    else:
        print(templates())
