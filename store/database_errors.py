"""What to tell an operator when the database cannot be used at all, as a typed error whose
message starts with what to do next (create the database, fix the URL's login, start the server).

Pure: the decision reads the driver's message and the URL, so each case is tested without a
server that fails in that way. Used where a command opens the database for the first time
(`migrate`, the CLI's checks), not inside the tasks, which retry `DatabaseUnavailable` as is.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from k8s_dispatch.core.errors import ConfigError, DatabaseUnavailable, DispatchError

URL_VARIABLE = "K8S_DISPATCH_DATABASE_URL"


def redacted(url: str | URL) -> str:
    """The URL safe to print: the password, if any, is hidden."""
    return make_url(url).render_as_string(hide_password=True)


def database_error(url: str | URL, error: BaseException) -> DispatchError:
    """The error to raise for `error` (a connect or first query that failed) on `url`.

    ConfigError (reason DatabaseMissing or DatabaseLoginRefused) when only the operator can
    fix it; DatabaseUnavailable when the server could not be reached (it may come back).
    """
    parsed = make_url(url)
    text = " ".join(str(getattr(error, "orig", None) or error).split())
    lowered = text.lower()
    where = f"{parsed.host or 'localhost'}:{parsed.port or 5432}"
    if parsed.get_backend_name() == "sqlite":
        return ConfigError(
            f"cannot open the SQLite database {parsed.database!r}: check that its directory exists and is "
            f"writable, or set {URL_VARIABLE} ({text})",
            reason="DatabaseMissing",
        )
    if "does not exist" in lowered and "database" in lowered and "role" not in lowered:
        name = parsed.database or "?"
        return ConfigError(
            f"create the database {name!r} on {where} (`createdb {name}` or CREATE DATABASE), then run "
            f"`k8s-dispatch migrate`; or point {URL_VARIABLE} at an existing one ({text})",
            reason="DatabaseMissing",
        )
    if "password authentication failed" in lowered or ("role" in lowered and "does not exist" in lowered):
        return ConfigError(
            f"fix the user or password in {URL_VARIABLE}: the database server at {where} refused the login "
            f"of {parsed.username or '(no user)'!r} ({text})",
            reason="DatabaseLoginRefused",
        )
    return DatabaseUnavailable(
        f"start the database server at {where} or fix {URL_VARIABLE} ({redacted(parsed)}): cannot connect ({text})"
    )
