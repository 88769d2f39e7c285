"""The previous release, for the chaos run's rolling upgrade: a `git worktree` of an earlier commit
in a temp dir, run by the same virtualenv with its own tree first on `PYTHONPATH` (the dependencies
are the venv's: a release whose lock differs is not what this rehearses).

The run starts its workers and beat from it on the schema it migrates to; at the ROLLING_UPGRADE
fault, `k8s-dispatch migrate` (this release) brings the database to head while they run, then each
is replaced by this release's, one at a time, as a Deployment's rolling update does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import k8s_dispatch
from k8s_dispatch.ops.processes import ManagedProcess

REPO = Path(k8s_dispatch.__file__).resolve().parent.parent
GIT_TIMEOUT_S = 120.0
MIGRATE_TIMEOUT_S = 180.0


class ReleaseUnavailable(RuntimeError):
    """The previous release could not be checked out (no git, not a clone, an unknown ref)."""


class PreviousRelease:
    """A worktree of `ref`, removed (with its git metadata) by `remove`."""

    def __init__(self, ref: str, *, repo: Path = REPO) -> None:
        self.ref = ref
        self.repo = repo
        self.root = Path(tempfile.mkdtemp(prefix="k8s-dispatch-chaos-release-")) / "tree"
        self.commit = ""

    def check_out(self) -> str:
        """Add the worktree; return the commit it holds. Raises ReleaseUnavailable."""
        try:
            self.commit = self._git("rev-parse", "--verify", f"{self.ref}^{{commit}}").strip()
            self._git("worktree", "add", "--detach", str(self.root), self.commit)
        except (OSError, subprocess.SubprocessError) as e:
            raise ReleaseUnavailable(f"checking out {self.ref!r} from {self.repo}: {e}") from e
        return self.commit

    def remove(self) -> None:
        try:
            self._git("worktree", "remove", "--force", str(self.root))
        except (OSError, subprocess.SubprocessError):
            self._git_quietly("worktree", "prune")
        shutil.rmtree(self.root.parent, ignore_errors=True)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` with this release first on the import path (and nothing of the current one)."""
        return dict(env) | {"PYTHONPATH": str(self.root)}

    def worker(self, name: str, *, env: Mapping[str, str], log_dir: Path, concurrency: int) -> ManagedProcess:
        """Its `celery worker`, under the same node name as the one that replaces it."""
        argv = [
            sys.executable, "-m", "celery", "-A", "k8s_dispatch.tasks", "worker", "--loglevel=INFO",
            f"--hostname={name}@%h", f"--concurrency={concurrency}", "--without-mingle", "--without-gossip",
        ]  # fmt: skip
        return ManagedProcess(name, argv, self.env(env), log_dir / f"{name}.log", cwd=self.root)

    def beat(self, *, env: Mapping[str, str], log_dir: Path, name: str) -> ManagedProcess:
        argv = [sys.executable, "-m", "celery", "-A", "k8s_dispatch.tasks", "beat", "--loglevel=INFO"]
        return ManagedProcess(name, argv, self.env(env), log_dir / f"{name}.log", cwd=self.root)

    def migrate(self, database_url: str, *, env: Mapping[str, str]) -> None:
        """Its schema: the database brought to its own head by its own code. Raises RuntimeError."""
        code = "import sys; from k8s_dispatch.store.migrate import upgrade; upgrade(sys.argv[1])"
        _checked([sys.executable, "-c", code, database_url], env=self.env(env), cwd=self.root, what="old migrate")

    def _git(self, *args: str) -> str:
        done = subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)  # fmt: skip
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"git {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def _git_quietly(self, *args: str) -> None:
        subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True, timeout=GIT_TIMEOUT_S, check=False)


def migrate_to_head(database_url: str, *, env: Mapping[str, str]) -> str:
    """`k8s-dispatch migrate` of this release, as an operator runs it: again while it says the
    database server cannot be reached (a restart of it, another fault of the run, may overlap),
    for up to MIGRATE_TIMEOUT_S. Raises RuntimeError."""
    code = "import sys; from k8s_dispatch.cli import main; sys.exit(main(['migrate']))"
    deadline = time.monotonic() + MIGRATE_TIMEOUT_S
    while True:
        try:
            return _checked([sys.executable, "-c", code], env=dict(env) | {"K8S_DISPATCH_DATABASE_URL": database_url},
                            cwd=REPO, what="k8s-dispatch migrate")  # fmt: skip
        except RuntimeError as e:
            if "DatabaseUnavailable" not in str(e) or time.monotonic() > deadline:
                raise
        threading.Event().wait(1.0)  # the server is restarting: as an operator would, try again


def _checked(argv: list[str], *, env: Mapping[str, str], cwd: Path, what: str) -> str:
    done = subprocess.run(argv, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=MIGRATE_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return (done.stdout + done.stderr).strip()
