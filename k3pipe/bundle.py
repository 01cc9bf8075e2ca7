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

from k3pipe.errors import K3pipeError

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
PIPELINE_SMOKE_IMPORTS = ["cli.main", "flows.benchmark", "prefect.server.api.server", "mlflow"]
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
        from uv import find_uv_bin  # type: ignore[import-not-found]

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
    root = given or Path(__file__).resolve().parents[1]
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

INSTALL_SH = r'''#!/usr/bin/env bash
# k3pipe offline bundle installer (written by `k3pipe bundle`): bash + python3 standard library.
# Verifies every part against manifest.json, reassembles the wheels, verifies every wheel, and
# installs them with pip --no-index --no-deps into a venv (new ones get --system-site-packages, so
# the node's own torch, CUDA libraries etc. are used; when the interpreter is itself a venv, a .pth
# file makes the new venv see that venv's packages too, behind its own), then imports what
# 'k3pipe run' imports. Run with --help for the options.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${K3PIPE_INSTALL_PYTHON:-python3}"
for arg in "$@"; do
  case "$arg" in --python=*) PY="${arg#--python=}";; esac
done
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install.sh: error: '$PY' not found: install python3 or pass --python=/path/to/python3" >&2
  exit 2
fi
exec "$PY" - "$HERE" "@MANIFEST_SHA256@" "$@" <<'PYEOF'
import argparse, hashlib, json, os, platform, shutil, subprocess, sys, tarfile, tempfile, time
from pathlib import Path

HERE, MANIFEST_SHA = Path(sys.argv[1]), sys.argv[2]
CHUNK = 1 << 20
STEP = [0]

def say(msg):
    print(msg, flush=True)

def step(msg):
    STEP[0] += 1
    say(f"[{STEP[0]}] {msg}")

def die(msg, code=2):
    print(f"install.sh: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)

ap = argparse.ArgumentParser(prog="install.sh", description="Install a k3pipe offline bundle.",
    formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""layouts:
  one (default)  engine and pipeline in one venv: --venv DIR
  two            engine in --engine-venv DIR, pipeline (k3pipe, Prefect, MLflow) in --pipeline-venv DIR
An existing venv (DIR/bin/python exists) is installed into as it is; otherwise a new one is made.""")
ap.add_argument("--python", default=sys.executable,
    help="interpreter for new venvs; if it is itself a venv, new venvs see its packages too (default: %(default)s)")
ap.add_argument("--parts", type=Path, default=HERE, help="directory holding the parts (default: this script's)")
ap.add_argument("--layout", choices=["one", "two"], default="one")
ap.add_argument("--groups", default=None, help="with --layout one: install only these groups (engine,pipeline)")
ap.add_argument("--venv", type=Path, default=Path.home() / "k3pipe-venv")
ap.add_argument("--engine-venv", type=Path, default=Path.home() / "k3pipe-engine-venv")
ap.add_argument("--pipeline-venv", type=Path, default=Path.home() / "k3pipe-pipeline-venv")
ap.add_argument("--no-system-site-packages", action="store_true", help="new venvs without the node's packages")
ap.add_argument("--work", type=Path, default=None, help="where the wheels are unpacked (default: PARTS/wheels)")
ap.add_argument("--keep-wheels", action="store_true", help="keep the unpacked wheels afterwards")
ap.add_argument("--verify-only", action="store_true", help="verify the parts and stop")
ap.add_argument("--check-only", action="store_true",
    help="install nothing: run the import checks and pip check in the venv(s) and stop")
ap.add_argument("--skip-target-check", action="store_true", help="install even if the interpreter or glibc differ")
args = ap.parse_args(sys.argv[3:])

manifest_path = HERE / "manifest.json"
if not manifest_path.exists():
    die(f"{manifest_path} is missing: copy manifest.json from the bundle next to install.sh")
if sha256(manifest_path) != MANIFEST_SHA:
    die(f"{manifest_path} does not match this install.sh (sha256 differs): copy both files from the same bundle again")
manifest = json.loads(manifest_path.read_text())
target = manifest["target"]
groups = manifest["groups"]

step(f"checking the target: CPython {target['python_version']}, {target['platform']}")
base = Path(args.python)
probe = subprocess.run([str(base), "-c", "import json,platform,sys,sysconfig;p=sysconfig.get_paths();"
    "print(json.dumps({'version':'%d.%d'%sys.version_info[:2],'impl':platform.python_implementation(),"
    "'libc':'-'.join(platform.libc_ver()),'machine':platform.machine(),'prefix':sys.prefix,"
    "'base_prefix':sys.base_prefix,'site':list(dict.fromkeys([p['purelib'],p['platlib']]))}))"],
    capture_output=True, text=True)
if probe.returncode != 0:
    die(f"cannot run {base}: {probe.stderr.strip()}")
info = json.loads(probe.stdout)
pyver, impl, libc, machine = info["version"], info["impl"], info["libc"], info["machine"]
# the interpreter is itself a venv: a venv made from it with --system-site-packages sees the packages of
# its base interpreter (sys.base_prefix), not its own; those are added to new venvs by a .pth file
parent_site = [d for d in info["site"] if os.path.isdir(d)] if info["prefix"] != info["base_prefix"] else []
problems = []
if pyver != target["python_version"] or impl != "CPython":
    problems.append(f"{base} is {impl} {pyver}; the bundle is for CPython {target['python_version']}: pass --python /path/to/python{target['python_version']}")
if libc.startswith("glibc-"):
    have = tuple(int(x) for x in libc[6:].split(".")[:2])
    need = tuple(int(x) for x in target["glibc_min"].split("."))
    if have < need:
        problems.append(f"glibc {libc[6:]} is older than the {target['glibc_min']} the wheels need ({target['platform']})")
else:
    problems.append(f"this system's C library is {libc or 'unknown'}, the wheels need glibc {target['glibc_min']}")
if machine != target["arch"]:
    problems.append(f"this machine is {machine}, the wheels are for {target['arch']}")
if problems and not args.skip_target_check:
    die("the bundle does not fit this machine:\n  " + "\n  ".join(problems) + "\n(--skip-target-check installs anyway)")
say(f"    {base}: {impl} {pyver}, {libc}, {machine}: ok")
if parent_site:
    say(f"    {base} is itself a venv ({info['prefix']}, made from {info['base_prefix']}): "
        + ("new venvs get a .pth file that adds its site-packages behind their own"
           if not args.no_system_site_packages else "--no-system-site-packages: new venvs will not see its packages"))

if args.layout == "one":
    chosen = args.groups.split(",") if args.groups else groups
    for g in chosen:
        if g not in groups:
            die(f"--groups {g}: this bundle holds {', '.join(groups)}")
    plan = [(args.venv, chosen)]
else:
    plan = [(v, [g]) for v, g in ((args.engine_venv, "engine"), (args.pipeline_venv, "pipeline")) if g in groups]

def pip_for(venv):
    py = venv / "bin" / "python"
    if subprocess.run([str(py), "-c", "import pip"], capture_output=True).returncode == 0:
        return [str(py), "-m", "pip"]
    return [str(base), "-m", "pip", "--python", str(py)]

def add_parent_site(venv):
    """Make a new venv see the parent venv's site-packages, after its own (its packages win)."""
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        die(f"cannot ask {venv}/bin/python for its site-packages: {r.stderr.strip()}")
    pth = Path(r.stdout.strip()) / "_k3pipe_parent_venv.pth"
    # an 'import' line of a .pth runs at start-up, after the venv's own site-packages is on sys.path;
    # addsitedir appends (so the venv's own packages come first) and reads the parent's .pth files too
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in parent_site))
    say(f"    {base} is a venv: {pth} adds {', '.join(parent_site)} behind {venv}'s own packages")

def sees_parent(venv):
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                       capture_output=True, text=True)
    return all(d in r.stdout.splitlines() for d in parent_site)

def check_venv(venv, gs):
    """Import what the groups run ('k3pipe run': Prefect's server too), run their commands, pip check."""
    unexpected = 0
    imports = [m for g in gs for m in manifest.get("smoke_imports", {}).get(g, [])]
    commands = [c for g in gs for c in manifest.get("smoke_commands", {}).get(g, [])]
    with tempfile.TemporaryDirectory(prefix="k3pipe-install-check-") as scratch:
        env = {**os.environ, "PREFECT_HOME": os.path.join(scratch, "prefect"), "K3PIPE_HOME": os.path.join(scratch, "k3pipe")}
        for mod in imports:
            t0 = time.perf_counter()
            r = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {mod}; print(getattr({mod}, '__version__', ''))"],
                               capture_output=True, text=True, cwd=scratch, env=env)
            if r.returncode != 0:
                die(f"'import {mod}' fails in {venv}:\n{r.stderr.strip()[-3000:]}\n"
                    "A package it needs is not in the venv: was it left out of the bundle (manifest.json left_out)?", code=1)
            say(f"    import {mod}: ok {r.stdout.strip()} ({time.perf_counter() - t0:.1f} s)")
        for cmd in commands:
            t0 = time.perf_counter()
            r = subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], capture_output=True, text=True, cwd=scratch, env=env)
            if r.returncode != 0:
                die(f"'{' '.join(cmd)}' fails in {venv} (exit {r.returncode}):\n{(r.stdout + r.stderr).strip()[-3000:]}", code=1)
            say(f"    {' '.join(cmd)}: ok ({time.perf_counter() - t0:.1f} s)")

    step(f"pip check in {venv}")
    pip = pip_for(venv)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    lines = [l for l in (check.stdout + check.stderr).splitlines() if l.strip()]
    expected_names = set(manifest.get("expected_pip_check", []))
    def canon(s):
        import re
        return re.sub(r"[-_.]+", "-", s).lower()
    if not lines or check.returncode == 0:
        say("    pip check: no problems")
        lines = []
    for line in lines:
        words = {canon(w.strip(",.:;")) for w in line.split()}
        tag = "expected: left out on purpose (see manifest.json left_out)" if words & expected_names else "NOT expected"
        if tag == "NOT expected":
            unexpected += 1
        say(f"    pip check: {line}   [{tag}]")
    return unexpected

def report(unexpected_total):
    say("")
    for note in manifest.get("notes", []):
        say(f"note: {note}")
    for venv, gs in plan:
        say(f"done: {'+'.join(gs)} in {venv.expanduser().absolute()}")
    if unexpected_total:
        say(f"pip check reported {unexpected_total} problem(s) the bundle did not expect (shown above); "
            "they may be the node's own (with --system-site-packages pip check sees the node's packages too)")

if args.check_only:
    total_unexpected = 0
    for venv, gs in plan:
        venv = venv.expanduser().absolute()
        if not (venv / "bin" / "python").exists():
            die(f"--check-only: {venv} is no venv (no bin/python)")
        step(f"checking {venv} ({'+'.join(gs)}; --check-only: installing nothing)")
        total_unexpected += check_venv(venv, gs)
    report(total_unexpected)
    sys.exit(0)

parts = manifest["parts"]
total = sum(p["size"] for p in parts)
step(f"verifying {len(parts)} parts ({total / 2**20:.1f} MiB) in {args.parts}")
missing, bad = [], []
for i, p in enumerate(parts, 1):
    path = args.parts / p["name"]
    label = f"part {i} of {len(parts)} ({p['name']})"
    if not path.exists():
        missing.append(f"{label} is missing: copy it from the bundle again (size {p['size']} bytes, sha256 {p['sha256']})")
        continue
    size = path.stat().st_size
    if size != p["size"]:
        bad.append(f"{label} has {size} bytes, expected {p['size']} (an incomplete copy?): copy it again")
        continue
    t0 = time.perf_counter()
    digest = sha256(path)
    if digest != p["sha256"]:
        bad.append(f"{label} is corrupt: sha256 {digest}, expected {p['sha256']}: copy it again")
        continue
    say(f"    {label}: {size / 2**20:.1f} MiB, sha256 ok ({time.perf_counter() - t0:.1f} s)")
if missing or bad:
    die(f"{len(missing) + len(bad)} of {len(parts)} parts cannot be used:\n  " + "\n  ".join(missing + bad)
        + f"\nNothing was installed. Each part is checked on its own: only the parts named above need copying again.")
if args.verify_only:
    say("all parts verified (--verify-only: stopping here)")
    sys.exit(0)

work = args.work or (args.parts / "wheels")
step(f"reassembling {len(manifest['wheels'])} wheels into {work}")
if work.exists():
    shutil.rmtree(work)
work.mkdir(parents=True)

class Chain:
    def __init__(self, paths):
        self.paths, self.fh = list(paths), None
    def read(self, n=-1):
        out = bytearray()
        while n < 0 or len(out) < n:
            if self.fh is None:
                if not self.paths:
                    break
                self.fh = open(self.paths.pop(0), "rb")
            b = self.fh.read(-1 if n < 0 else n - len(out))
            if not b:
                self.fh.close(); self.fh = None
                continue
            out += b
        return bytes(out)

expected = {w["filename"]: w for w in manifest["wheels"]}
with tarfile.open(fileobj=Chain(args.parts / p["name"] for p in parts), mode="r|") as tar:
    for member in tar:
        name = os.path.basename(member.name)
        if not member.isfile() or member.name != "wheels/" + name or name not in expected:
            die(f"the bundle holds an unexpected entry {member.name!r}: rebuild it with k3pipe bundle")
        src = tar.extractfile(member)
        with open(work / name, "wb") as fh:
            shutil.copyfileobj(src, fh, CHUNK)

step(f"verifying {len(expected)} wheels")
wrong = []
for name, w in sorted(expected.items()):
    path = work / name
    if not path.exists():
        wrong.append(f"{name} is not in the parts")
    elif path.stat().st_size != w["size"] or sha256(path) != w["sha256"]:
        wrong.append(f"{name} does not match its sha256/size in manifest.json")
if wrong:
    die("the parts verified but the wheels do not (the bundle is inconsistent: rebuild it with k3pipe bundle):\n  " + "\n  ".join(wrong))
say(f"    all {len(expected)} wheels match the manifest")

unexpected_total = 0
for venv, gs in plan:
    venv = venv.expanduser().absolute()
    files = sorted(w["filename"] for w in manifest["wheels"] if set(w["groups"]) & set(gs))
    if (venv / "bin" / "python").exists():
        step(f"installing {len(files)} wheels ({'+'.join(gs)}) into the existing venv {venv}")
        if parent_site and not args.no_system_site_packages and not sees_parent(venv):
            say(f"    warning: {venv} does not see the packages of {info['prefix']} (the venv {base} belongs to); "
                "install.sh leaves an existing venv as it is: remove it to have it made with a .pth that adds them")
    else:
        flags = [] if args.no_system_site_packages else ["--system-site-packages"]
        step(f"creating {venv} ({' '.join(flags) or 'isolated'}) and installing {len(files)} wheels ({'+'.join(gs)})")
        made = subprocess.run([str(base), "-m", "venv", *flags, str(venv)], capture_output=True, text=True)
        if made.returncode != 0:
            # Debian/Ubuntu without python3-venv have no ensurepip: make the venv without pip and
            # install with the base interpreter's pip (pip >= 22.3 has --python)
            shutil.rmtree(venv, ignore_errors=True)
            again = subprocess.run([str(base), "-m", "venv", "--without-pip", *flags, str(venv)], capture_output=True, text=True)
            if again.returncode != 0:
                die(f"cannot create the venv {venv}:\n{made.stderr.strip()}\n{again.stderr.strip()}")
        if parent_site and not args.no_system_site_packages:
            add_parent_site(venv)
    pip = pip_for(venv)
    t0 = time.perf_counter()
    cmd = [*pip, "install", "--no-index", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
           "--progress-bar", "off", *[str(work / f) for f in files]]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        die(f"pip install into {venv} failed (exit {proc.returncode}); its output is above. The wheels are verified, "
            f"so look for a disk-space or permission problem, or a wheel this interpreter does not accept")
    say(f"    installed in {time.perf_counter() - t0:.0f} s")

    unexpected_total += check_venv(venv, gs)

if not args.keep_wheels:
    shutil.rmtree(work, ignore_errors=True)
report(unexpected_total)
PYEOF
'''  # noqa: E501
