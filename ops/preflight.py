"""The CLI's checks before a command does its work: the database has our tables, Redis answers,
the API server takes our credentials. Each failure is a typed error whose message starts with
what to do next, so that a newcomer's first error is an instruction, not a traceback.

A command that reads (status, show, cancel, schedule, recover) never creates a database:
SQLite makes its file on the first connect, so a file that is not there is reported, not made.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis
from alembic.script import ScriptDirectory
from sqlalchemy import exc
from sqlalchemy.engine import make_url

from k8s_dispatch.core.errors import (
    ApiRejected,
    ApiUnavailable,
    AuthorizationNotReady,
    ConfigError,
    GuardUnavailable,
)
from k8s_dispatch.store import migrate
from k8s_dispatch.store.database_errors import URL_VARIABLE, database_error, redacted
from k8s_dispatch.workers.kube import KubeClient

MIGRATE = "`k8s-dispatch migrate`"


def require_database(url: str, *, url_is_set: bool | None = None) -> None:
    """The database at `url` exists and carries this version's schema.

    `url_is_set`: whether K8S_DISPATCH_DATABASE_URL was given (default: read the environment);
    when it was not, the message says the URL is the default.

    Raises:
        ConfigError: reason NoDatabase (a SQLite file that is not there), NotMigrated (no
            tables of ours, or an older schema), SchemaTooNew (a database migrated by a newer
            k8s-dispatch), DatabaseMissing or DatabaseLoginRefused.
        DatabaseUnavailable: the server could not be reached.
    """
    if url_is_set is None:
        url_is_set = URL_VARIABLE in os.environ
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database or "")
        if not path.exists():
            unset = "" if url_is_set else f"; {URL_VARIABLE} is not set, so the default {url} is used"
            raise ConfigError(
                f"set {URL_VARIABLE} to your database, or run {MIGRATE} to create {path}: there is no "
                f"database at {path.resolve()}{unset}",
                reason="NoDatabase",
            )
    try:
        revision = migrate.current(url)
    except (exc.OperationalError, exc.InterfaceError) as e:
        raise database_error(url, e) from e
    head = migrate.head()
    if revision == head:
        return
    if revision is None:
        raise ConfigError(
            f"run {MIGRATE}: the database {redacted(url)} has no k8s-dispatch tables yet", reason="NotMigrated"
        )
    known = {script.revision for script in ScriptDirectory(str(migrate.MIGRATIONS_DIR)).walk_revisions()}
    if revision not in known:
        raise ConfigError(
            f"upgrade k8s-dispatch: the database {redacted(url)} was migrated by a newer version "
            f"(revision {revision}; this one knows up to {head})",
            reason="SchemaTooNew",
        )
    raise ConfigError(
        f"run {MIGRATE}: the database {redacted(url)} is at revision {revision}, this version needs {head}",
        reason="NotMigrated",
    )


def require_redis(client: redis.Redis, url: str) -> None:
    """Redis answers a PING.

    Raises:
        GuardUnavailable: naming the URL's host and port and the variable to fix.
    """
    try:
        client.ping()
    except redis.RedisError as e:
        parsed = make_url(url)
        raise GuardUnavailable(
            f"start Redis at {parsed.host or '127.0.0.1'}:{parsed.port or 6379} or fix K8S_DISPATCH_REDIS_URL "
            f"({redacted(url)}): {type(e).__name__}: {e}"
        ) from e


def require_api(kube: KubeClient, namespace: str, *, kubeconfig: Path | None) -> None:
    """The API server answers a one-item LIST of Jobs in `namespace` with our credentials.

    An API that is unavailable (5xx, 429, no answer) is not stopped here: the command goes on
    and reports it per category, as it does any transient failure (exit 1, the next sweep retries).

    Raises:
        ConfigError: reason Unauthorized (the credentials were refused) or Forbidden (no RBAC).
    """
    source = f"{kubeconfig}" if kubeconfig is not None else "the in-cluster config or ~/.kube/config"
    try:
        kube.list_jobs_page(namespace, label_selector="app.kubernetes.io/managed-by=k8s-dispatch", limit=1)
    except AuthorizationNotReady:
        return  # the server took the credentials; its authorizer is still starting
    except ApiRejected as e:
        if e.reason == "Unauthorized":
            raise ConfigError(
                f"fix the credentials in {source} (K8S_DISPATCH_KUBECONFIG names the file): the API server "
                f"refused them ({e})",
                reason="Unauthorized",
            ) from e
        if e.reason == "Forbidden":
            raise ConfigError(
                f"grant the credentials of {source} the Role of deploy/rbac.yaml in namespace {namespace}: "
                f"the API server forbids them to list Jobs ({e})",
                reason="Forbidden",
            ) from e
        raise
    except ApiUnavailable:
        return
