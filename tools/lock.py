"""The lock files and the ranges they were made from: `make lock` writes them, CI checks them.

    python tools/lock.py write   # uv pip compile both locks (hashes, every platform), then stamp them
    python tools/lock.py check [DIR]   # exit 1 naming the problem when pyproject.toml and a lock disagree

pyproject.toml keeps the ranges; `requirements.lock` pins what the image installs (the runtime
dependencies) and `requirements-test.lock` what `make test`, `make demo` and `make bench` install (the
runtime ones and the test extra). Each lock carries a stamp, the SHA-256 of the dependency lists it was
made from, so an edit of those lists without `make lock` fails CI here, offline, instead of installing
something nobody locked. The check also reads every pin against its range (a hand-edited lock).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
STAMP = "# pyproject-dependencies-sha256: "
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", re.M)


@dataclass(frozen=True)
class Lock:
    path: Path
    extras: tuple[str, ...]


LOCKS = (Lock(Path("requirements.lock"), ()), Lock(Path("requirements-test.lock"), ("demo", "docs", "test")))


def requirements(project: dict, extras: tuple[str, ...]) -> list[str]:
    """The requirement strings a lock is made from, in pyproject's order."""
    wanted = list(project.get("dependencies", []))
    for extra in extras:
        wanted += project.get("optional-dependencies", {}).get(extra, [])
    return wanted


def stamp(project: dict, extras: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps(requirements(project, extras)).encode()).hexdigest()


def read_project(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def write() -> None:
    """Compile each lock with uv (the existing lock's pins are kept where they still fit) and stamp it."""
    project = read_project(ROOT)
    for lock in LOCKS:
        path = ROOT / lock.path
        extras = [arg for extra in lock.extras for arg in ("--extra", extra)]
        subprocess.run(
            [sys.executable, "-m", "uv", "pip", "compile", "pyproject.toml", *extras, "--universal",
             "--python-version", "3.11", "--generate-hashes", "--quiet", "-o", str(lock.path)],
            cwd=ROOT, check=True,
        )  # fmt: skip
        text = path.read_text(encoding="utf-8")
        path.write_text(f"{STAMP}{stamp(project, lock.extras)}\n{text}", encoding="utf-8")


def problems(root: Path = ROOT) -> list[str]:
    """What is wrong between `root`'s pyproject.toml and its locks; empty when they agree."""
    project = read_project(root)
    found: list[str] = []
    for lock in LOCKS:
        name, path = lock.path.name, root / lock.path
        if not path.exists():
            found.append(f"{name} is missing: run `make lock`")
            continue
        text = path.read_text(encoding="utf-8")
        first = text.splitlines()[0] if text else ""
        if first != STAMP + stamp(project, lock.extras):
            found.append(f"{name} was not made from pyproject.toml's dependencies as they are now: run `make lock`")
        pins = {canonicalize_name(n): v for n, v in PIN.findall(text)}
        for line in requirements(project, lock.extras):
            req = Requirement(line)
            pinned = pins.get(canonicalize_name(req.name))
            if pinned is None:
                found.append(f"{name} pins no {req.name} ({line})")
            elif not req.specifier.contains(pinned, prereleases=True):
                found.append(f"{name} pins {req.name}=={pinned}, outside {line}")
    found += _disagreeing_pins(root)
    return found


def _disagreeing_pins(root: Path) -> list[str]:
    """The image and the tests must run the same versions of what both install."""
    runtime, test = ((root / lock.path) for lock in LOCKS)
    if not (runtime.exists() and test.exists()):
        return []
    ours = dict(PIN.findall(runtime.read_text(encoding="utf-8")))
    theirs = dict(PIN.findall(test.read_text(encoding="utf-8")))
    return [
        f"{runtime.name} pins {name}=={version}, {test.name} {name}=={theirs[name]}: run `make lock`"
        for name, version in ours.items()
        if name in theirs and theirs[name] != version
    ]


def main(argv: list[str]) -> int:
    if argv == ["write"]:
        write()
        return 0
    if argv[:1] == ["check"] and len(argv) <= 2:
        found = problems(Path(argv[1]) if len(argv) == 2 else ROOT)
        for problem in found:
            print(f"lock: {problem}", file=sys.stderr)
        return 1 if found else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
