"""The Dockerfile and .dockerignore, checked by parsing them: the image tools/image.py builds
(Debian's python3.X from Debian's packages, the venv, environment, user and command), runtime
dependencies only, a numeric non-root user shared with deploy/, and nothing local in the build context.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

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


def _image_tool() -> ModuleType:
    """tools/image.py, the image's builder without Docker, as the module it is when run."""
    spec = importlib.util.spec_from_file_location("image_tool", DOCKERFILE.parent / "tools" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _debian_codename() -> str:
    """The release whose installed packages tools/image.py takes (this host's)."""
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    assert fields.get("ID") == "debian", "tools/image.py builds from Debian's packages"
    return fields["VERSION_CODENAME"].strip('"')


def test_every_stage_builds_on_the_debian_release_tools_image_takes_its_packages_from() -> None:
    bases = [args.split()[0] for op, args in _instructions() if op == "FROM"]
    assert bases and set(bases) == {f"debian:{_debian_codename()}-slim"}


def test_the_runtime_stage_installs_the_packages_tools_image_lays_out() -> None:
    """tools/image.py's base layer is its ROOTS (and their dependencies) for the venv's Python;
    the Dockerfile's final stage installs the same from apt, and nothing else."""
    tool = _image_tool()
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    runs = [args for op, args in _final_stage() if op == "RUN" and "apt-get install" in args]
    assert len(runs) == 1
    words = runs[0].split("apt-get install", 1)[1].split("&&", 1)[0].split()
    assert {w for w in words if not w.startswith("-")} == {root.format(minor=minor) for root in tool.ROOTS}


def test_the_image_has_the_environment_venv_user_and_command_tools_image_gives_it() -> None:
    tool = _image_tool()
    final = _final_stage()
    env = " ".join(args for op, args in final if op == "ENV").split()
    for setting in (tool.PATH_ENV, f"VIRTUAL_ENV=/{tool.VENV}", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1",
                    "PYTHONDONTWRITEBYTECODE=1"):  # fmt: skip
        assert setting in env, setting
    assert ("COPY", f"--from=venv /{tool.VENV} /{tool.VENV}") in final
    assert [args for op, args in final if op == "WORKDIR"] == [f"/{tool.APP}"]
    assert [args for op, args in final if op == "USER"] == [f"{tool.UID}:{tool.GID}"]
    assert [args for op, args in final if op == "CMD"] == [str(list(tool.CMD)).replace("'", '"')]
    compiled = [args for op, args in final if op == "RUN" and "compileall" in args]
    assert len(compiled) == 1 and "--invalidation-mode unchecked-hash" in compiled[0]


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


def test_pip_keeps_no_cache_and_stays_out_of_the_runtime_image() -> None:
    instructions = _instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    env = " ".join(args for op, args in instructions[:last_from] if op == "ENV")
    assert "PIP_NO_CACHE_DIR=1" in env
    final_runs = " ".join(args for op, args in _final_stage() if op == "RUN")
    assert "pip " not in final_runs  # the venv is copied in, built; pip itself is uninstalled from it
    assert "pip uninstall --yes pip setuptools" in " ".join(args for op, args in instructions[:last_from])


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
