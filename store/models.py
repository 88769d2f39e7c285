"""The engine's tables as SQLAlchemy 2 typed models: cases, their event log, and dispatches.

`case_events` is the engine's append-only log; two partial unique indexes make "one
WORKER_SCHEDULED and at most one terminal event per dispatch" a property of the database, on
PostgreSQL and SQLite alike. `dispatches` is our working projection, written in the same
transaction as the events. The schema itself is created by the Alembic migration, not here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from k8s_dispatch.core.ids import MAX_ID_LENGTH, MAX_IDEMPOTENCY_KEY_LENGTH


class EventType(StrEnum):
    """The event types we write to the engine's log (the engine may write others)."""

    WORKER_SCHEDULED = "WORKER_SCHEDULED"
    WORKER_COMPLETED = "WORKER_COMPLETED"
    WORKER_FAILED = "WORKER_FAILED"
    WORKER_CANCELLED = "WORKER_CANCELLED"
    # Not terminal: a Pod of the dispatch was disrupted (evicted, preempted, its node lost) and
    # replaced; one per Pod (store/disruptions.py), so the engine sees "evicted, retried".
    WORKER_DISRUPTED = "WORKER_DISRUPTED"


TERMINAL_EVENT_TYPES: frozenset[EventType] = frozenset(
    {EventType.WORKER_COMPLETED, EventType.WORKER_FAILED, EventType.WORKER_CANCELLED}
)


class DispatchState(StrEnum):
    QUEUED = "QUEUED"  # row and WORKER_SCHEDULED written, waiting for a slot (core/limits.py)
    SCHEDULED = "SCHEDULED"  # row and WORKER_SCHEDULED written (and admitted), no Job yet
    CREATED = "CREATED"  # the Job exists in the cluster
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


# The states that hold a slot of a tenancy's or capability's limit: from admission to the end.
HOLDING_STATES: frozenset[DispatchState] = frozenset({DispatchState.SCHEDULED, DispatchState.CREATED})

TERMINAL_STATES: frozenset[DispatchState] = frozenset(
    {DispatchState.COMPLETED, DispatchState.FAILED, DispatchState.CANCELLED}
)

# The state a dispatch takes when its terminal event of this type is recorded.
STATE_FOR_TERMINAL_EVENT: dict[EventType, DispatchState] = {
    EventType.WORKER_COMPLETED: DispatchState.COMPLETED,
    EventType.WORKER_FAILED: DispatchState.FAILED,
    EventType.WORKER_CANCELLED: DispatchState.CANCELLED,
}

# The partial unique indexes' predicates, shared by the models and the migration so that
# `INSERT ... ON CONFLICT` can name the same predicate and the database can infer the index.
SCHEDULED_EVENT_PREDICATE = "type = 'WORKER_SCHEDULED'"
TERMINAL_EVENT_PREDICATE = "type IN ('WORKER_COMPLETED', 'WORKER_FAILED', 'WORKER_CANCELLED')"
QUEUED_PREDICATE = "state = 'QUEUED'"
HOLDING_PREDICATE = "state IN ('SCHEDULED', 'CREATED')"
UNNOTIFIED_PREDICATE = "notified_at IS NULL AND state IN ('COMPLETED', 'FAILED', 'CANCELLED')"
# Ended without their Job known stopped: a cancel or failure recorded while the Job may still
# run. They keep their slot (store/admission.py) until the sweep sees the Job finished or gone.
STOPPING_STATES: frozenset[DispatchState] = frozenset({DispatchState.FAILED, DispatchState.CANCELLED})
STOPPING_PREDICATE = "job_stopped_at IS NULL AND state IN ('FAILED', 'CANCELLED')"
TAMPERED_PREDICATE = "job_tampered_at IS NOT NULL"


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores `timestamptz`; SQLite has no time zones, so values are stored as naive
    UTC (which keeps its text comparisons in time order) and read back as aware UTC. Naive
    datetimes are refused rather than guessed at.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: use a timezone-aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _state_type() -> sa.Enum:
    # VARCHAR holding the enum's value, no CHECK constraint and no native PostgreSQL enum,
    # so that an engine in another language can write rows with plain strings.
    return sa.Enum(
        DispatchState,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda states: [s.value for s in states],
    )


class Base(DeclarativeBase):
    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_name)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UtcDateTime()}  # every datetime column is aware UTC

    if TYPE_CHECKING:  # every model here is mapped to a Table (SQLAlchemy types any FromClause)
        __table__: ClassVar[sa.Table]


class CaseInstance(Base):
    __tablename__ = "case_instances"

    id: Mapped[str] = mapped_column(sa.String(MAX_ID_LENGTH), primary_key=True)
    tenancy_id: Mapped[str] = mapped_column(sa.String(MAX_ID_LENGTH))
    state: Mapped[str] = mapped_column(sa.String(32), default="OPEN")
    data: Mapped[Any] = mapped_column(sa.JSON(none_as_null=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())

    def __repr__(self) -> str:
        return f"CaseInstance(id={self.id!r}, tenancy_id={self.tenancy_id!r}, state={self.state!r})"


class CaseEvent(Base):
    __tablename__ = "case_events"
    __table_args__ = (
        sa.Index("ix_case_events_case_id", "case_id", "id"),
        sa.Index(
            "uq_case_events_scheduled",
            "dispatch_id",
            unique=True,
            postgresql_where=sa.text(SCHEDULED_EVENT_PREDICATE),
            sqlite_where=sa.text(SCHEDULED_EVENT_PREDICATE),
        ),
        sa.Index(
            "uq_case_events_terminal",
            "dispatch_id",
            unique=True,
            postgresql_where=sa.text(TERMINAL_EVENT_PREDICATE),
            sqlite_where=sa.text(TERMINAL_EVENT_PREDICATE),
        ),
    )

    # INTEGER on SQLite, where only that spelling is an auto-incrementing rowid alias.
    id: Mapped[int] = mapped_column(
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    case_id: Mapped[str] = mapped_column(sa.String(MAX_ID_LENGTH), sa.ForeignKey("case_instances.id"))
    # Not a foreign key: the log is the engine's, and may name dispatches by id alone.
    dispatch_id: Mapped[str | None] = mapped_column(sa.String(36), nullable=True)
    type: Mapped[str] = mapped_column(sa.String(64))  # an EventType, or an engine's own type
    payload: Mapped[Any] = mapped_column(sa.JSON())
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())

    def __repr__(self) -> str:
        return (
            f"CaseEvent(id={self.id!r}, case_id={self.case_id!r}, dispatch_id={self.dispatch_id!r}, type={self.type!r})"
        )


class Dispatch(Base):
    __tablename__ = "dispatches"
    __table_args__ = (
        sa.UniqueConstraint("tenancy_id", "idempotency_key", name="uq_dispatches_tenancy_id_idempotency_key"),
        # Leads with state: serves "by state" and the sweep's keyset pages ordered by id.
        sa.Index("ix_dispatches_state", "state", "dispatch_id"),
        sa.Index("ix_dispatches_case_id", "case_id"),
        # The admission queues (store/admission.py): which have work, and each one's order.
        sa.Index(
            "ix_dispatches_queued",
            "tenancy_id",
            "capability",
            sa.text("priority DESC"),
            "created_at",
            "dispatch_id",
            postgresql_where=sa.text(QUEUED_PREDICATE),
            sqlite_where=sa.text(QUEUED_PREDICATE),
        ),
        # What holds a slot, by tenancy and capability: admission's count.
        sa.Index(
            "ix_dispatches_holding",
            "tenancy_id",
            "capability",
            postgresql_where=sa.text(HOLDING_PREDICATE),
            sqlite_where=sa.text(HOLDING_PREDICATE),
        ),
        # Ended dispatches whose Job may still run: what the sweep stops, and admission counts.
        sa.Index(
            "ix_dispatches_stopping",
            "dispatch_id",
            postgresql_where=sa.text(STOPPING_PREDICATE),
            sqlite_where=sa.text(STOPPING_PREDICATE),
        ),
        # Dispatches whose Job the sweep found hand-edited: what it looks at again, by name.
        sa.Index(
            "ix_dispatches_tampered",
            "dispatch_id",
            postgresql_where=sa.text(TAMPERED_PREDICATE),
            sqlite_where=sa.text(TAMPERED_PREDICATE),
        ),
        # Terminal dispatches the engine was not told about yet: what the sweep re-notifies.
        sa.Index(
            "ix_dispatches_unnotified",
            "dispatch_id",
            postgresql_where=sa.text(UNNOTIFIED_PREDICATE),
            sqlite_where=sa.text(UNNOTIFIED_PREDICATE),
        ),
    )

    dispatch_id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)  # uuid4 text
    case_id: Mapped[str] = mapped_column(sa.String(MAX_ID_LENGTH), sa.ForeignKey("case_instances.id"))
    tenancy_id: Mapped[str] = mapped_column(sa.String(MAX_ID_LENGTH))
    capability: Mapped[str] = mapped_column(sa.String(253))
    worker_name: Mapped[str] = mapped_column(sa.String(253))
    idempotency_key: Mapped[str] = mapped_column(sa.String(MAX_IDEMPOTENCY_KEY_LENGTH))
    input: Mapped[Any] = mapped_column(sa.JSON())
    state: Mapped[DispatchState] = mapped_column(_state_type(), default=DispatchState.SCHEDULED)
    job_name: Mapped[str | None] = mapped_column(sa.String(253), nullable=True)
    job_namespace: Mapped[str | None] = mapped_column(sa.String(63), nullable=True)
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    reason: Mapped[str | None] = mapped_column(sa.Text(), nullable=True)  # the terminal reason
    output: Mapped[Any] = mapped_column(sa.JSON(none_as_null=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())
    job_created_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # Set once the engine's notification was sent (after the terminal event committed).
    notified_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # Why the last create of its Job failed for now (403 exceeded quota, ...); history once
    # job_created_at is later.
    create_error: Mapped[str | None] = mapped_column(sa.Text(), nullable=True)
    create_error_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # Within its tenancy's queue: higher first (then first in, first out). Only a queued one's
    # matters.
    priority: Mapped[int] = mapped_column(default=0, server_default="0")
    admitted_at: Mapped[datetime | None] = mapped_column(nullable=True)  # QUEUED -> SCHEDULED
    # When its Job was known to run no more (seen finished or gone), for a dispatch that ended
    # FAILED or CANCELLED: until then it holds its slot (a COMPLETED one's Job has finished).
    job_stopped_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # When the sweep first found its Job's labels or annotations disagreeing with the row (a
    # hand edit): the clock after which it fails `JobTampered`; cleared if the Job agrees again.
    job_tampered_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # A secret input (`schedule(..., secret=True)`), as a Fernet token (store/secret_inputs.py): then
    # `input` is null and the event log holds no trace of it; a re-created Job's Secret is made
    # from it again.
    secret_input: Mapped[str | None] = mapped_column(sa.Text(), nullable=True)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def __repr__(self) -> str:
        return f"Dispatch(dispatch_id={self.dispatch_id!r}, case_id={self.case_id!r}, state={self.state!r})"


class DispatchAdmission(Base):
    """One row: an admission pass takes its lock first, so passes run one at a time."""

    __tablename__ = "dispatch_admission"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    passes: Mapped[int] = mapped_column(sa.BigInteger(), default=0, server_default="0")


# --- fan-out (issue 29): a map dispatch over items, as one Indexed Job --------------------------


class ItemEventType(StrEnum):
    """An item's one end, written to the engine's log beside its map's events (`store/maps.py`)."""

    ITEM_COMPLETED = "WORKER_ITEM_COMPLETED"
    ITEM_FAILED = "WORKER_ITEM_FAILED"
    ITEM_CANCELLED = "WORKER_ITEM_CANCELLED"


# The item end a map's own terminal event imposes on the items still open when it is recorded.
ITEM_END_FOR_MAP_END: dict[EventType, ItemEventType] = {
    EventType.WORKER_COMPLETED: ItemEventType.ITEM_FAILED,
    EventType.WORKER_FAILED: ItemEventType.ITEM_FAILED,
    EventType.WORKER_CANCELLED: ItemEventType.ITEM_CANCELLED,
}


class DispatchMap(Base):
    """A map dispatch's shape: its `dispatches` row is the map; this says it is one, and how it runs."""

    __tablename__ = "dispatch_maps"

    dispatch_id: Mapped[str] = mapped_column(
        sa.String(36), sa.ForeignKey("dispatches.dispatch_id", ondelete="CASCADE"), primary_key=True
    )
    items: Mapped[int] = mapped_column()  # the Indexed Job's completions
    # The Job's parallelism: as asked, or narrowed at admission to the slots granted
    # (store/admission.py); what was asked stays in the dispatch's input["map"].
    parallelism: Mapped[int] = mapped_column()
    max_failed_items: Mapped[int | None] = mapped_column(nullable=True)  # maxFailedIndexes; None: no limit
    min_succeeded: Mapped[int | None] = mapped_column(nullable=True)  # None: every item must succeed
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())


class MapItem(Base):
    """One item's input, by its index (the Pod's JOB_COMPLETION_INDEX)."""

    __tablename__ = "map_items"

    dispatch_id: Mapped[str] = mapped_column(
        sa.String(36), sa.ForeignKey("dispatch_maps.dispatch_id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    input: Mapped[Any] = mapped_column(sa.JSON())


class MapItemEnd(Base):
    """An item's one end. The primary key (dispatch, item) is the arbiter: an end is written by
    `INSERT ... ON CONFLICT DO NOTHING`, and only the writer that inserted it writes the item's
    event to the engine's log (`event_id`)."""

    __tablename__ = "map_item_ends"

    dispatch_id: Mapped[str] = mapped_column(
        sa.String(36), sa.ForeignKey("dispatch_maps.dispatch_id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    type: Mapped[str] = mapped_column(sa.String(64))  # an ItemEventType
    output: Mapped[Any] = mapped_column(sa.JSON(none_as_null=True), nullable=True)
    reason: Mapped[str | None] = mapped_column(sa.Text(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=sa.func.now())
