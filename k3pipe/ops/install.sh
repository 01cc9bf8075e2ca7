#!/usr/bin/env bash
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
