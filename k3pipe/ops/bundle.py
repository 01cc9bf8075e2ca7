"""Offline bundles: every wheel an air-gapped node lacks, in parts, with a manifest and an installer.

``build_bundle`` resolves the engine's requirements (e.g. ``vllm==0.22.0``) and k3pipe's own
dependencies together for a target interpreter and platform, from metadata only (``uv pip compile``
reads a wheel's METADATA by range request, so torch and CUDA wheels are never downloaded), with the
node's ``pip list --format=freeze`` as constraints. Packages the node already has at the resolved
version are left out; the rest are downloaded (``pip download --no-deps --only-binary=:all:``) into a
cache under ``K3PIPE_HOME``, a wheel of k3pipe itself is built from the checkout, and the wheels are
written as one tar stream cut into parts of at most ``part_size`` bytes. ``manifest.json`` holds the
sha256 and size of every wheel and part, the target, the requirements and what was left out and
why; ``install.sh`` (bash + python3 stdlib) verifies the parts, reassembles, verifies the wheels and
installs them with ``pip --no-index --no-deps`` into one venv or two (engine, pipeline).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from k3pipe.core.errors import K3pipeError

__all__ = [
    "BundleError",
    "BundleRequest",
    "BundleResult",
    "Installed",
    "Pin",
    "Target",
    "build_bundle",
    "canonical_name",
    "compatible_platform_tags",
    "join_parts",
    "parse_freeze",
    "split_into_parts",
    "subtract_installed",
    "wheel_is_compatible",
]

MANIFEST_FORMAT = 1
PART_PREFIX = "k3pipe-bundle.part"
ENGINE, PIPELINE = "engine", "pipeline"
_CHUNK = 1 << 20


class BundleError(K3pipeError):
    """A bundle could not be resolved, downloaded or written (the message says what to do)."""


# Packages the pipeline imports at run time though nothing at import time of k3pipe itself shows it:
# --omit refuses them when the pipeline is bundled.
PIPELINE_RUNTIME_NEEDS = {
    "asyncpg": "Prefect 3.9's server (prefect.server.api.server, started by 'k3pipe run') imports it "
    "at start-up even with SQLite",
}

# What install.sh runs in each venv after installing (and with --check-only): the modules 'k3pipe run'
# imports, Prefect's server included (a missing asyncpg fails there, not at 'import prefect').
PIPELINE_SMOKE_IMPORTS = ["k3pipe.cli.main", "k3pipe.flows.benchmark", "prefect.server.api.server", "mlflow"]
PIPELINE_SMOKE_COMMANDS = [["k3pipe", "--help"]]


# ---------------------------------------------------------------------------------------------
# names, freezes, targets


def canonical_name(name: str) -> str:
    """The PEP 503 normalized form of a project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _public_version(version: str) -> str:
    """The version without its local segment (``2.11.0+cu130`` -> ``2.11.0``)."""
    return version.split("+", 1)[0]


def _same_version(a: str, b: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(_public_version(a)) == Version(_public_version(b))
    except InvalidVersion:
        return _public_version(a).lower() == _public_version(b).lower()


@dataclasses.dataclass(frozen=True)
class Installed:
    """One package the node already has. ``version`` is None for a direct-URL install."""

    name: str
    version: str | None


@dataclasses.dataclass(frozen=True)
class Pin:
    """One resolved package, and which groups (engine, pipeline) need it."""

    name: str
    version: str
    groups: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return canonical_name(self.name)


def parse_freeze(text: str, source: str = "freeze") -> dict[str, Installed]:
    """Parse ``pip list --format=freeze`` (or ``pip freeze``) output, keyed by canonical name.

    Comments, blank lines, ``-e`` editable lines and pip's own notices are skipped; ``name @ URL``
    counts as installed at an unknown version.
    """
    out: dict[str, Installed] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("-", "[")):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(===?)\s*(\S+)", line)
        if m:
            out[canonical_name(m.group(1))] = Installed(m.group(1), m.group(3))
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*@\s*\S.*", line)
        if m:
            out[canonical_name(m.group(1))] = Installed(m.group(1), None)
            continue
        raise BundleError(
            f"{source}, line {lineno}: {raw.strip()!r} is not 'name==version': give the output of "
            "'python3 -m pip list --format=freeze' taken on the node"
        )
    return out


@dataclasses.dataclass(frozen=True)
class Target:
    """The interpreter and platform the bundle is for, e.g. CPython 3.12 on manylinux_2_35_x86_64."""

    python_version: str = "3.12"
    platform: str = "manylinux_2_35_x86_64"
    implementation: str = "cp"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python_version):
            raise BundleError(f"python version {self.python_version!r}: give MAJOR.MINOR, e.g. 3.12")
        if self.implementation != "cp":
            raise BundleError(f"implementation {self.implementation!r}: only CPython ('cp') is supported")
        if not _MANYLINUX.fullmatch(self.platform):
            raise BundleError(
                f"platform {self.platform!r}: give a glibc Linux wheel tag such as manylinux_2_35_x86_64 "
                "or manylinux_2_28_aarch64 (the node's glibc 2.N accepts manylinux_2_N and below)"
            )

    @classmethod
    def this_machine(cls) -> Target:
        """The running interpreter and this machine's glibc and architecture."""
        libc, ver = platform.libc_ver()
        if libc != "glibc" or not ver:
            raise BundleError("this machine has no glibc: give the target platform explicitly")
        major, minor = (int(x) for x in ver.split(".")[:2])
        if major != 2:
            raise BundleError(f"glibc {ver}: unexpected major version")
        return cls(f"{sys.version_info.major}.{sys.version_info.minor}", f"manylinux_2_{minor}_{_arch()}")

    @property
    def glibc_minor(self) -> int:
        m = _MANYLINUX.fullmatch(self.platform)
        assert m
        return int(m.group(1))

    @property
    def arch(self) -> str:
        m = _MANYLINUX.fullmatch(self.platform)
        assert m
        return m.group(2)

    @property
    def python_tag(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    @property
    def uv_python_platform(self) -> str:
        # uv knows manylinux_2_17 .. 2_40 targets; a newer glibc still resolves correctly at 2_40
        return f"{self.arch}-manylinux_2_{min(max(self.glibc_minor, 17), 40)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "python_version": self.python_version,
            "platform": self.platform,
            "glibc_min": f"2.{self.glibc_minor}",
            "arch": self.arch,
            "platform_tags": compatible_platform_tags(self.platform),
        }


_MANYLINUX = re.compile(r"manylinux_2_(\d+)_(x86_64|aarch64|ppc64le|s390x|armv7l|i686)")


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def compatible_platform_tags(platform_tag: str) -> list[str]:
    """Every platform tag a wheel may carry to install on ``platform_tag`` (most specific first).

    pip's ``--platform`` matches exactly, so a manylinux_2_28 target lists manylinux_2_28 down to
    manylinux_2_5 and the legacy aliases manylinux2014 (2_17), manylinux2010 (2_12), manylinux1
    (2_5). Pure wheels (``any``) are always accepted by pip besides these.
    """
    m = _MANYLINUX.fullmatch(platform_tag)
    if not m:
        return [platform_tag]
    top, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(top, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    for minor, alias in legacy.items():
        if top >= minor and (arch in ("x86_64", "i686") or alias == "manylinux2014"):
            tags.insert(tags.index(f"manylinux_2_{minor}_{arch}") + 1, f"{alias}_{arch}")
    return tags


def _parse_wheel_filename(filename: str) -> tuple[str, str, list[str], list[str], list[str]] | None:
    """(name, version, python tags, abi tags, platform tags) of a wheel file name, or None."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    name, version = parts[0], parts[1]
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    return name, version, py.split("."), abi.split("."), plat.split(".")


def wheel_is_compatible(filename: str, target: Target) -> bool:
    """Whether pip on ``target`` would install this wheel (interpreter, ABI and platform tags)."""
    parsed = _parse_wheel_filename(filename)
    if parsed is None:
        return False
    _, _, pys, abis, plats = parsed
    minor = int(target.python_version.split(".")[1])
    plat_ok = "any" in plats or bool(set(plats) & set(compatible_platform_tags(target.platform)))
    if not plat_ok:
        return False
    for py in pys:
        for abi in abis:
            if abi == "none" and (py in ("py3", f"py3{minor}", target.python_tag) or _py3_upto(py, minor)):
                return True
            if abi == target.python_tag and py == target.python_tag:
                return True
            if abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= minor:
                return True
    return False


def _py3_upto(py: str, minor: int) -> bool:
    return py.startswith("py3") and py[3:].isdigit() and int(py[3:]) <= minor


def _wheel_rank(filename: str, target: Target) -> tuple[int, int]:
    """Prefer interpreter-specific over abi3 over pure wheels, then the newest manylinux."""
    parsed = _parse_wheel_filename(filename)
    assert parsed
    _, _, _, abis, plats = parsed
    abi_rank = 2 if target.python_tag in abis else 1 if "abi3" in abis else 0
    tags = compatible_platform_tags(target.platform)
    plat_rank = max((len(tags) - tags.index(p) for p in plats if p in tags), default=0)
    return abi_rank, plat_rank


# ---------------------------------------------------------------------------------------------
# subtraction


def subtract_installed(
    pins: Iterable[Pin], installed: dict[str, Installed]
) -> tuple[list[Pin], list[dict[str, Any]]]:
    """Split resolved pins into those to bundle and those the node has at the same version.

    Versions compare without their local segment, so the node's ``torch 2.11.0+cu130`` satisfies a
    resolved ``torch==2.11.0``. A package the node has at another version is bundled (it shadows the
    node's copy in the venv). Returns (to bundle, left out with reasons).
    """
    keep: list[Pin] = []
    left_out: list[dict[str, Any]] = []
    for pin in pins:
        have = installed.get(pin.key)
        if have is not None and (have.version is None or _same_version(have.version, pin.version)):
            left_out.append(
                {
                    "name": pin.name,
                    "version": pin.version,
                    "node_version": have.version,
                    "groups": list(pin.groups),
                    "reason": "on the node at the resolved version",
                }
            )
        else:
            keep.append(pin)
    return keep, left_out


# ---------------------------------------------------------------------------------------------
# parts


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _PartWriter:
    """A write-only file object that cuts what is written into numbered parts of ``part_size``."""

    def __init__(self, out_dir: Path, part_size: int) -> None:
        if part_size < 1 << 16:
            raise BundleError(f"part size {part_size} bytes: give at least 64 KiB")
        self.out_dir, self.part_size = out_dir, part_size
        self.parts: list[dict[str, Any]] = []
        self._fh: IO[bytes] | None = None
        self._digest = hashlib.sha256()
        self._used = 0
        self.total = hashlib.sha256()
        self.total_size = 0

    def _roll(self) -> None:
        self._close_part()
        name = f"{PART_PREFIX}{len(self.parts):03d}"
        self._fh = (self.out_dir / name).open("wb")
        self.parts.append({"name": name})
        self._digest, self._used = hashlib.sha256(), 0

    def _close_part(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self.parts[-1].update(size=self._used, sha256=self._digest.hexdigest())
            self._fh = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._fh is None or self._used == self.part_size:
                self._roll()
            assert self._fh is not None
            take = min(len(view), self.part_size - self._used)
            chunk = view[:take]
            self._fh.write(chunk)
            self._digest.update(chunk)
            self.total.update(chunk)
            self._used += take
            self.total_size += take
            view = view[take:]
        return len(data)

    def close(self) -> None:
        self._close_part()


def split_into_parts(files: Iterable[Path], out_dir: Path, part_size: int) -> dict[str, Any]:
    """Write ``files`` as one uncompressed tar stream (``wheels/NAME``) cut into parts in ``out_dir``.

    Returns ``{"parts": [{name, size, sha256}], "payload": {format, size, sha256}}``. Wheels are
    already compressed; a tar keeps their bytes exactly, so every wheel still matches its sha256.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{PART_PREFIX}*"):
        stale.unlink()
    writer = _PartWriter(out_dir, part_size)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for path in files:
            info = tar.gettarinfo(str(path), arcname=f"wheels/{path.name}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o644
            with path.open("rb") as fh:
                tar.addfile(info, fh)
    writer.close()
    return {
        "parts": writer.parts,
        "payload": {"format": "tar", "size": writer.total_size, "sha256": writer.total.hexdigest()},
    }


class _ChainReader:
    """Read several files as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = iter(paths)
        self._fh: IO[bytes] | None = None

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            if self._fh is None:
                nxt = next(self._paths, None)
                if nxt is None:
                    break
                self._fh = nxt.open("rb")
            chunk = self._fh.read(-1 if size < 0 else size - len(out))
            if not chunk:
                self._fh.close()
                self._fh = None
                continue
            out += chunk
        return bytes(out)


def join_parts(part_paths: list[Path], dest: Path) -> list[Path]:
    """Reassemble parts written by ``split_into_parts`` into ``dest``; returns the files."""
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tarfile.open(fileobj=_ChainReader(part_paths), mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            name = Path(member.name).name
            if not member.isfile() or member.name != f"wheels/{name}":
                raise BundleError(f"unexpected entry {member.name!r} in the bundle")
            src = tar.extractfile(member)
            assert src is not None
            with (dest / name).open("wb") as fh:
                shutil.copyfileobj(src, fh, _CHUNK)
            written.append(dest / name)
    return written


# ---------------------------------------------------------------------------------------------
# tools: uv (resolution, building k3pipe's wheel) and pip (downloads)


def _find_uv(home: Path) -> str:
    """uv from the ``uv`` package, PATH, or ``K3PIPE_HOME/tools`` (installed there if absent)."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found:
        return found
    tools_uv = home / "tools" / "bin" / "uv"
    if not tools_uv.exists():
        _run([_tools_python(home), "-m", "pip", "install", "--quiet", "uv"], "installing uv")
    return str(tools_uv)


def _tools_python(home: Path) -> str:
    """A Python with pip: this interpreter if it has pip, else the ``K3PIPE_HOME/tools`` venv."""
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        return sys.executable
    py = home / "tools" / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(home / "tools")], "creating the tools venv")
    return str(py)


def _run(argv: list[str], what: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise BundleError(f"{what}: could not run {argv[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise BundleError(
            f"{what} failed (exit {proc.returncode}): {' '.join(argv[:4])} ...\n{proc.stderr.strip()[-4000:]}"
        )
    return proc


# ---------------------------------------------------------------------------------------------
# resolution


def _parse_compiled(text: str, group_files: dict[str, str]) -> list[Pin]:
    """Pins and their groups from ``uv pip compile`` output with ``--annotation-style split``."""
    pins: dict[str, tuple[str, str]] = {}
    via: dict[str, set[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "#")):
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)", line.split(";")[0].strip())
            if not m:
                raise BundleError(f"cannot read the resolver's line {line!r}")
            current = canonical_name(m.group(1))
            pins[current] = (m.group(1), m.group(3))
            via.setdefault(current, set())
            continue
        entry = line.strip().lstrip("#").strip()
        if current is None or not entry:
            continue
        if entry.startswith("via"):
            entry = entry[3:].strip()
            if not entry:
                continue
        via[current].add(entry)
    # forward edges from the reverse annotations; roots from "-r <group file>"
    children: dict[str, set[str]] = {k: set() for k in pins}
    roots: dict[str, set[str]] = {g: set() for g in group_files}
    for pkg, sources in via.items():
        for src in sources:
            if src.startswith("-r "):
                for group, fname in group_files.items():
                    if Path(src[3:].strip()).name == fname:
                        roots[group].add(pkg)
            elif not src.startswith("-"):
                parent = canonical_name(re.split(r"[\s\[(]", src, maxsplit=1)[0])
                if parent in children:
                    children[parent].add(pkg)
    member: dict[str, set[str]] = {k: set() for k in pins}
    for group, start in roots.items():
        stack = list(start)
        while stack:
            pkg = stack.pop()
            if group in member[pkg]:
                continue
            member[pkg].add(group)
            stack.extend(children[pkg])
    return [
        Pin(name, version, tuple(sorted(member[key]) or sorted(group_files)))
        for key, (name, version) in sorted(pins.items())
    ]


_DEPENDS_ON = re.compile(
    r"(\S+) depends on ([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?(?:\{[^}]*\})?"
    r"([<>=!~][^\s,]*(?:,[<>=!~][^\s,]*)*)"
)


def _conflict_advice(stderr: str, installed: dict[str, Installed]) -> str:
    """Name the node's packages that a requirement wants at another version, and what to do."""
    lines: list[str] = []
    seen: set[str] = set()
    for m in _DEPENDS_ON.finditer(stderr):
        who, name, spec = m.group(1), m.group(2), m.group(3)
        have = installed.get(canonical_name(name))
        if have is None or have.version is None or spec == f"=={have.version}":
            continue
        key = (canonical_name(name), who, spec)
        if str(key) in seen:
            continue
        seen.add(str(key))
        lines.append(f"  {name}: the node has {name}=={have.version}; {who} needs {name}{spec}")
    if not lines:
        return ""
    names = sorted({canonical_name(line.split(":")[0].strip()) for line in lines})
    return (
        "The node's pins conflict with the requirements:\n"
        + "\n".join(lines)
        + "\nWhat to do, per package: --upgrade NAME (bundle the version the requirement needs; it "
        "shadows the node's copy in the venv), --keep-node NAME (use the node's version anyway; "
        "pip check will report it), or --omit PKG for the package that asks for it if the node does "
        f"not need it. Conflicting: {', '.join(names)}"
    )


# ---------------------------------------------------------------------------------------------
# the bundle


@dataclasses.dataclass(frozen=True)
class BundleRequest:
    """What to bundle. ``engine``: requirement strings (e.g. ``vllm==0.22.0``)."""

    out_dir: Path
    engine: tuple[str, ...] = ()
    pipeline: bool = True
    node_freeze: Path | None = None
    target: Target = dataclasses.field(default_factory=Target)
    part_size: int = 60 * 2**20
    upgrade: tuple[str, ...] = ()
    keep_node: tuple[str, ...] = ()
    omit: tuple[str, ...] = ()
    index_url: str | None = None
    project_dir: Path | None = None
    cache_dir: Path | None = None
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class BundleResult:
    out_dir: Path
    manifest: dict[str, Any]

    @property
    def total_size(self) -> int:
        return sum(p["size"] for p in self.manifest["parts"])


def _project_dir(given: Path | None) -> Path:
    root = given or Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        raise BundleError(
            f"{root}: no pyproject.toml: run k3pipe bundle from a k3pipe checkout (or pass --project-dir)"
        )
    return root


def _k3pipe_requirements(project: Path) -> tuple[str, str, list[str]]:
    data = tomllib.loads((project / "pyproject.toml").read_text())
    proj = data.get("project", {})
    return proj["name"], proj["version"], list(proj.get("dependencies", []))


def _log(progress: Any, message: str) -> None:
    if progress is not None:
        progress(message)


def build_bundle(req: BundleRequest, home: Path, progress: Any = None) -> BundleResult:
    """Resolve, download and write the bundle; ``progress`` (a callable) gets one line per step."""
    if not req.engine and not req.pipeline:
        raise BundleError("nothing to bundle: give --engine REQUIREMENT and/or keep the pipeline")
    target = req.target
    cache = (req.cache_dir or home / "cache" / "bundle").resolve()
    wheel_cache = cache / "wheels"
    wheel_cache.mkdir(parents=True, exist_ok=True)
    out = req.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)

    freeze_text = req.node_freeze.read_text() if req.node_freeze else ""
    installed = parse_freeze(freeze_text, str(req.node_freeze or "freeze"))
    upgrade = {canonical_name(n) for n in req.upgrade}
    keep = {canonical_name(n) for n in req.keep_node}
    omit = {canonical_name(n) for n in req.omit}
    unknown = sorted(keep - set(installed))
    if unknown:
        raise BundleError(f"--keep-node {', '.join(unknown)}: not in the node's freeze (nothing to keep)")
    needed = sorted(omit & set(PIPELINE_RUNTIME_NEEDS)) if req.pipeline else []
    if needed:
        raise BundleError(
            "; ".join(f"--omit {n}: the pipeline needs it ({PIPELINE_RUNTIME_NEEDS[n]})" for n in needed)
            + ": bundle it (drop the --omit)"
        )

    project = _project_dir(req.project_dir) if req.pipeline else None
    own_name, own_version, own_deps = _k3pipe_requirements(project) if project else ("", "", [])

    uv = _find_uv(home)
    with tempfile.TemporaryDirectory(prefix="k3pipe-bundle-") as tmp_s:
        tmp = Path(tmp_s)
        group_files = {}
        if req.engine:
            (tmp / "engine.in").write_text("\n".join(req.engine) + "\n")
            group_files[ENGINE] = "engine.in"
        if req.pipeline:
            (tmp / "pipeline.in").write_text("\n".join(own_deps) + "\n")
            group_files[PIPELINE] = "pipeline.in"
        constraints = [
            f"{inst.name}=={_public_version(inst.version)}"
            for key, inst in sorted(installed.items())
            if inst.version and key not in upgrade and key not in keep and key not in omit
        ]
        (tmp / "node-constraints.txt").write_text("\n".join(constraints) + "\n")
        overrides = [
            f"{installed[k].name}=={_public_version(installed[k].version or '')}" for k in sorted(keep)
        ]
        (tmp / "overrides.txt").write_text("\n".join(overrides) + "\n")
        (tmp / "excludes.txt").write_text("\n".join(sorted(omit)) + "\n")

        def compile_(excludes: bool) -> subprocess.CompletedProcess[str]:
            argv = [
                uv, "pip", "compile", *group_files.values(),
                "--constraints", "node-constraints.txt", "--overrides", "overrides.txt",
                "--python-version", target.python_version,
                "--python-platform", target.uv_python_platform,
                "--no-build", "--no-header", "--annotation-style", "split",
                "--no-python-downloads", "--cache-dir", str(cache / "uv"), "--quiet",
            ]  # fmt: skip
            if excludes:
                argv += ["--excludes", "excludes.txt"]
            if req.index_url:
                argv += ["--index-url", req.index_url]
            return subprocess.run(argv, cwd=tmp, capture_output=True, text=True, stdin=subprocess.DEVNULL)

        _log(progress, f"resolving for CPython {target.python_version} on {target.platform} (metadata only)")
        proc = compile_(excludes=True)
        if proc.returncode != 0:
            advice = _conflict_advice(proc.stderr, installed)
            raise BundleError(
                "the requirements cannot be resolved against the node's packages:\n"
                + proc.stderr.strip()[-6000:]
                + ("\n\n" + advice if advice else "")
            )
        pins = _parse_compiled(proc.stdout, group_files)
        dropped: list[str] = []
        dropped_known = not omit
        if omit:
            full = compile_(excludes=False)
            dropped_known = full.returncode == 0
            if dropped_known:
                kept = {p.key for p in pins}
                dropped = sorted(
                    p.name for p in _parse_compiled(full.stdout, group_files)
                    if p.key not in kept and p.key not in omit
                )  # fmt: skip

    to_fetch, left_out = subtract_installed(pins, installed)
    for key in sorted(keep):
        for item in left_out:
            if canonical_name(item["name"]) == key:
                item["reason"] = (
                    "the node's version is kept (--keep-node) although a requirement asks for another"
                )
    for name in sorted(omit):
        left_out.append({"name": name, "reason": "omitted (--omit): declared but not needed on the node"})
    for name in dropped:
        left_out.append({"name": name, "reason": "needed only by omitted packages"})
    if not dropped_known:
        left_out.append(
            {
                "name": "(what only the omitted packages need)",
                "reason": "not listed: the requirements do not resolve with the omitted packages in",
            }
        )
    _log(
        progress,
        f"resolved {len(pins)} packages; {len(to_fetch)} to bundle, {len(pins) - len(to_fetch)} on the node",
    )

    wheels = _download(to_fetch, target, wheel_cache, home, req.index_url, progress)
    paths = [wheels[pin.key] for pin in to_fetch]
    entries = [_wheel_entry(wheels[p.key], p.name, p.version, p.groups) for p in to_fetch]
    build_dir = out.parent / f".{out.name}-wheel-build"
    if project:
        _log(progress, f"building the {own_name} wheel from {project}")
        own = _build_own_wheel(uv, project, build_dir, cache)
        paths.append(own)
        entries.append(_wheel_entry(own, own_name, own_version, (PIPELINE,)))

    for old in out.glob("*"):
        if old.name.startswith(PART_PREFIX) or old.name in ("manifest.json", "install.sh"):
            old.unlink()
    _log(progress, f"writing {len(entries)} wheels as parts of at most {req.part_size / 2**20:g} MiB")
    written = split_into_parts(sorted(paths, key=lambda p: p.name), out, req.part_size)
    shutil.rmtree(build_dir, ignore_errors=True)

    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "created_by": f"k3pipe bundle ({own_version or 'engine only'})",
        "target": target.as_dict(),
        "requirements": {
            ENGINE: list(req.engine),
            PIPELINE: ([f"{own_name}=={own_version}", *own_deps] if project else []),
        },
        "groups": sorted(group_files),
        "node_freeze": {
            "file": str(req.node_freeze) if req.node_freeze else None,
            "sha256": hashlib.sha256(freeze_text.encode()).hexdigest(),
            "packages": len(installed),
        },
        "options": {"upgrade": sorted(upgrade), "keep_node": sorted(keep), "omit": sorted(omit)},
        "expected_pip_check": sorted(keep | omit | {canonical_name(n) for n in dropped}),
        "smoke_imports": {
            ENGINE: [_import_name(r) for r in req.engine],
            PIPELINE: list(PIPELINE_SMOKE_IMPORTS) if project else [],
        },
        "smoke_commands": {
            ENGINE: [],
            PIPELINE: [list(c) for c in PIPELINE_SMOKE_COMMANDS] if project else [],
        },
        "notes": list(req.notes),
        "resolved": [{"name": p.name, "version": p.version, "groups": list(p.groups)} for p in pins],
        "wheels": sorted(entries, key=lambda e: e["filename"]),
        "left_out": left_out,
        "wheels_size": sum(e["size"] for e in entries),
        "part_size": req.part_size,
        **written,
    }
    text = json.dumps(manifest, indent=2) + "\n"
    (out / "manifest.json").write_text(text)
    script = out / "install.sh"
    script.write_text(INSTALL_SH.replace("@MANIFEST_SHA256@", hashlib.sha256(text.encode()).hexdigest()))
    script.chmod(0o755)
    return BundleResult(out, manifest)


def _import_name(requirement: str) -> str:
    name = re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]
    return name.replace("-", "_").lower()


def _wheel_entry(path: Path, name: str, version: str, groups: tuple[str, ...]) -> dict[str, Any]:
    return {
        "filename": path.name,
        "name": name,
        "version": version,
        "size": path.stat().st_size,
        "sha256": _sha256_file(path),
        "groups": list(groups),
    }


def _cached_wheel(pin: Pin, target: Target, cache: Path) -> Path | None:
    found = []
    for path in cache.glob("*.whl"):
        parsed = _parse_wheel_filename(path.name)
        if (
            parsed
            and canonical_name(parsed[0]) == pin.key
            and _same_version(parsed[1], pin.version)
            and wheel_is_compatible(path.name, target)
        ):
            found.append(path)
    return max(found, key=lambda p: _wheel_rank(p.name, target)) if found else None


def _download(
    pins: list[Pin], target: Target, cache: Path, home: Path, index_url: str | None, progress: Any
) -> dict[str, Path]:
    """Every pin's wheel for ``target``, from the cache or ``pip download --no-deps``."""
    have: dict[str, Path] = {}
    missing: list[Pin] = []
    for pin in pins:
        hit = _cached_wheel(pin, target, cache)
        if hit is not None:
            have[pin.key] = hit
        else:
            missing.append(pin)
    _log(progress, f"{len(have)} wheels from the cache ({cache}), {len(missing)} to download")
    if missing:
        argv = [
            _tools_python(home), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", target.python_version, "--implementation", target.implementation,
            "--abi", target.python_tag, "--abi", "abi3", "--abi", "none",
            "--disable-pip-version-check", "--progress-bar", "off", "-d", str(cache),
        ]  # fmt: skip
        for tag in compatible_platform_tags(target.platform):
            argv += ["--platform", tag]
        if index_url:
            argv += ["--index-url", index_url]
        argv += [f"{pin.name}=={pin.version}" for pin in missing]
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            tail = proc.stderr.strip()[-3000:]
            raise BundleError(
                f"pip download failed for {len(missing)} wheel(s) for {target.python_tag} on "
                f"{target.platform}:\n{tail}\nA package without a wheel for this target cannot be bundled: "
                "pick another version, --omit it if the node does not need it, or --keep-node the node's copy"
            )
        for pin in missing:
            hit = _cached_wheel(pin, target, cache)
            if hit is None:
                raise BundleError(
                    f"pip download reported success but no wheel of {pin.name}=={pin.version} for "
                    f"{target.python_tag}/{target.platform} is in {cache}"
                )
            have[pin.key] = hit
    return have


def _build_own_wheel(uv: str, project: Path, out: Path, cache: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _run(
        [uv, "build", "--wheel", "--out-dir", str(out), "--no-python-downloads",
         "--cache-dir", str(cache / "uv"), "--quiet", str(project)],
        "building k3pipe's wheel",
    )  # fmt: skip
    built = sorted(out.glob("*.whl"))
    if len(built) != 1:
        raise BundleError(f"building k3pipe's wheel left {len(built)} wheels in {out}")
    return built[0]


def iter_manifest_wheels(manifest: dict[str, Any], group: str) -> Iterator[dict[str, Any]]:
    """The manifest's wheels that ``group`` (engine or pipeline) needs."""
    for entry in manifest["wheels"]:
        if group in entry["groups"]:
            yield entry


# ---------------------------------------------------------------------------------------------
# the installer shipped in the bundle: bash + python3 standard library only

INSTALL_SH = (Path(__file__).with_name("install.sh")).read_text()
"""The installer shipped in every bundle (``k3pipe/ops/install.sh``, a script file of its own: ``bash -n`` and
its Python part are checked by the tests); ``@MANIFEST_SHA256@`` is the manifest's digest."""
