"""The release: one version, from the git tag, in the wheel, the sdist and the chart `make dist`
builds (twine checks both packages); a clone with no tags (CI's) and a tree with no git at all
(an image's build context) still build; the static defaults (Chart.yaml, the kustomization's image
tag) agree with the CHANGELOG's newest release; the legal files are there and in the wheel."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from release import semver, wheel_version  # noqa: E402

BIN = Path(sys.executable).parent
STAMP = BIN.parent / ".installed-stamp"


@pytest.mark.parametrize(
    ("pep440", "expected"),
    [
        ("0.1.0", "0.1.0"),
        ("1.2", "1.2.0"),
        ("0.1.1.dev5+g1a2b3c4", "0.1.1-dev.5+g1a2b3c4"),
        ("0.1.1.dev5+g1a2b3c4.d20261202", "0.1.1-dev.5+g1a2b3c4.d20261202"),
        ("2.0.0rc1", "2.0.0-rc.1"),
        ("2.0.0b2.dev3", "2.0.0-beta.2.dev.3"),
        ("1.0.0.post1", "1.0.0+post.1"),
    ],
)
def test_semver_of_a_pep440_version(pep440: str, expected: str) -> None:
    assert semver(pep440) == expected
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.]+)?(\+[0-9A-Za-z.]+)?", expected)


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=release@test", "-c", "user.name=release", *args],
        cwd=cwd, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return done.stdout.strip()


def _make_dist(tree: Path) -> subprocess.CompletedProcess[str]:
    """`make dist` in `tree` with this virtualenv (its stamp taken as up to date: no reinstall)."""
    return subprocess.run(
        ["make", "dist", f"VENV={BIN.parent}", "-o", str(STAMP)],
        cwd=tree, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of HEAD, as CI gets it: no tags."""
    where = tmp_path_factory.mktemp("release") / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-tags", str(REPO), str(where)], check=True, timeout=300)
    assert _git(where, "tag") == ""
    return where


def test_a_clone_without_tags_builds_a_dev_version(clone: Path) -> None:
    done = _make_dist(clone)
    assert done.returncode == 0, done.stdout + done.stderr
    version = wheel_version(clone / "dist")
    head = _git(clone, "rev-parse", "--short", "HEAD")
    assert re.fullmatch(rf"\d+\.\d+\.\d+\.dev\d+\+g{head}[0-9a-f]*", version), version
    assert (clone / "dist" / f"k8s-dispatch-{semver(version)}.tgz").is_file()


def test_a_tag_is_the_version_of_the_wheel_the_sdist_and_the_chart(clone: Path) -> None:
    _git(clone, "tag", "-a", "v9.8.7", "-m", "k8s-dispatch 9.8.7")
    done = _make_dist(clone)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout  # twine check, wheel and sdist
    dist = clone / "dist"
    assert sorted(p.name for p in dist.iterdir() if not p.name.startswith(".")) == [
        "k8s-dispatch-9.8.7.tgz", "k8s_dispatch-9.8.7-py3-none-any.whl", "k8s_dispatch-9.8.7.tar.gz",
    ]  # fmt: skip
    with zipfile.ZipFile(dist / "k8s_dispatch-9.8.7-py3-none-any.whl") as wheel:
        names = wheel.namelist()
        metadata = wheel.read("k8s_dispatch-9.8.7.dist-info/METADATA").decode()
    assert "k8s_dispatch-9.8.7.dist-info/licenses/LICENSE" in names
    assert "Version: 9.8.7" in metadata and "License-Expression: Apache-2.0" in metadata
    assert {n.split("/")[0] for n in names} == {"k8s_dispatch", "k8s_dispatch-9.8.7.dist-info"}
    with tarfile.open(dist / "k8s-dispatch-9.8.7.tgz") as chart:
        meta = yaml.safe_load(chart.extractfile("k8s-dispatch/Chart.yaml").read())  # type: ignore[union-attr]
    assert (meta["version"], meta["appVersion"]) == ("9.8.7", "9.8.7")


def test_a_tree_without_git_builds_the_fallback_version(clone: Path, tmp_path: Path) -> None:
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=clone, capture_output=True, check=True, timeout=120)
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["tar", "x"], cwd=tree, input=archive.stdout, check=True, timeout=120)
    done = subprocess.run(
        [str(BIN / "uv"), "build", "--quiet", "--wheel", "--out-dir", "dist", "."],
        cwd=tree, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    fallback = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["fallback_version"]
    assert wheel_version(tree / "dist") == fallback


def _newest_release() -> str:
    found = re.search(r"^## (\d+\.\d+\.\d+)\b", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert found, "CHANGELOG.md has no release section"
    return found[1]


def test_the_static_defaults_are_the_changelogs_newest_release() -> None:
    release = _newest_release()
    chart = yaml.safe_load((REPO / "deploy/helm/k8s-dispatch/Chart.yaml").read_text())
    kustomization = yaml.safe_load((REPO / "deploy/kustomization.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (release, release)
    assert [image["newTag"] for image in kustomization["images"]] == [release]


def test_the_legal_and_project_files_are_there() -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    for name in ("CHANGELOG.md", "CONTRIBUTING.md", "SECURITY.md"):
        assert (REPO / name).stat().st_size > 500, name
    assert "Upgrade notes" in (REPO / "CHANGELOG.md").read_text()


def test_the_readme_says_how_to_install_from_a_checkout_and_to_create_the_database() -> None:
    """No registry release yet: the README's install is `make dist` and the wheel it writes, with
    the locked dependencies; and the database exists before `migrate` (which refuses a missing one)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    order = ["`make dist`", "pip install --require-hashes -r requirements.lock", "dist/k8s_dispatch-*.whl",
             "createdb k8s_dispatch", "k8s-dispatch migrate"]  # fmt: skip
    at = [readme.find(text) for text in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
