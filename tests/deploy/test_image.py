"""The Dockerfile and .dockerignore, checked by parsing them: base image, runtime dependencies
only, a numeric non-root user shared with deploy/, and nothing local in the build context.
"""

from __future__ import annotations

import fnmatch
import re
import shlex

import pytest
from deploy_files import DEPLOY, DOCKERFILE, DOCKERIGNORE, load_docs

Instruction = tuple[str, str]  # (INSTRUCTION, arguments)


def _instructions() -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def _final_stage() -> list[Instruction]:
    instructions = _instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def test_runtime_image_is_python_312_slim() -> None:
    (_, base) = _final_stage()[0]
    assert base.split()[0] == "python:3.12-slim"
    for op, args in _instructions():
        if op == "FROM":
            assert args.split()[0] == "python:3.12-slim", "every stage builds on the same base"


def test_runs_as_a_numeric_non_root_user() -> None:
    users = [args for op, args in _final_stage() if op == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    assert uid.isdigit() and int(uid) != 0
    assert gid == "" or (gid.isdigit() and int(gid) != 0)


def test_deploy_runs_as_the_images_user() -> None:
    (uid, _, _) = [args for op, args in _final_stage() if op == "USER"][-1].partition(":")
    for file in ("worker.yaml", "beat.yaml", "flower.yaml", "migrate-job.yaml"):
        for doc in load_docs(DEPLOY / file):
            if doc["kind"] in ("Deployment", "Job"):
                assert doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid), file


def _pip_installs() -> list[list[str]]:
    commands = []
    for op, args in _instructions():
        if op != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):
                if words[:2] in (["pip", "install"], ["pip", "wheel"]) or words[1:4] == ["-m", "pip", "install"]:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def test_installs_the_package_without_dev_or_test_extras() -> None:
    installs = _pip_installs()
    assert any(words[:2] == ["pip", "install"] for words in installs)
    for words in installs:
        assert "-e" not in words and "--editable" not in words, words
        for word in words:
            assert not re.search(r"\[(.*,)?\s*(test|dev|tests|develop)\s*(,.*)?\]", word), f"dev extra in {words}"
    runs = " ".join(args for op, args in _instructions() if op == "RUN")
    assert "optional-dependencies" not in runs  # the requirements come from the runtime list only


def test_installs_exactly_the_locked_runtime_dependencies() -> None:
    """The image gets requirements.lock's versions with their hashes checked, and the wheel adds
    nothing of its own choosing."""
    installs = [words for words in _pip_installs() if words[:2] == ["pip", "install"]]
    locked = [words for words in installs if "-r" in words]
    assert [words[words.index("-r") + 1] for words in locked] == ["/tmp/requirements.lock"]
    assert "--require-hashes" in locked[0]
    copies = [args.split() for op, args in _instructions() if op == "COPY"]
    assert ["requirements.lock", "/tmp/requirements.lock"] in copies
    for words in installs:
        if words not in locked:
            assert "--no-deps" in words, words


def test_pip_keeps_no_cache_in_the_image() -> None:
    env = " ".join(args for op, args in _final_stage() if op == "ENV")
    assert "PIP_NO_CACHE_DIR=1" in env


def test_default_command_is_the_worker() -> None:
    (cmd,) = [args for op, args in _final_stage() if op == "CMD"]
    assert cmd == '["celery", "-A", "k8s_dispatch.tasks", "worker", "--loglevel=INFO"]'


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for .dockerignore, enough for these patterns: the last match wins."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        for candidate in (pattern, f"{pattern}/*"):
            if fnmatch.fnmatch(path, candidate) or fnmatch.fnmatch(path, "**/" + candidate):
                result = not negate
    return result


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize(
    "path", [".venv", ".git", ".env", "tests", "k8s-dispatch.db", "lab", "lab/bench/results", "kubeconfig"]
)
def test_local_state_and_secrets_stay_out_of_the_context(ignore_patterns: list[str], path: str) -> None:
    assert _ignored(path, ignore_patterns)


@pytest.mark.parametrize(
    "path",
    [
        "pyproject.toml",
        "README.md",
        "requirements.lock",
        "celeryconfig.py",
        "k8s_dispatch",
        "tasks",
        "recovery",
        "delivery",
        "workers",
        "store",
        "core",
        "container",
        "artifacts",
        "ops",
        "demo",
    ],
)
def test_what_pip_install_needs_is_in_the_context(ignore_patterns: list[str], path: str) -> None:
    # pyproject names README.md as the readme and installs these packages and modules.
    assert not _ignored(path, ignore_patterns)
