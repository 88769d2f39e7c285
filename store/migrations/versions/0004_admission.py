"""Fair-share admission: dispatches.priority, admitted_at, the queue's index, the admission turn.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

A dispatch under a limit is written QUEUED (the state column is a plain string: no type
change) and admitted, QUEUED -> SCHEDULED, by `store/admission.py` when a slot is free.
`ix_dispatches_queued` serves two of admission's reads, each O(what it returns): which
(tenancy, capability) queues have work (a skip scan) and each queue's first dispatches in
order (priority, then first in); `ix_dispatches_holding` the count of what holds slots, by
tenancy and capability, whatever the table's statistics say (a fresh burst of queued rows had
PostgreSQL scan the whole tenancy through the idempotency index before its first ANALYZE). `dispatch_admission` has one row: admission passes take it in
turn (the row's lock), so that two replicas never fill the same free slot.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

QUEUED = "state = 'QUEUED'"
HOLDING = "state IN ('SCHEDULED', 'CREATED')"


def upgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_dispatches_queued",
        "dispatches",
        ["tenancy_id", "capability", sa.text("priority DESC"), "created_at", "dispatch_id"],
        postgresql_where=sa.text(QUEUED),
        sqlite_where=sa.text(QUEUED),
    )
    op.create_index(
        "ix_dispatches_holding",
        "dispatches",
        ["tenancy_id", "capability"],
        postgresql_where=sa.text(HOLDING),
        sqlite_where=sa.text(HOLDING),
    )
    turn = op.create_table(
        "dispatch_admission",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("passes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.bulk_insert(turn, [{"id": 1, "passes": 0}])


def downgrade() -> None:
    op.drop_table("dispatch_admission")
    op.drop_index("ix_dispatches_holding", table_name="dispatches")
    op.drop_index("ix_dispatches_queued", table_name="dispatches")
    with op.batch_alter_table("dispatches") as batch:
        batch.drop_column("admitted_at")
        batch.drop_column("priority")
