"""The Helm chart at the release's version: the one setuptools-scm gave the wheel `make dist` built.

    python tools/release.py chart DIST     # helm package the chart into DIST, at the wheel's version
    python tools/release.py version DIST   # print that version (PEP 440) and its SemVer form

The version has one source, the git tag (vX.Y.Z), read by setuptools-scm when the wheel is built;
the chart's `version` and `appVersion` are that version in SemVer, which Helm requires
(X.Y.Z.devN+gHASH becomes X.Y.Z-dev.N+gHASH). Chart.yaml in the tree keeps the last release's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "k8s-dispatch"
_WHEEL = re.compile(r"^k8s_dispatch-(?P<version>[^-]+)-py3-none-any\.whl$")
_PRE = {"a": "alpha", "b": "beta", "rc": "rc"}


class ReleaseError(Exception):
    """dist/ does not hold exactly one wheel of ours, or helm failed."""


def wheel_version(dist: Path) -> str:
    """The version of the one k8s-dispatch wheel in `dist` (from its file name)."""
    found = [m["version"] for p in sorted(dist.iterdir()) if (m := _WHEEL.match(p.name))]
    if len(found) != 1:
        raise ReleaseError(f"expected one k8s_dispatch wheel in {dist}, found {len(found)}: run `make dist`")
    return found[0]


def semver(pep440: str) -> str:
    """The SemVer 2 form of a PEP 440 version (pure): release padded to three numbers, a pre-release
    or dev part as the pre-release, a post or local part as build metadata."""
    v = Version(pep440)
    release = ".".join(str(n) for n in (*v.release, 0, 0)[:3])
    pre = []
    if v.pre is not None:
        pre.append(f"{_PRE[v.pre[0]]}.{v.pre[1]}")
    if v.dev is not None:
        pre.append(f"dev.{v.dev}")
    build = []
    if v.post is not None:
        build.append(f"post.{v.post}")
    if v.local is not None:
        build.append(v.local)
    return release + (f"-{'.'.join(pre)}" if pre else "") + (f"+{'.'.join(build)}" if build else "")


def helm() -> str:
    """$HELM, else the helm tools/build.sh builds (cached after the first time)."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    from k8s_dispatch.lab.realcluster.binaries import build

    return str(build("helm") / "helm")


def package_chart(dist: Path) -> Path:
    """`helm package` the chart into `dist` with version and appVersion the wheel's; its path."""
    version = semver(wheel_version(dist))
    done = subprocess.run(
        [helm(), "package", str(CHART), "--version", version, "--app-version", version, "--destination", str(dist)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise ReleaseError(f"helm package failed: {done.stderr.strip()}")
    return dist / f"k8s-dispatch-{version}.tgz"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("chart", "version"):
        print(__doc__, file=sys.stderr)
        return 2
    dist = Path(argv[1])
    try:
        if argv[0] == "version":
            version = wheel_version(dist)
            print(version, semver(version))
        else:
            print(f"chart: {package_chart(dist)}")
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
