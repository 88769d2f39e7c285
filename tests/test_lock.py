"""The locks agree with pyproject.toml, and `tools/lock.py check` notices when they stop agreeing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = ("pyproject.toml", "requirements.lock", "requirements-test.lock")


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "lock.py"), "check", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_locks_were_made_from_pyproject_as_it_is() -> None:
    result = check(REPO)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in FILES:
        shutil.copy(REPO / name, tmp_path / name)
    assert check(tmp_path).returncode == 0
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, old
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def test_a_dependency_added_without_make_lock_fails(copy: Path) -> None:
    edit(copy / "pyproject.toml", '    "pyyaml>=6",\n', '    "pyyaml>=6",\n    "tabulate>=0.9",\n')
    result = check(copy)
    assert result.returncode == 1
    assert "requirements.lock was not made from pyproject.toml's dependencies" in result.stderr
    assert "requirements.lock pins no tabulate (tabulate>=0.9)" in result.stderr


def test_a_range_the_pin_falls_outside_fails(copy: Path) -> None:
    edit(copy / "pyproject.toml", '"redis>=5"', '"redis>=5,<6"')
    result = check(copy)
    assert result.returncode == 1
    assert "outside redis>=5,<6" in result.stderr


def test_a_hand_edited_pin_the_other_lock_disagrees_with_fails(copy: Path) -> None:
    lock = copy / "requirements.lock"
    text = lock.read_text(encoding="utf-8")
    version = text.split("\nredis==", 1)[1].split()[0]
    edit(lock, f"\nredis=={version}", "\nredis==5.0.0")
    result = check(copy)
    assert result.returncode == 1
    assert f"requirements.lock pins redis==5.0.0, requirements-test.lock redis=={version}" in result.stderr
