"""The engine's store: case_instances, case_events (append-only log), dispatches.

Revision ID: 0001
Revises:
Create Date: 2024-11-29

Hand-written, and self-contained on purpose: the predicates are spelled out here rather than
imported, so this revision keeps creating the same schema whatever the models become.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEDULED = "type = 'WORKER_SCHEDULED'"
TERMINAL = "type IN ('WORKER_COMPLETED', 'WORKER_FAILED', 'WORKER_CANCELLED')"


def _timestamp(name: str, *, nullable: bool = False, default_now: bool = True) -> sa.Column[datetime]:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        nullable=nullable,
        server_default=sa.func.now() if default_now else None,
    )


def upgrade() -> None:
    op.create_table(
        "case_instances",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("tenancy_id", sa.String(128), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_case_instances"),
    )

    op.create_table(
        "case_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("case_id", sa.String(128), nullable=False),
        sa.Column("dispatch_id", sa.String(36), nullable=True),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_case_events"),
        sa.ForeignKeyConstraint(["case_id"], ["case_instances.id"], name="fk_case_events_case_id_case_instances"),
    )
    op.create_index("ix_case_events_case_id", "case_events", ["case_id", "id"])
    op.create_index(
        "uq_case_events_scheduled",
        "case_events",
        ["dispatch_id"],
        unique=True,
        postgresql_where=sa.text(SCHEDULED),
        sqlite_where=sa.text(SCHEDULED),
    )
    op.create_index(
        "uq_case_events_terminal",
        "case_events",
        ["dispatch_id"],
        unique=True,
        postgresql_where=sa.text(TERMINAL),
        sqlite_where=sa.text(TERMINAL),
    )

    op.create_table(
        "dispatches",
        sa.Column("dispatch_id", sa.String(36), nullable=False),
        sa.Column("case_id", sa.String(128), nullable=False),
        sa.Column("tenancy_id", sa.String(128), nullable=False),
        sa.Column("capability", sa.String(253), nullable=False),
        sa.Column("worker_name", sa.String(253), nullable=False),
        sa.Column("idempotency_key", sa.String(256), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("job_name", sa.String(253), nullable=True),
        sa.Column("job_namespace", sa.String(63), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("output", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("job_created_at", nullable=True, default_now=False),
        _timestamp("finished_at", nullable=True, default_now=False),
        sa.PrimaryKeyConstraint("dispatch_id", name="pk_dispatches"),
        sa.ForeignKeyConstraint(["case_id"], ["case_instances.id"], name="fk_dispatches_case_id_case_instances"),
        sa.UniqueConstraint("tenancy_id", "idempotency_key", name="uq_dispatches_tenancy_id_idempotency_key"),
    )
    op.create_index("ix_dispatches_state", "dispatches", ["state", "dispatch_id"])
    op.create_index("ix_dispatches_case_id", "dispatches", ["case_id"])


def downgrade() -> None:
    op.drop_table("dispatches")  # its indexes go with it
    op.drop_table("case_events")
    op.drop_table("case_instances")
