"""The product's OCI image, assembled here without Docker: what the Dockerfile describes, built by
our own code from what is on this machine, so the Helm chart can run on the real node.

    python tools/image.py build --out DIR [--no-cache]   # DIR/k8s-dispatch-<tag>.oci.tar
    make image                                           # the same, into dist/

Two layers, each a plain tar (images.py's writer, no compression: a layer's digest is its diff_id):

- the base: Debian's python3.X of the venv's minor version, its standard library, tzdata, dash as
  /bin/sh (the chart's probes are shell one-liners) and CA certificates, taken from the packages installed
  here (every file checked against dpkg's md5sums, so a file changed on this host is refused),
  laid out merged-/usr as Debian's own images are; /etc/passwd and /etc/group with the user 10001;
- the app: a virtualenv at /opt/venv with exactly requirements.lock (downloaded by pip with the
  lock's hashes, markers judged for the image's Python, not this one) and the product's wheel,
  installed by the small wheel installer below (console scripts point at /opt/venv/bin/python).

Both with their bytecode (unchecked hash-based .pyc): on a read-only root filesystem a process
would otherwise compile everything it imports at every start, which on a busy node under a small
CPU request outlasts the liveness probes.

Reproducible: every entry's time is SOURCE_DATE_EPOCH (else the HEAD commit's time), every owner
numeric and fixed, entries sorted, JSON canonical; the same packages, lock, wheel and epoch give
the same digest. The result is cached under ~/.cache/k8s-dispatch/image keyed by those inputs.
The version label is the package's (setuptools-scm); the tag is its SemVer form with `+` as `_`
(a tag cannot hold `+`), which is what the chart's default tag makes of its appVersion.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import importlib.util
import json
import os
import pickle
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from packaging.markers import Marker, default_environment

from k8s_dispatch.lab.realcluster import images
from k8s_dispatch.lab.realcluster.images import Entry, ImageBuildFailed

ROOT = Path(__file__).resolve().parent.parent

REPOSITORY = "docker.io/library/k8s-dispatch"  # what the kubelet makes of the chart's `k8s-dispatch`
VENV = "opt/venv"
APP = "app"
UID = GID = 10001  # Dockerfile's USER, the chart's runAsUser
CMD = ("celery", "-A", "k8s_dispatch.tasks", "worker", "--loglevel=INFO")  # the Dockerfile's
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k8s-dispatch" / "image"
PATH_ENV = f"PATH=/{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the interpreter needs, the time zones (zoneinfo: kombu asks for UTC), a /bin/sh (the chart's
# probes are shell one-liners), /etc/services and the CA bundle; their dependencies follow.
ROOTS = ("python{minor}-minimal", "libpython{minor}-stdlib", "tzdata", "dash", "netbase", "ca-certificates")
# Dependencies no running Python needs: packaging tools, the shells' helpers, configuration.
EXCLUDED = frozenset({
    "base-files", "coreutils", "debconf", "debianutils", "dpkg", "gcc-12-base", "install-info", "libc-bin",
    "media-types", "mime-support", "perl-base", "readline-common", "tar",
})  # fmt: skip
DROPPED = ("usr/share/doc/", "usr/share/man/", "usr/share/info/", "usr/share/lintian/", "usr/share/menu/",
           "usr/share/bug/", "usr/share/debianutils/")  # fmt: skip
MERGED = ("bin", "sbin", "lib", "lib64")  # merged /usr: /bin is usr/bin, as in Debian's images


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    arch: str
    depends: str  # Pre-Depends and Depends, as dpkg-query prints them


@dataclass(frozen=True)
class Built:
    name: str
    path: Path
    digest: str
    size: int
    seconds: float
    cached: bool


# --- the base: Debian's packages as installed here ----------------------------------------------


def installed_packages() -> dict[str, Package]:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\t${Architecture}\t${Pre-Depends}, ${Depends}\n"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        status, name, version, arch, depends = line.split("\t")
        if status.startswith("ii"):
            found[name] = Package(name, version, arch, depends)
    return found


def closure(roots: list[str], installed: dict[str, Package]) -> list[Package]:
    """`roots` and what they depend on (the first installed alternative), minus EXCLUDED."""
    chosen: dict[str, Package] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in chosen or name in EXCLUDED:
            continue
        if name not in installed:
            raise ImageBuildFailed(f"Debian's {name} is not installed here: apt-get install {name}")
        chosen[name] = pkg = installed[name]
        for dep in filter(None, (d.strip() for d in pkg.depends.split(","))):
            alternatives = [re.split(r"[\s(:]", a.strip(), maxsplit=1)[0] for a in dep.split("|")]
            todo.append(next((a for a in alternatives if a in installed), alternatives[0]))
    return sorted(chosen.values(), key=lambda p: p.name)


def _dpkg_info(pkg: Package, suffix: str) -> Path:
    for name in (f"{pkg.name}:{pkg.arch}", pkg.name):
        path = Path("/var/lib/dpkg/info") / f"{name}.{suffix}"
        if path.exists():
            return path
    return Path("/var/lib/dpkg/info") / f"{pkg.name}.{suffix}"


def _merged(path: str) -> str:
    top, _, rest = path.partition("/")
    return f"usr/{top}/{rest}" if top in MERGED and rest else path


def _dropped(path: str) -> bool:
    return path.startswith(DROPPED) and not (path.startswith("usr/share/doc/") and path.endswith("/copyright"))


def package_entries(pkg: Package) -> list[Entry]:
    """The files `pkg` installed here, as it shipped them: regular files from dpkg's md5sums (each
    checked), symlinks from its file list, unmodified conffiles."""
    entries: dict[str, Entry] = {}
    md5sums = _dpkg_info(pkg, "md5sums")
    wanted: list[tuple[str, str]] = []
    if md5sums.exists():
        wanted = [(p.strip(), m) for m, _, p in (line.partition("  ") for line in md5sums.read_text().splitlines())]
    conffiles = subprocess.run(["dpkg-query", "-W", "-f", "${Conffiles}", pkg.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    for line in conffiles.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1] != "newconffile" and "obsolete" not in fields[2:]:
            wanted.append((fields[0].lstrip("/"), fields[1]))
    for rel, md5 in wanted:
        if _dropped(rel):
            continue
        host = Path("/") / rel
        if not host.is_file():
            raise ImageBuildFailed(f"{host} of {pkg.name} is missing here: apt-get install --reinstall {pkg.name}")
        data = host.read_bytes()
        if hashlib.md5(data).hexdigest() != md5:
            raise ImageBuildFailed(
                f"{host} differs from what {pkg.name} shipped: apt-get install --reinstall {pkg.name}"
            )
        entries[_merged(rel)] = Entry(_merged(rel), 0o755 if host.stat().st_mode & 0o111 else 0o644, data=data)
    listed = subprocess.run(["dpkg-query", "-L", pkg.name], capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines():
        rel = line.strip().lstrip("/")
        if not line.startswith("/") or rel in MERGED or _dropped(rel) or _merged(rel) in entries:
            continue
        host = Path("/") / rel
        if host.is_symlink():
            entries[_merged(rel)] = Entry(_merged(rel), 0o777, target=os.readlink(host))
    return list(entries.values())


def _etc(python: str) -> list[Entry]:
    """The files no package gives an image: users, name lookup, the merged-/usr links."""
    passwd = f"root:x:0:0:root:/root:/usr/sbin/nologin\nk8s-dispatch:x:{UID}:{GID}::/{APP}:/usr/sbin/nologin\n"
    group = f"root:x:0:\nk8s-dispatch:x:{GID}:\n"
    nsswitch = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n"
    return [
        Entry("etc/passwd", 0o644, data=passwd.encode()),
        Entry("etc/group", 0o644, data=group.encode()),
        Entry("etc/nsswitch.conf", 0o644, data=nsswitch.encode()),
        *(Entry(top, 0o777, target=f"usr/{top}") for top in MERGED),
        Entry("usr/bin/python3", 0o777, target=f"python{python}"),
        *(Entry(d, 0o755) for d in ("dev", "proc", "sys", "root", "run", "var/tmp")),
        Entry("tmp", 0o1777),
        Entry(APP, 0o755),
    ]


def _ca_bundle(entries: list[Entry]) -> Entry:
    """/etc/ssl/certs/ca-certificates.crt as update-ca-certificates makes it: every Mozilla root, in order."""
    certs = sorted((e for e in entries if e.path.startswith("usr/share/ca-certificates/mozilla/") and e.data),
                   key=lambda e: e.path)  # fmt: skip
    return Entry("etc/ssl/certs/ca-certificates.crt", 0o644, data=b"".join(e.data or b"" for e in certs))


def base_entries(packages: list[Package], python: str) -> tuple[Entry, ...]:
    files: dict[str, Entry] = {}
    for pkg in packages:
        for entry in package_entries(pkg):
            files[entry.path] = entry
        status = subprocess.run(["dpkg-query", "-s", pkg.name], capture_output=True, check=True).stdout
        files[f"var/lib/dpkg/status.d/{pkg.name}"] = Entry(f"var/lib/dpkg/status.d/{pkg.name}", 0o644, data=status)
    for entry in (*_etc(python), _ca_bundle(list(files.values()))):
        files[entry.path] = entry
    os_release = Path("/usr/lib/os-release")
    if os_release.is_file():  # what image scanners read to know the distribution
        files["usr/lib/os-release"] = Entry("usr/lib/os-release", 0o644, data=os_release.read_bytes())
        files["etc/os-release"] = Entry("etc/os-release", 0o777, target="../usr/lib/os-release")
    return tuple(files[p] for p in sorted(files))


# --- the app: the locked virtualenv and the product's wheel ---------------------------------------


def locked_requirements(lock: str, environment: dict[str, str]) -> list[str]:
    """requirements.lock's `name==version --hash=...` lines whose markers hold in `environment`
    (the image's Python, which pip would not judge: it judges the Python it runs on)."""
    joined = re.sub(r"\\\n\s*", " ", lock)
    lines = []
    for raw in joined.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, rest = line.partition(" --hash")
        spec, _, marker = requirement.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(environment):
            continue
        lines.append(f"{spec.strip()} --hash{rest}")
    return lines


def download_wheels(requirements: list[str], cache: Path) -> list[Path]:
    """The locked wheels (hashes checked by pip), kept in `cache` under the requirements' digest."""
    text = "\n".join(requirements) + "\n"
    directory = cache / "wheels" / hashlib.sha256(text.encode()).hexdigest()[:16]
    if not (directory / ".complete").exists():
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        (directory / "requirements.txt").write_text(text)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--require-hashes", "-r", str(directory / "requirements.txt"), "-d", str(directory)],
            check=True,
        )  # fmt: skip
        (directory / ".complete").touch()
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != len(requirements):
        raise ImageBuildFailed(f"{len(requirements)} requirements gave {len(wheels)} wheels in {directory}")
    return wheels


def product_wheel(directory: Path) -> Path:
    """The package's wheel from the working tree, at setuptools-scm's version."""
    uv = Path(sys.executable).parent / "uv"
    argv = ([str(uv), "build", "--wheel", "--quiet", "--out-dir", str(directory), str(ROOT)] if uv.exists() else
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(directory), str(ROOT)])  # fmt: skip
    subprocess.run(argv, check=True, env={**os.environ, "SOURCE_DATE_EPOCH": str(source_date_epoch())})
    [wheel] = directory.glob("k8s_dispatch-*.whl")
    return wheel


_SCRIPT = """#!/{venv}/bin/python
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {name}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({call}())
"""


def wheel_entries(wheel: Path, python: str) -> list[Entry]:
    """A wheel installed into the image's venv as pip would: its files in site-packages (.data's
    where they belong), its console scripts in bin/ pointing at the venv's python."""
    site = f"{VENV}/lib/python{python}/site-packages"
    places = {"purelib": site, "platlib": site, "scripts": f"{VENV}/bin", "data": VENV,
              "headers": f"{VENV}/include/site/python{python}"}  # fmt: skip
    entries = []
    with zipfile.ZipFile(wheel) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            data = z.read(info)
            mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            top, _, rest = info.filename.partition("/")
            if top.endswith(".data"):
                kind, _, rest = rest.partition("/")
                path = f"{places[kind]}/{rest}"
                if kind == "scripts":
                    mode = 0o755
                    if data.startswith(b"#!python"):
                        data = f"#!/{VENV}/bin/python".encode() + data[len(b"#!python") :]
            else:
                path = f"{site}/{info.filename}"
            entries.append(Entry(path, mode, data=data))
            if info.filename.endswith(".dist-info/entry_points.txt"):
                entries += _scripts(data.decode())
        dist_info = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))
    entries.append(Entry(f"{site}/{dist_info}/INSTALLER", 0o644, data=b"k8s-dispatch tools/image.py\n"))
    return entries


def _scripts(entry_points: str) -> list[Entry]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # names are case-sensitive
    parser.read_string(entry_points)
    scripts = []
    for section in ("console_scripts", "gui_scripts"):
        for script, target in parser.items(section) if parser.has_section(section) else []:
            module, _, attr = target.partition(":")
            name = attr.split(".")[0].strip()
            text = _SCRIPT.format(venv=VENV, module=module.strip(), name=name, call=attr.strip())
            scripts.append(Entry(f"{VENV}/bin/{script}", 0o755, data=text.encode()))
    return scripts


def venv_entries(wheels: list[Path], python: str, full_version: str) -> tuple[Entry, ...]:
    files: dict[str, Entry] = {}
    for wheel in wheels:
        for entry in wheel_entries(wheel, python):
            if entry.path in files and files[entry.path].data != entry.data:
                raise ImageBuildFailed(f"two wheels install {entry.path} differently ({wheel.name})")
            files[entry.path] = entry
    cfg = f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {full_version}\nexecutable = /usr/bin/python{python}\n"
    for entry in (
        Entry(f"{VENV}/pyvenv.cfg", 0o644, data=cfg.encode()),
        Entry(f"{VENV}/bin/python", 0o777, target=f"/usr/bin/python{python}"),
        Entry(f"{VENV}/bin/python3", 0o777, target="python"),
        Entry(f"{VENV}/bin/python{python}", 0o777, target="python"),
        Entry(f"{VENV}/lib64", 0o777, target="lib"),
    ):
        files[entry.path] = entry
    return tuple(files[p] for p in sorted(files))


# Run in a fresh, isolated interpreter with a fixed hash seed: marshal flags a string as interned or
# shared by the state of the process that writes it, and a set constant's order follows the hash
# seed, so bytecode written by a long-lived process differs from one build to the next.
_COMPILE = """
import importlib.util, pickle, sys
from importlib._bootstrap_external import _code_to_hash_pyc
made = []
for path, data in pickle.load(sys.stdin.buffer):
    try:
        code = compile(data, "/" + path, "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError):
        made.append(None)
        continue
    made.append(bytes(_code_to_hash_pyc(code, importlib.util.source_hash(data), checked=False)))
pickle.dump(made, sys.stdout.buffer)
"""
BATCH = 256  # modules per interpreter; fixed, so each batch's output depends on its sources alone


def _compile_batch(batch: list[tuple[str, bytes]]) -> list[bytes | None]:
    env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")}
    done = subprocess.run([sys.executable, "-I", "-S", "-W", "ignore", "-c", _COMPILE], input=pickle.dumps(batch),
                          capture_output=True, env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        raise ImageBuildFailed(f"compiling bytecode failed: {done.stderr.decode(errors='replace')[-2000:]}")
    made: list[bytes | None] = pickle.loads(done.stdout)
    return made


def with_bytecode(entries: tuple[Entry, ...], under: str) -> tuple[Entry, ...]:
    """`entries` and, for each module below `under`, its bytecode in __pycache__, as the image's
    Python would write it (same magic: bytecode is stable within a minor version) were its root
    filesystem writable: without it every process compiles what it imports at each start. Unchecked
    hash-based .pyc (PEP 552): no source time inside, never revalidated (the image never changes).
    A module that does not compile (a template, another Python's file) is left without."""
    sources = [(e.path, e.data) for e in entries if e.path.startswith(under) and e.path.endswith(".py") and e.data]
    batches = [sources[i : i + BATCH] for i in range(0, len(sources), BATCH)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = [pyc for batch in pool.map(_compile_batch, batches) for pyc in batch]
    made = []
    for (path, _), data in zip(sources, compiled, strict=True):
        if data is not None:
            directory, _, name = path.rpartition("/")
            pyc = f"{directory}/__pycache__/{name[:-3]}.{sys.implementation.cache_tag}.pyc"
            made.append(Entry(pyc, 0o644, data=data))
    return tuple(sorted((*entries, *made), key=lambda e: e.path))


# --- the image ------------------------------------------------------------------------------------


def source_date_epoch() -> int:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                         check=False).stdout.strip()  # fmt: skip
    return int(out) if out.isdigit() else 0


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def image_tag(version: str) -> str:
    """The tag of a PEP 440 version: its SemVer (the chart's appVersion, tools/release.py) with `+`
    as `_`."""
    spec = importlib.util.spec_from_file_location("k8s_dispatch_tools_release", ROOT / "tools" / "release.py")
    assert spec is not None and spec.loader is not None
    release = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(release)
    return str(release.semver(version)).replace("+", "_")


def _key(parts: list[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:24]


def build(out: Path, *, use_cache: bool = True, cache: Path = CACHE, wheel: Path | None = None) -> Built:
    """Build the image (or take it from the cache when nothing it is made of changed) into `out`,
    with `wheel` as the product's (default: one built from the working tree)."""
    started = time.monotonic()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    installed = installed_packages()
    packages = closure([r.format(minor=python) for r in ROOTS], installed)
    interpreter = installed[f"python{python}-minimal"]
    full_version = interpreter.version.split("-")[0].split(":")[-1]
    environment: dict[str, str] = {**{k: str(v) for k, v in default_environment().items()}, "python_full_version": full_version, "python_version": python,
                   "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux"}  # fmt: skip
    lock = (ROOT / "requirements.lock").read_text()
    epoch = source_date_epoch()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or product_wheel(Path(tmp))
        version = wheel_version(wheel)
        locked = download_wheels(locked_requirements(lock, environment), cache)
        name = f"{REPOSITORY}:{image_tag(version)}"
        with zipfile.ZipFile(wheel) as z:  # the wheel's files, not its zip's times
            record = next(z.read(n) for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        key = _key([
            "\n".join(f"{p.name}={p.version}" for p in packages).encode(), record, name.encode(), str(epoch).encode(),
            *(w.read_bytes() for w in locked), Path(__file__).read_bytes(), Path(images.__file__).read_bytes(),
        ])  # fmt: skip
        target = out / f"k8s-dispatch-{image_tag(version)}.oci.tar"
        cached = cache / "built" / key
        if use_cache and (cached / "image.oci.tar").exists():
            meta = json.loads((cached / "image.json").read_text())
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cached / "image.oci.tar", target)
            return Built(name, target, meta["digest"], target.stat().st_size, time.monotonic() - started, True)
        base_files = with_bytecode(base_entries(packages, python), f"usr/lib/python{python}/")
        base = images.layer_at(base_files, mtime=epoch, owners={APP: (UID, GID)})
        app_files = with_bytecode(venv_entries([*locked, wheel], python, full_version), f"{VENV}/lib/")
        app = images.layer_at(app_files, mtime=epoch)
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = images.ImageConfig(
        cmd=CMD,
        env=(PATH_ENV, f"VIRTUAL_ENV=/{VENV}", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"),
        user=f"{UID}:{GID}", working_dir=f"/{APP}", exposed_ports=("9808/tcp", "5555/tcp"), stop_signal="SIGTERM",
        labels=(("org.opencontainers.image.title", "k8s-dispatch"), ("org.opencontainers.image.version", version),
                ("org.opencontainers.image.licenses", "Apache-2.0"), ("org.opencontainers.image.created", created)),
    )  # fmt: skip
    history = [
        "tools/image.py: Debian " + " ".join(f"{p.name}={p.version}" for p in packages),
        f"tools/image.py: /{VENV} with requirements.lock and k8s-dispatch {version}",
    ]
    blob = images.config_blob([base, app], config, created=created, history=history)
    data, digest = images.layout_archive(name, [base, app], blob)
    out.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    if use_cache:
        cached.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, cached / "image.oci.tar.part")
        (cached / "image.json").write_text(json.dumps({"name": name, "digest": digest}))
        (cached / "image.oci.tar.part").rename(cached / "image.oci.tar")
    return Built(name, target, digest, len(data), time.monotonic() - started, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/image.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the image's OCI archive into --out")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--no-cache", action="store_true", help="build even when the cache holds it")
    args = parser.parse_args(argv)
    if platform.system() != "Linux" or not shutil.which("dpkg-query"):
        print("tools/image.py builds from Debian's installed packages: run it on Debian or Ubuntu", file=sys.stderr)
        return 2
    try:
        built = build(args.out, use_cache=not args.no_cache)
    except ImageBuildFailed as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"name": built.name, "path": str(built.path), "digest": built.digest, "bytes": built.size,
                      "seconds": round(built.seconds, 1), "cached": built.cached}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
