"""Offline bundles: freeze parsing, tags, subtraction, parts, install.sh's checks, and a real round trip."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3pipe.ops.bundle import (
    INSTALL_SH,
    PIPELINE_SMOKE_IMPORTS,
    BundleError,
    BundleRequest,
    Installed,
    Pin,
    Target,
    _conflict_advice,
    _parse_compiled,
    build_bundle,
    compatible_platform_tags,
    join_parts,
    parse_freeze,
    split_into_parts,
    subtract_installed,
    wheel_is_compatible,
)

REPO = Path(__file__).resolve().parents[2]
ASSETS_HOME = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve()


def test_parse_freeze_reads_pins_direct_urls_and_skips_noise() -> None:
    text = "\n".join(
        [
            "# a comment",
            "PyYAML==6.0.3",
            "torch==2.11.0+cu130",
            "-e git+https://example.invalid/x.git#egg=x",
            "mypkg @ file:///tmp/mypkg-1.0-py3-none-any.whl",
            "",
            "zope.interface==7.0  # trailing comment",
        ]
    )
    got = parse_freeze(text)
    assert got["pyyaml"] == Installed("PyYAML", "6.0.3")
    assert got["torch"].version == "2.11.0+cu130"
    assert got["mypkg"] == Installed("mypkg", None)
    assert got["zope-interface"].version == "7.0"
    assert len(got) == 4


def test_parse_freeze_names_the_bad_line() -> None:
    with pytest.raises(BundleError, match=r"node.txt, line 2: 'numpy>=2'.*pip list --format=freeze"):
        parse_freeze("six==1.17.0\nnumpy>=2\n", "node.txt")


def test_platform_tags_expand_down_to_manylinux1_with_aliases() -> None:
    tags = compatible_platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    assert tags[-2:] == ["manylinux_2_5_x86_64", "manylinux1_x86_64"]
    for tag in (
        "manylinux_2_27_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
    ):
        assert tag in tags
    assert "manylinux_2_29_x86_64" not in tags
    assert "manylinux2014_aarch64" in compatible_platform_tags("manylinux_2_28_aarch64")
    assert "manylinux1_aarch64" not in compatible_platform_tags("manylinux_2_28_aarch64")


def test_wheel_compatibility_follows_interpreter_abi_and_platform() -> None:
    t = Target("3.12", "manylinux_2_35_x86_64")
    assert wheel_is_compatible("vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl", t)
    assert wheel_is_compatible("six-1.17.0-py2.py3-none-any.whl", t)
    assert wheel_is_compatible("llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl", t)
    assert wheel_is_compatible("numpy-2.5.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", t)
    assert not wheel_is_compatible("numpy-2.5.2-cp311-cp311-manylinux_2_17_x86_64.whl", t)
    assert not wheel_is_compatible("x-1.0-cp312-cp312-manylinux_2_39_x86_64.whl", t)
    assert not wheel_is_compatible("x-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", t)
    assert not wheel_is_compatible("x-1.0-cp312-cp312-manylinux_2_17_aarch64.whl", t)
    with pytest.raises(BundleError, match="manylinux_2_35_x86_64"):
        Target("3.12", "linux_x86_64")


def test_subtraction_canonicalizes_names_and_ignores_local_versions() -> None:
    installed = parse_freeze("PyYAML==6.0.3\ntorch==2.11.0+cu130\nnumpy==2.5.2\nzope.interface==7.0\n")
    pins = [
        Pin("pyyaml", "6.0.3", ("pipeline",)),
        Pin("torch", "2.11.0", ("engine",)),
        Pin("numpy", "2.3.0", ("engine",)),  # another version: bundled, shadows the node's
        Pin("zope-interface", "7.0", ("pipeline",)),
        Pin("prefect", "3.9.1", ("pipeline",)),
    ]
    keep, left = subtract_installed(pins, installed)
    assert [p.name for p in keep] == ["numpy", "prefect"]
    assert {x["name"] for x in left} == {"pyyaml", "torch", "zope-interface"}
    torch = next(x for x in left if x["name"] == "torch")
    assert torch["node_version"] == "2.11.0+cu130"
    assert torch["reason"] == "on the node at the resolved version"


def test_resolver_output_gives_each_package_its_groups() -> None:
    compiled = """\
anyio==4.15.1
    # via
    #   -c node-constraints.txt
    #   httpx
    #   starlette
httpx==0.28.1
    # via
    #   -r pipeline.in
    #   openai
openai==3.57.0
    # via vllm
starlette==1.10.0
    # via vllm
vllm==0.22.0
    # via -r engine.in
"""
    pins = {
        p.name: p.groups
        for p in _parse_compiled(compiled, {"engine": "engine.in", "pipeline": "pipeline.in"})
    }
    assert pins == {
        "anyio": ("engine", "pipeline"),
        "httpx": ("engine", "pipeline"),
        "openai": ("engine",),
        "starlette": ("engine",),
        "vllm": ("engine",),
    }


def test_conflict_names_the_package_both_requirements_and_what_to_do() -> None:
    stderr = (
        "error: No solution found when resolving dependencies\n  cause: Because vllm==0.22.0 depends on "
        "numba==0.65.0 and numba==0.68.0, we can conclude that vllm==0.22.0 cannot be used."
    )
    advice = _conflict_advice(stderr, parse_freeze("numba==0.68.0\n"))
    assert "numba: the node has numba==0.68.0; vllm==0.22.0 needs numba==0.65.0" in advice
    assert "--upgrade NAME" in advice
    assert "--keep-node NAME" in advice
    assert "--omit" in advice


def _files(tmp: Path, sizes: list[int]) -> list[Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    out = []
    for i, size in enumerate(sizes):
        path = tmp / f"pkg{i}-1.0-py3-none-any.whl"
        path.write_bytes(os.urandom(size))
        out.append(path)
    return out


def test_parts_round_trip_and_respect_the_size(tmp_path: Path) -> None:
    files = _files(tmp_path / "in", [300_000, 1, 0, 150_000, 70_000])
    written = split_into_parts(files, tmp_path / "out", 1 << 16)
    parts = written["parts"]
    assert all(p["size"] <= 1 << 16 for p in parts)
    assert sum(p["size"] for p in parts) == written["payload"]["size"]
    for p in parts:
        assert hashlib.sha256((tmp_path / "out" / p["name"]).read_bytes()).hexdigest() == p["sha256"]
    back = join_parts([tmp_path / "out" / p["name"] for p in parts], tmp_path / "back")
    assert [p.name for p in back] == [f.name for f in files]
    for a, b in zip(files, back, strict=True):
        assert a.read_bytes() == b.read_bytes()


def _fake_bundle(
    tmp_path: Path, files: list[Path] | None = None, smoke_imports: list[str] | None = None
) -> tuple[Path, dict]:
    """A bundle of ``files`` (default: three small random ones; no network), as build_bundle writes it."""
    files = files or _files(tmp_path / "wheels", [200_000, 90_000, 5])
    out = tmp_path / "bundle"
    written = split_into_parts(files, out, 1 << 16)
    target = Target.this_machine()
    manifest = {
        "format": 1,
        "target": target.as_dict(),
        "groups": ["pipeline"],
        "smoke_imports": {"pipeline": smoke_imports or []},
        "wheels": [
            {
                "filename": f.name,
                "name": f.name.split("-")[0],
                "version": "1.0",
                "size": f.stat().st_size,
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                "groups": ["pipeline"],
            }
            for f in files
        ],
        **written,
    }
    text = json.dumps(manifest)
    (out / "manifest.json").write_text(text)
    (out / "install.sh").write_text(
        INSTALL_SH.replace("@MANIFEST_SHA256@", hashlib.sha256(text.encode()).hexdigest())
    )
    return out, manifest


def _install_sh(
    bundle: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(bundle / "install.sh"), f"--python={sys.executable}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_install_sh_verifies_parts_and_names_a_corrupt_or_missing_one(tmp_path: Path) -> None:
    bundle, manifest = _fake_bundle(tmp_path)
    parts = manifest["parts"]
    assert len(parts) >= 4
    ok = _install_sh(bundle, "--verify-only")
    assert ok.returncode == 0, ok.stderr
    assert f"verifying {len(parts)} parts" in ok.stdout
    assert "all parts verified" in ok.stdout

    second, third = bundle / parts[1]["name"], bundle / parts[2]["name"]
    data = bytearray(second.read_bytes())
    data[100] ^= 0xFF
    second.write_bytes(bytes(data))
    third.unlink()
    bad = _install_sh(bundle, "--verify-only")
    assert bad.returncode == 2
    assert f"part 2 of {len(parts)} ({parts[1]['name']}) is corrupt" in bad.stderr
    assert f"part 3 of {len(parts)} ({parts[2]['name']}) is missing" in bad.stderr
    assert "copy it again" in bad.stderr
    assert "Nothing was installed" in bad.stderr

    (bundle / "manifest.json").write_text("{}")
    assert "does not match this install.sh" in _install_sh(bundle, "--verify-only").stderr


def _wheel(out: Path, name: str, version: str, modules: dict[str, str]) -> Path:
    """A minimal pure-Python wheel, built here (no network, no build backend)."""
    out.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        **{f"{mod}.py": text for mod, text in modules.items()},
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: k3pipe-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for arc, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in files.items():
            zf.writestr(arc, text)
        zf.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def _py(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=python.parent)


def test_install_sh_makes_a_venv_of_a_venv_see_the_parent_behind_its_own(tmp_path: Path) -> None:
    """The node's python3 is itself a venv (/opt/torch/.venv, holding torch): the new venv must see it."""
    wheels = tmp_path / "wheels"
    parent_only = _wheel(wheels / "parent", "k3t_parent_only", "1.0", {"k3t_parent_only": "WHO = 'parent'\n"})
    shadow_old = _wheel(wheels / "parent", "k3t_shadow", "1.0", {"k3t_shadow": "WHO = 'parent'\n"})
    shadow_new = _wheel(wheels / "bundle", "k3t_shadow", "2.0", {"k3t_shadow": "WHO = 'bundle'\n"})
    own = _wheel(wheels / "bundle", "k3t_own", "1.0", {"k3t_own": "WHO = 'bundle'\n"})

    v1 = tmp_path / "v1"  # plays /opt/torch/.venv
    subprocess.run([_base_python(), "-m", "venv", str(v1)], check=True, capture_output=True)
    subprocess.run(
        [str(v1 / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
         "--disable-pip-version-check", str(parent_only), str(shadow_old)],
        check=True, capture_output=True,
    )  # fmt: skip
    v1_python = v1 / "bin" / "python"

    # the problem: --system-site-packages from a venv's python shows the base interpreter's packages only
    plain = tmp_path / "plain"
    subprocess.run(
        [str(v1_python), "-m", "venv", "--without-pip", "--system-site-packages", str(plain)], check=True
    )
    assert _py(plain / "bin" / "python", "import k3t_parent_only").returncode != 0

    bundle, _ = _fake_bundle(tmp_path, [shadow_new, own], smoke_imports=["k3t_own", "k3t_parent_only"])
    v2 = tmp_path / "v2"
    r = subprocess.run(
        ["bash", str(bundle / "install.sh"), f"--python={v1_python}", "--venv", str(v2)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{v1_python} is itself a venv ({v1}, made from " in r.stdout
    assert "problem(s) the bundle did not expect" not in r.stdout
    assert "_k3pipe_parent_venv.pth adds" in r.stdout
    assert "import k3t_parent_only: ok" in r.stdout

    py2 = v2 / "bin" / "python"
    seen = _py(
        py2,
        "import k3t_parent_only as p, k3t_shadow as s, k3t_own as o; "
        "print(p.__file__, s.WHO, s.__file__, o.__file__)",
    )
    assert seen.returncode == 0, seen.stderr
    parent_file, who, shadow_file, own_file = seen.stdout.split()
    assert parent_file.startswith(str(v1))  # the parent venv's package is seen
    assert who == "bundle"  # the new venv's own copy wins
    assert shadow_file.startswith(str(v2))
    assert own_file.startswith(str(v2))
    order = _py(
        py2,
        "import os, sys, k3t_parent_only as p, k3t_shadow as s; "
        "print(*(sys.path.index(os.path.dirname(m.__file__)) for m in (s, p)))",
    )
    own_at, parent_at = (int(x) for x in order.stdout.split())
    assert own_at < parent_at

    # --no-system-site-packages: no .pth, the parent stays out
    iso = tmp_path / "iso"
    r = subprocess.run(
        ["bash", str(bundle / "install.sh"), f"--python={v1_python}", "--venv", str(iso),
         "--no-system-site-packages", "--groups", "pipeline"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1  # the smoke import of k3t_parent_only fails: the parent is not seen
    assert "'import k3t_parent_only' fails" in r.stderr
    assert not list(iso.glob("lib/python*/site-packages/_k3pipe_parent_venv.pth"))


def test_omitting_what_k3pipe_run_imports_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"--omit asyncpg: the pipeline needs it \(Prefect 3.9's server"):
        build_bundle(BundleRequest(out_dir=tmp_path / "out", omit=("tilelang", "asyncpg")), tmp_path)
    assert "prefect.server.api.server" in PIPELINE_SMOKE_IMPORTS


def test_install_sh_refuses_another_interpreter(tmp_path: Path) -> None:
    bundle, manifest = _fake_bundle(tmp_path)
    manifest["target"]["python_version"] = "3.99"
    text = json.dumps(manifest)
    (bundle / "manifest.json").write_text(text)
    (bundle / "install.sh").write_text(
        INSTALL_SH.replace("@MANIFEST_SHA256@", hashlib.sha256(text.encode()).hexdigest())
    )
    r = _install_sh(bundle, "--verify-only")
    assert r.returncode == 2
    assert "the bundle is for CPython 3.99" in r.stderr


# ---------------------------------------------------------------------------------------------
# end to end: a bundle for this machine, installed with no index reachable


def _base_python() -> str:
    return getattr(sys, "_base_executable", sys.executable)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _no_bytecode() -> Iterator[None]:
    """The module's pip installs write no bytecode (PIP_NO_COMPILE, pip's --no-compile): compiling is
    pip's own work, not the bundle's, and it cost the module 24 of its 127 CPU-s and 28 s (2026-12-07)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIP_NO_COMPILE", "1")
        yield


@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:
    base = _base_python()
    freeze = subprocess.run(
        [base, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    # a few of the base interpreter's packages play the node's own (seen through --system-site-packages)
    node = [line for line in freeze.splitlines() if line.split("==")[0].lower() in {"six", "idna", "pyyaml"}]
    tmp = tmp_path_factory.mktemp("bundle")
    (tmp / "node-freeze.txt").write_text("\n".join(node) + "\n")
    t0 = time.perf_counter()
    result = build_bundle(
        BundleRequest(
            out_dir=tmp / "out",
            node_freeze=tmp / "node-freeze.txt",
            target=Target.this_machine(),
            part_size=40 * 2**20,
            project_dir=REPO,
            cache_dir=ASSETS_HOME / "cache" / "bundle",
        ),
        ASSETS_HOME,
    )
    return result.out_dir, result.manifest, time.perf_counter() - t0


def test_manifest_holds_every_wheel_part_target_and_what_was_left_out(
    real_bundle: tuple[Path, dict, float],
) -> None:
    out, m, _ = real_bundle
    assert m["target"]["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert m["requirements"]["pipeline"][0] == "k3pipe==0.1.0"
    assert "prefect>=3.9,<4" in m["requirements"]["pipeline"]
    names = {w["name"].lower() for w in m["wheels"]}
    assert {"k3pipe", "prefect", "mlflow", "pydantic"} <= names
    left = {x["name"].lower(): x for x in m["left_out"]}
    assert {"six", "idna", "pyyaml"} & set(left)
    assert all(x["reason"] == "on the node at the resolved version" for x in left.values())
    assert not {"six", "idna", "pyyaml"} & {n for n in names if n in left}
    for p in m["parts"]:
        path = out / p["name"]
        assert path.stat().st_size == p["size"] <= m["part_size"]
    assert sum(p["size"] for p in m["parts"]) == m["payload"]["size"]
    assert all(len(w["sha256"]) == 64 and w["size"] > 0 for w in m["wheels"])
    assert (out / "install.sh").stat().st_mode & 0o111


@pytest.fixture(scope="module")
def offline_install(
    real_bundle: tuple[Path, dict, float], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str], float, dict[str, str]]:
    """The real bundle installed once into a new venv with every index and proxy pointing at a closed
    port (nothing can be fetched): the venv, install.sh's result, its seconds and that environment.
    Both tests below use it (an install takes 1-2 minutes)."""
    out, _, _ = real_bundle
    closed = f"http://127.0.0.1:{_closed_port()}"
    env = {
        **os.environ,
        "PIP_INDEX_URL": f"{closed}/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "HTTP_PROXY": closed,
        "HTTPS_PROXY": closed,
        "http_proxy": closed,
        "https_proxy": closed,
        "PIP_CONFIG_FILE": os.devnull,
    }
    venv = tmp_path_factory.mktemp("offline") / "venv"
    t0 = time.perf_counter()
    r = subprocess.run(
        ["bash", str(out / "install.sh"), f"--python={_base_python()}", "--venv", str(venv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    return venv, r, time.perf_counter() - t0, env


def test_bundle_installs_offline_and_k3pipe_renders(
    real_bundle: tuple[Path, dict, float],
    offline_install: tuple[Path, subprocess.CompletedProcess[str], float, dict[str, str]],
    tmp_path: Path,
) -> None:
    _, m, bundle_s = real_bundle
    venv, r, install_s, env = offline_install
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"all {len(m['wheels'])} wheels match the manifest" in r.stdout
    assert "import k3pipe.cli.main: ok" in r.stdout
    assert "import prefect.server.api.server: ok" in r.stdout
    assert "k3pipe --help: ok" in r.stdout
    assert "pip check" in r.stdout
    print(f"bundle {bundle_s:.0f} s, install {install_s:.0f} s, {len(m['wheels'])} wheels")

    py = venv / "bin" / "python"
    where = subprocess.run(
        [str(py), "-c", "import k3pipe; print(k3pipe.__file__)"], capture_output=True, text=True, cwd=tmp_path
    )
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout
    render = subprocess.run(
        [str(venv / "bin" / "k3pipe"), "render", str(REPO / "experiments" / "demo-cpu.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "K3PIPE_HOME": str(tmp_path / "home")},
    )
    assert render.returncode == 0, render.stderr
    assert "vllm.entrypoints.openai.api_server" in render.stdout


def test_install_check_catches_a_missing_asyncpg(
    real_bundle: tuple[Path, dict, float],
    offline_install: tuple[Path, subprocess.CompletedProcess[str], float, dict[str, str]],
    tmp_path: Path,
) -> None:
    """'k3pipe run' failed on the node with "No module named 'asyncpg'"; install.sh's check must see it.
    (On the module's one offline install: asyncpg is put back at the end.)"""
    out, m, _ = real_bundle
    venv, r, _, _ = offline_install
    asyncpg = next(w for w in m["wheels"] if w["name"].lower() == "asyncpg")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "asyncpg"], check=True, capture_output=True
    )

    # the old check (import k3pipe, prefect, mlflow) passes without asyncpg: it would not have caught it
    old = subprocess.run(
        [str(py), "-c", "import k3pipe, prefect, mlflow"], capture_output=True, text=True, cwd=tmp_path
    )
    assert old.returncode == 0, old.stderr
    check = subprocess.run(
        ["bash", str(out / "install.sh"), f"--python={_base_python()}", "--venv", str(venv), "--check-only"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert check.returncode == 1, check.stdout + check.stderr
    assert "'import prefect.server.api.server' fails" in check.stderr
    assert "No module named 'asyncpg'" in check.stderr

    wheel = ASSETS_HOME / "cache" / "bundle" / "wheels" / asyncpg["filename"]
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    again = subprocess.run(
        ["bash", str(out / "install.sh"), f"--python={_base_python()}", "--venv", str(venv), "--check-only"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "import prefect.server.api.server: ok" in again.stdout
    assert "k3pipe --help: ok" in again.stdout
