"""The `k8s-dispatch` command line: one entry point for operators, the demo and the tests.

Subcommands import what they need lazily, so `k8s-dispatch --help` and `localcluster serve`
start fast and never touch the broker, the database or the cluster on their own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

import click

from k8s_dispatch.core.errors import ConfigError, DispatchError
from k8s_dispatch.core.limits import Limits

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from k8s_dispatch.core.settings import Settings
    from k8s_dispatch.delivery.runtime import Runtime
    from k8s_dispatch.workers.resolver import CapabilityResolver

# Exit codes scripts can rely on.


EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and found a problem (a failed check, a lost dispatch)
EXIT_USAGE = 2  # click's own code for bad arguments
EXIT_CONFIG = 3  # invalid configuration or input, or a service that cannot be used: nothing was done


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="k8s-dispatch", prog_name="k8s-dispatch", message="%(prog)s %(version)s")
def cli() -> None:
    """k8s-dispatch: run an engine's work as Kubernetes Jobs, deliver each result exactly once."""


@cli.command()
@click.option("--revision", default="head", show_default=True, help="Alembic revision to upgrade to.")
def migrate(revision: str) -> None:
    """Create or upgrade the database schema (K8S_DISPATCH_DATABASE_URL)."""
    from k8s_dispatch.core.settings import get_settings
    from k8s_dispatch.store.database_errors import redacted
    from k8s_dispatch.store.migrate import upgrade

    settings = get_settings()
    upgrade(settings.database_url, revision)
    click.echo(f"migrated {redacted(settings.database_url)} to {revision}")


@cli.command()
@click.option("--case", "case_id", required=True, help="The engine's case id.")
@click.option("--tenancy", "tenancy_id", required=True, help="The case's tenancy.")
@click.option("--capability", required=True, help="A capability of K8S_DISPATCH_CAPABILITIES.")
@click.option("--input", "input_json", default="{}", show_default=True, help="The input, as JSON.")
@click.option("--idempotency-key", required=True, help="Scheduling twice with one key is one dispatch.")
@click.option("--dispatch-id", default=None, help="A UUID to use as the dispatch id (default: a new one).")
@click.option("--priority", default=0, show_default=True, type=int, help="Within its tenancy's queue: higher first.")
@click.option("--create-case", is_flag=True, help="Create the case first if it does not exist.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def schedule(
    case_id: str,
    tenancy_id: str,
    capability: str,
    input_json: str,
    idempotency_key: str,
    dispatch_id: str | None,
    priority: int,
    create_case: bool,
    as_json: bool,
) -> None:
    """Schedule one dispatch; its Job is created by a worker (once admitted, under limits).
    Prints the dispatch id."""
    import json

    from k8s_dispatch.tasks.scheduling import schedule_in_session

    try:
        value = json.loads(input_json)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--input") from e
    result = _schedule_with(
        create_case,
        case_id,
        tenancy_id,
        lambda session, resolver, settings: schedule_in_session(
            session,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
            input=value,
            idempotency_key=idempotency_key,
            router=resolver,
            max_input_bytes=settings.max_input_bytes,
            dispatch_id=dispatch_id,
            priority=priority,
        ),
    )
    _echo_scheduled(result, as_json=as_json)


@cli.command("schedule-map")
@click.option("--case", "case_id", required=True, help="The engine's case id.")
@click.option("--tenancy", "tenancy_id", required=True, help="The case's tenancy.")
@click.option("--capability", required=True, help="A capability of K8S_DISPATCH_CAPABILITIES.")
@click.option(
    "--items", "items_file", required=True, type=click.File("r"), help="A JSON array of item inputs ('-': stdin)."
)
@click.option("--idempotency-key", required=True, help="Scheduling twice with one key is one map.")
@click.option("--parallelism", required=True, type=int, help="How many items run at once.")
@click.option("--max-failed-items", default=None, type=int, help="Stop the map once more items than this failed.")
@click.option("--min-succeeded", default=None, type=int, help="The map passes with this many (default: every item).")
@click.option("--dispatch-id", default=None, help="A UUID to use as the map's dispatch id (default: a new one).")
@click.option("--priority", default=0, show_default=True, type=int, help="Within its tenancy's queue: higher first.")
@click.option("--create-case", is_flag=True, help="Create the case first if it does not exist.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def schedule_map(
    case_id: str,
    tenancy_id: str,
    capability: str,
    items_file: TextIO,
    idempotency_key: str,
    parallelism: int,
    max_failed_items: int | None,
    min_succeeded: int | None,
    dispatch_id: str | None,
    priority: int,
    create_case: bool,
    as_json: bool,
) -> None:
    """Schedule a map dispatch: one capability over many items, run as one Indexed Job, each item
    ending in its own event. Prints the map's dispatch id."""
    import json

    from k8s_dispatch.tasks.maps import schedule_map_in_session

    try:
        items = json.load(items_file)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--items") from e
    result = _schedule_with(
        create_case,
        case_id,
        tenancy_id,
        lambda session, resolver, settings: schedule_map_in_session(
            session,
            case_id=case_id,
            tenancy_id=tenancy_id,
            capability=capability,
            items=items,
            idempotency_key=idempotency_key,
            parallelism=parallelism,
            router=resolver,
            max_input_bytes=settings.max_input_bytes,
            max_stored_input_bytes=settings.max_stored_input_bytes,
            max_failed_items=max_failed_items,
            min_succeeded=min_succeeded,
            dispatch_id=dispatch_id,
            priority=priority,
        ),
    )
    _echo_scheduled(result, as_json=as_json)


def _schedule_with(
    create_case: bool, case_id: str, tenancy_id: str, write: Callable[[Session, CapabilityResolver, Settings], Any]
) -> Any:
    """`write(session, resolver, settings)` in one transaction of the configured database, the case
    created first if asked: the schedule commands' one way in."""
    from k8s_dispatch.store import scheduling
    from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction

    settings = _settings_with_database()
    resolver = _resolver(settings)
    engine = make_engine(settings.database_url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            if create_case:
                scheduling.create_case(session, case_id=case_id, tenancy_id=tenancy_id)
            return write(session, resolver, settings)
    finally:
        engine.dispose()


def _echo_scheduled(result: Any, *, as_json: bool) -> None:
    import json

    if as_json:
        click.echo(
            json.dumps({"dispatch_id": result.dispatch_id, "created": result.created, "state": result.state.value})
        )
    else:
        click.echo(result.dispatch_id)


@cli.command()
@click.argument("dispatch_id")
@click.option("--reason", default="Cancelled", show_default=True, help="The reason the event records.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def cancel(dispatch_id: str, reason: str, as_json: bool) -> None:
    """Cancel a dispatch: record WORKER_CANCELLED (unless it ended already); a worker then deletes its Job.

    Durable once this returns: the cancel is in the database, and if the message to a worker
    is lost, the recovery sweep deletes the Job.
    """
    import json

    from k8s_dispatch.store import dispatches
    from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction
    from k8s_dispatch.tasks.scheduling import cancel_in_session

    engine = make_engine(_settings_with_database().database_url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            cancelled = cancel_in_session(session, dispatch_id, reason=reason)
        with transaction(make_sessionmaker(engine)) as session:
            row = dispatches.get_dispatch(session, dispatch_id)
            state = row.state.value if row is not None else None
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"dispatch_id": dispatch_id, "cancelled": cancelled, "state": state}))
    else:
        click.echo(f"{'cancelled' if cancelled else 'already ended'}: {dispatch_id} ({state})")


@cli.command()
@click.option("--dry-run", is_flag=True, help="Find and count, change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def sweep(dry_run: bool, as_json: bool) -> int:
    """Run one recovery sweep now; print what it found and did, per category.

    Exits 1 if anything failed (an action, a listing); the next sweep retries it.
    """
    import json

    from k8s_dispatch.recovery.sweep import run_sweep

    with _checked_runtime(_settings_with_database()) as runtime:
        report = run_sweep(runtime, dry_run=dry_run)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.table())
    return EXIT_FAILED if report.errors else EXIT_OK


@cli.command(hidden=True)
@click.option("--dry-run", is_flag=True, help="Find and count, change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def recover(ctx: click.Context, dry_run: bool, as_json: bool) -> int:
    """Deprecated name of `sweep` (one name per thing: the recovery sweep), kept for 0.1's scripts."""
    click.echo("`k8s-dispatch recover` is deprecated: use `k8s-dispatch sweep`", err=True)
    result: int = ctx.invoke(sweep, dry_run=dry_run, as_json=as_json)
    return result


@cli.command()
@click.option("--failures", default=10, show_default=True, type=click.IntRange(min=0), help="Latest failures to list.")
@click.option("--maps", default=10, show_default=True, type=click.IntRange(min=0), help="Maps in progress to list.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def status(failures: int, maps: int, as_json: bool) -> None:
    """Dispatches by state, the oldest one pending, the latest failures with their reasons and
    the maps in progress with their items' progress."""
    import json

    from rich.console import Console

    from k8s_dispatch.ops.status import read_status, render
    from k8s_dispatch.store.db import database_now, make_engine, make_sessionmaker, transaction

    settings = _settings_with_database()
    engine = make_engine(settings.database_url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            # Ages on the clock the rows were written with, not this host's.
            report = read_status(
                session, now=database_now(session), failures=failures, limits=_limits(settings), maps=maps
            )
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        Console().print(render(report))


@cli.command()
@click.argument("dispatch_id")
@click.option(
    "--failed-items", default=20, show_default=True, type=click.IntRange(min=0), help="A map's failed items to list."
)
@click.option("--json", "as_json", is_flag=True, help="Print the story as JSON.")
@click.option("--logs", is_flag=True, help="Print its archived container logs (archiveLogs) instead.")
def show(dispatch_id: str, failed_items: int, as_json: bool, logs: bool) -> int | None:
    """A dispatch's whole story: its events, attempts, disruptions, why it failed, its timings;
    for a map, its items' progress and its failed items with their reasons."""
    import json

    if logs:
        return _show_logs(dispatch_id)

    from rich.console import Console

    from k8s_dispatch.ops.show import read_story, render
    from k8s_dispatch.store.db import make_engine, make_sessionmaker, transaction

    engine = make_engine(_settings_with_database().database_url)
    try:
        with transaction(make_sessionmaker(engine)) as session:
            story = read_story(session, dispatch_id, failed_items=failed_items)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(story.to_dict(), indent=2, ensure_ascii=False))
    else:
        Console().print(render(story))
    return None


@cli.command()
@click.option("--count", default=30, show_default=True, type=click.IntRange(3, 500), help="Dispatches to run.")
@click.option(
    "--broker",
    type=click.Choice(["auto", "redis", "embedded"]),
    default="auto",
    show_default=True,
    help="auto: the Redis at K8S_DISPATCH_REDIS_URL if it answers, else an embedded one.",
)
@click.option("--timeout", "timeout_s", default=90.0, show_default=True, help="Seconds before the demo gives up.")
@click.option("--keep", is_flag=True, help="Keep the demo's temporary directory (logs, database) and print it.")
def demo(count: int, broker: str, timeout_s: float, keep: bool) -> int:
    """Run the whole system on embedded defaults, kill its worker mid-run, prove nothing was lost.

    Exits 0 only if every dispatch ended exactly once with the right output.
    """
    from k8s_dispatch import demo as demo_package

    demo_package.require_extra("demo")
    from k8s_dispatch.demo.run import run_demo

    summary = run_demo(count=count, broker=broker, timeout_s=timeout_s, keep=keep)
    return EXIT_OK if summary.ok else EXIT_FAILED


@cli.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower(flower_args: tuple[str, ...]) -> int:
    """Flower for this deployment (its own options: --port, --basic-auth, ...; --help lists them),
    its Broker page listing the engine's notification queue even while no engine reads it."""
    from k8s_dispatch.ops import flower as flower_ui

    return flower_ui.run(flower_args)


def _show_logs(dispatch_id: str) -> int:
    """`show --logs`: the logs from the object store, byte for byte; EXIT_FAILED if none is kept."""
    from k8s_dispatch.core.settings import get_settings
    from k8s_dispatch.ops.show import write_logs

    out = sys.stdout.buffer
    if write_logs(get_settings(), dispatch_id, out) == 0:
        click.echo(f"no archived log for dispatch {dispatch_id} (see its capability's archiveLogs)", err=True)
        return EXIT_FAILED
    out.flush()
    return EXIT_OK


def _settings_with_database() -> Settings:
    """The settings, once the database they name is there with our tables (a command that
    reads never creates one). Raises: ConfigError, DatabaseUnavailable (saying what to do)."""
    from k8s_dispatch.core.settings import get_settings
    from k8s_dispatch.ops.preflight import require_database

    settings = get_settings()
    require_database(settings.database_url)
    return settings


def _resolver(settings: Settings) -> CapabilityResolver:
    """The capabilities the settings name. Raises: ConfigError, first saying which file to fix."""
    from k8s_dispatch.workers.resolver import CapabilityResolver

    try:
        return CapabilityResolver.from_settings(settings)
    except ConfigError as e:
        raise ConfigError(
            f"fix the capabilities file {settings.capabilities} (K8S_DISPATCH_CAPABILITIES names it): {e}"
        ) from e


def _checked_runtime(settings: Settings) -> Runtime:
    """A Runtime whose capabilities, Kubernetes config, Redis and API server were each tried
    once, so that the first problem is one line saying what to fix, not a sweep's table of errors."""
    from k8s_dispatch.delivery.runtime import Runtime
    from k8s_dispatch.ops.preflight import require_api, require_redis
    from k8s_dispatch.tasks.app import app, celery_notifier
    from k8s_dispatch.tasks.task_events import failure_echo
    from k8s_dispatch.workers.kube import KubeClient

    resolver = _resolver(settings)
    try:
        kube = KubeClient.from_settings(settings)
    except ConfigError as e:
        raise ConfigError(f"set K8S_DISPATCH_KUBECONFIG to a kubeconfig for your cluster: {e}") from e
    runtime = Runtime.from_settings(settings, notifier=celery_notifier(settings), resolver=resolver, kube=kube)
    runtime.on_failed = failure_echo(app)
    try:
        require_redis(runtime.redis, settings.redis_url)
        require_api(runtime.kube, settings.namespace, kubeconfig=settings.kubeconfig)
    except BaseException:
        runtime.close()
        raise
    return runtime


def _limits(settings: Settings) -> Limits:
    """The capabilities file's limits, for `status` (none when the file cannot be read: the
    report still shows what waits)."""
    from k8s_dispatch.workers.resolver import CapabilityResolver

    try:
        return CapabilityResolver.from_settings(settings).limits
    except ConfigError as e:
        click.echo(f"warning: limits not shown: {e}", err=True)
        return Limits()


def _mount_subcommands() -> None:
    """`localcluster` is the demo's: without the demo extra it only says how to install it."""
    from k8s_dispatch import demo

    if demo.missing_extra():

        @cli.command(name="localcluster", context_settings={"ignore_unknown_options": True}, add_help_option=False)
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def localcluster_needs_the_demo_extra(args: tuple[str, ...]) -> None:
            """The embedded cluster of the demo and the tests (needs the demo extra)."""
            demo.require_extra("localcluster")

        return
    from k8s_dispatch.demo.localcluster.cli import localcluster

    cli.add_command(localcluster)


def run_group(group: click.Group, argv: list[str] | None, prog_name: str) -> int:
    """Run a click group, its errors as exit codes scripts can rely on (also the lab's)."""
    try:
        result = group.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_FAILED
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except DispatchError as e:
        click.echo(f"error: {e.reason}: {e}", err=True)
        return EXIT_CONFIG
    return result if isinstance(result, int) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    _mount_subcommands()
    return run_group(cli, argv, "k8s-dispatch")


if __name__ == "__main__":
    sys.exit(main())
