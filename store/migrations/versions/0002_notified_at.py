"""dispatches.notified_at: when the engine was told of the dispatch's end.

Revision ID: 0002
Revises: 0001
Create Date: 2024-11-29

The notification is sent after the terminal event commits; a crash in between leaves a
terminal dispatch with no `notified_at`, which the recovery sweep notifies again (at least
once). A partial index keeps finding those rows cheap however many dispatches have ended.
Rows already terminal before this revision count as notified.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UNNOTIFIED = "notified_at IS NULL AND state IN ('COMPLETED', 'FAILED', 'CANCELLED')"


def upgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.add_column(sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE dispatches SET notified_at = COALESCE(finished_at, updated_at) "
        "WHERE state IN ('COMPLETED', 'FAILED', 'CANCELLED')"
    )
    op.create_index(
        "ix_dispatches_unnotified",
        "dispatches",
        ["dispatch_id"],
        postgresql_where=sa.text(UNNOTIFIED),
        sqlite_where=sa.text(UNNOTIFIED),
    )


def downgrade() -> None:
    op.drop_index("ix_dispatches_unnotified", table_name="dispatches")
    with op.batch_alter_table("dispatches") as batch:
        batch.drop_column("notified_at")
